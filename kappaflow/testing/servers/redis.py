"""A private Redis server (no persistence) on a free loopback port."""

from __future__ import annotations

import shutil
from pathlib import Path

from kappaflow.testing.servers._process import ManagedProcess, ServerStartError, free_port, wait_until


class PrivateRedis(ManagedProcess):
    name = "redis"

    def __init__(self, *, port: int | None = None, workdir: str | Path | None = None) -> None:
        super().__init__(workdir)
        self.host = "127.0.0.1"
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 30.0) -> PrivateRedis:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            raise ServerStartError("redis-server not found; install redis-server")
        self._spawn([binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                     "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no"])
        wait_until(self._ready, timeout=timeout, what=f"Redis on {self.host}:{self.port}",
                   on_timeout=self.log_tail)
        return self

    def _ready(self) -> bool:
        self._check_alive()
        import redis

        return bool(redis.Redis(host=self.host, port=self.port, socket_timeout=1).ping())
