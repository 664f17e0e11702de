"""The `osmem` in-memory OpenSearch-compatible server from the osmem-server wheel."""

from __future__ import annotations

from pathlib import Path

from kappaflow.testing.servers._process import LoopbackServer, ServerStartError


def osmem_binary() -> Path:
    try:
        import osmem_server
    except ImportError:
        raise ServerStartError("osmem-server is not installed: pip install 'kappaflow[dev]'") from None
    path = Path(osmem_server.__file__).parent / "bin" / "osmem-server"
    if not path.exists():
        raise ServerStartError(f"osmem-server binary missing at {path}")
    return path


class OsmemServer(LoopbackServer):
    name = "osmem"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> OsmemServer:
        binary = osmem_binary()
        binary.chmod(binary.stat().st_mode | 0o111)
        # osmem exits when its stdin closes: hold a pipe open for its lifetime.
        self._spawn([str(binary), "-addr", f"{self.host}:{self.port}"], hold_stdin=True)
        self._wait_ready(timeout, f"osmem on {self.url}")
        return self

    def _ready(self) -> bool:
        self._check_alive()
        import urllib.request

        with urllib.request.urlopen(self.url + "/", timeout=1) as resp:
            return bool(resp.status == 200)
