"""A Spark standalone cluster (one master, one worker) as separate JVM processes from the PySpark install.

Used to prove that projections run on a real cluster by configuration only. Executors can be given a
Python that does NOT see the working tree (`isolated_python`), so the code must be shipped to them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from kappaflow.testing.servers._process import ManagedProcess, ServerStartError, free_port, wait_until


def spark_class() -> Path:
    import pyspark

    path = Path(pyspark.__file__).parent / "bin" / "spark-class"
    if not path.exists():
        raise ServerStartError(f"spark-class not found at {path}")
    return path


class _SparkDaemon(ManagedProcess):
    def __init__(self, name: str, argv: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        super().__init__(workdir)
        self._argv = argv
        self._env = env

    def start(self) -> _SparkDaemon:
        self._spawn(self._argv, env=self._env)
        return self


class SparkStandalone:
    """`spark://127.0.0.1:PORT` with one worker of `cores` cores; stop() ends both JVMs."""

    def __init__(self, *, cores: int = 2, memory: str = "2g", workdir: Path | None = None,
                 executor_python: str | None = None) -> None:
        import tempfile

        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kappaflow-spark-"))
        self.host = "127.0.0.1"
        self.port = free_port()
        self.ui_port = free_port()
        self.cores = cores
        self.memory = memory
        self.executor_python = executor_python or sys.executable
        self.master: _SparkDaemon | None = None
        self.worker: _SparkDaemon | None = None

    @property
    def url(self) -> str:
        return f"spark://{self.host}:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"SPARK_LOCAL_IP": self.host, "SPARK_LOG_DIR": str(self.workdir / "logs"),
                    "SPARK_WORKER_DIR": str(self.workdir / "work"), "PYSPARK_PYTHON": self.executor_python,
                    "SPARK_NO_DAEMONIZE": "1"})
        return env

    def start(self, timeout: float = 90.0) -> SparkStandalone:
        cls = str(spark_class())
        self.master = _SparkDaemon("spark-master", [
            cls, "org.apache.spark.deploy.master.Master", "--host", self.host, "--port", str(self.port),
            "--webui-port", str(self.ui_port)], self._env(), self.workdir / "master").start()
        self.worker = _SparkDaemon("spark-worker", [
            cls, "org.apache.spark.deploy.worker.Worker", self.url, "--host", self.host,
            "--cores", str(self.cores), "--memory", self.memory, "--webui-port", str(free_port()),
            "--work-dir", str(self.workdir / "work")], self._env(), self.workdir / "worker").start()

        def tails() -> str:
            return "\n".join(d.log_tail() for d in (self.master, self.worker) if d)

        wait_until(self._worker_alive, timeout=timeout, what=f"a live worker registered at {self.url}",
                   interval=0.25, on_timeout=tails)
        return self

    def _worker_alive(self) -> bool:
        for daemon in (self.master, self.worker):
            if daemon:
                daemon._check_alive()
        with urllib.request.urlopen(f"http://{self.host}:{self.ui_port}/json/", timeout=2) as resp:
            state = json.loads(resp.read())
        return any(w.get("state") == "ALIVE" for w in state.get("workers", []))

    def stop(self) -> None:
        for daemon in (self.worker, self.master):
            if daemon:
                daemon.stop()
        import shutil

        shutil.rmtree(self.workdir, ignore_errors=True)


def isolated_python(venv_dir: Path) -> str:
    """A Python that sees the current venv's third-party packages but NOT kappaflow's working tree.

    The editable install is a `.pth` finder inside site-packages; adding that folder as a plain path
    entry (not a site dir) skips the `.pth` files, so `import kappaflow` only works when the code was
    shipped (e.g. a wheel added with `SparkContext.addPyFile`).
    """
    import site
    import venv

    if not (venv_dir / "bin" / "python").exists():
        venv.EnvBuilder(with_pip=False, symlinks=True).create(venv_dir)
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(venv_dir / "bin" / "python"), "-c", probe],
                         capture_output=True, text=True, check=True).stdout.strip()
    packages = [p for p in site.getsitepackages() if p.endswith("site-packages")]
    Path(out, "kappaflow-deps.pth").write_text("\n".join(packages) + "\n")
    return str(venv_dir / "bin" / "python")
