"""Shared plumbing for private server processes: free ports, bounded readiness waits, clean stop."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from kappaflow.errors import KappaflowError


class ServerStartError(KappaflowError):
    """A private server did not become ready; carries the tail of its log."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks; tiny race accepted for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.05,
               on_timeout: Callable[[], str] | None = None) -> None:
    """Poll `check` until it returns True; raise with a clear message after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except ServerStartError:
            raise
        except Exception as exc:  # readiness probes fail until the server is up
            last_error = exc
        time.sleep(interval)
    detail = f" (last error: {last_error})" if last_error else ""
    extra = f"\n{on_timeout()}" if on_timeout else ""
    raise ServerStartError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{extra}")


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def as_user(user: str | None, argv: Sequence[str]) -> list[str]:
    """Run as `user` when we are root (PostgreSQL and MariaDB refuse to run as root)."""
    if user and os.geteuid() == 0:
        return ["runuser", "-u", user, "--", *argv]
    return list(argv)


def chown_tree(path: Path, user: str | None) -> None:
    if user and os.geteuid() == 0:
        shutil.chown(path, user=user, group=user)
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                shutil.chown(os.path.join(root, name), user=user, group=user)


class ManagedProcess:
    """A child server process with a work dir, a log file and a clean stop."""

    name = "server"

    def __init__(self, workdir: str | Path | None = None, *, keep: bool = False) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"kappaflow-{self.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o755)
        self.logfile = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.keep = keep

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return f"({self.name} log unavailable)"
        return f"--- last lines of {self.logfile} ---\n" + "\n".join(text[-lines:])

    def _spawn(self, argv: Sequence[str], env: dict[str, str] | None = None, *,
               hold_stdin: bool = False) -> None:
        """Start the child; `hold_stdin` keeps a pipe open for servers that exit when stdin closes."""
        log = open(self.logfile, "ab")  # noqa: SIM115 - handed to the child for its lifetime
        self.proc = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if hold_stdin else subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
        log.close()

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerStartError(f"{self.name} exited with code {self.proc.returncode}\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        if self._own_dir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LoopbackServer(ManagedProcess):
    """A server listening on 127.0.0.1 (`port` or a free one), ready once `_ready()` says so."""

    def __init__(self, *, port: int | None = None, workdir: str | Path | None = None, keep: bool = False) -> None:
        super().__init__(workdir, keep=keep)
        self.host = "127.0.0.1"
        self.port = port or free_port()

    def _ready(self) -> bool:
        raise NotImplementedError

    def _wait_ready(self, timeout: float, what: str) -> None:
        """Poll `_ready` (bounded); the timeout error carries the tail of the server's log."""
        wait_until(self._ready, timeout=timeout, what=what, on_timeout=self.log_tail)
