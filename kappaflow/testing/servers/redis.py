"""A private Redis server (no persistence) on a free loopback port."""

from __future__ import annotations

import shutil
from pathlib import Path

from kappaflow.testing.servers._process import LoopbackServer, ServerStartError


class PrivateRedis(LoopbackServer):
    name = "redis"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 30.0) -> PrivateRedis:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise ServerStartError("redis-server not found; install redis-server")
        self._spawn([binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                     "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no"])
        self._wait_ready(timeout, f"Redis on {self.host}:{self.port}")
        return self

    def _ready(self) -> bool:
        self._check_alive()
        import redis

        return bool(redis.Redis(host=self.host, port=self.port, socket_timeout=1).ping())
