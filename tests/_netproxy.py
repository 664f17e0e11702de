"""A TCP proxy in front of a real server that a test can cut and heal: a network partition
between one client and the server, while other clients reach the server directly.

``cut()`` closes every connection through the proxy and makes new ones fail at once (accepted
and closed), so the client sees resets and refused requests, not a hang; ``heal()`` lets new
connections through again.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._cut = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="test-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or self._cut.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._close(s)

    def _close(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            socks = list(self._open)
        for s in socks:
            self._close(s)

    def heal(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closing.set()
        self.cut()
        self._listener.close()


@contextmanager
def proxy_to(host: str, port: int) -> Iterator[TcpProxy]:
    p = TcpProxy(host, port)
    try:
        yield p
    finally:
        p.close()
