"""Ship kappaflow's code to Spark executors on a cluster.

Executors need kappaflow's code (the data source reader, folds) and sometimes the user's projection
module. It is shipped the way `spark-submit --py-files` would: a zip of the importable packages added
with `addPyFile` (see `kappaflow.projections.runtime.spark_session`), built from the import system so it
works for wheels and editable installs alike.
"""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

_SHIPPED = ("kappaflow", "kappaflow.connectors", "kappaflow.projections", "kappaflow.ledger",
            "kappaflow.migrations")


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
