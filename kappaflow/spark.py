"""Build the SparkSession for projections from `[spark]` config, locally or on a cluster.

On a cluster, executors need kappaflow's code (and the user's projection module). It is shipped the
way `spark-submit --py-files` would: a zip of the importable packages added with `addPyFile`, built
from the import system so it works for wheels and editable installs alike.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from kappaflow.config import SparkConfig

_SHIPPED = ("kappaflow", "kappaflow.connectors", "kappaflow.projections", "kappaflow.ledger",
            "kappaflow.migrations")


def build_session(config: SparkConfig, *, ship_modules: Iterable[str] = ()) -> SparkSession:
    """A SparkSession for `config`; `ship_modules` names extra top-level modules (e.g. `examples`)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(config.master).appName(config.app_name)
    defaults = {"spark.sql.session.timeZone": "UTC", "spark.ui.showConsoleProgress": "false",
                "spark.sql.shuffle.partitions": "8" if config.master.startswith("local") else "32"}
    for key, value in {**defaults, **config.conf}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if not config.master.startswith("local"):
        session.sparkContext.addPyFile(str(code_archive(ship_modules)))
    from kappaflow.projections.datasource import register

    register(session)
    return session


def code_archive(extra_modules: Iterable[str] = (), target_dir: Path | None = None) -> Path:
    """A zip with kappaflow's packages (mapped folders re-rooted under `kappaflow/`) and `extra_modules`."""
    import importlib

    out_dir = target_dir or Path(tempfile.mkdtemp(prefix="kappaflow-pyfiles-"))
    path = out_dir / "kappaflow-code.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in (*_SHIPPED, *extra_modules):
            module = importlib.import_module(name)
            arc_root = Path(*name.split("."))
            roots = list(getattr(module, "__path__", []))
            if not roots:  # a plain module
                file = Path(module.__file__ or "")
                zf.write(file, str(arc_root.with_suffix(".py")))
                continue
            root = Path(roots[0])
            for file in root.rglob("*"):
                rel = file.relative_to(root)
                if file.is_dir() or "__pycache__" in rel.parts or file.suffix in (".pyc", ".pyo"):
                    continue
                # Mapped sub-packages are added under their own name; don't nest kappaflow/connectors twice.
                if name == "kappaflow" and rel.parts and rel.parts[0] in ("connectors", "projections", "ledger",
                                                                          "migrations"):
                    continue
                zf.write(file, str(arc_root / rel))
    return path
