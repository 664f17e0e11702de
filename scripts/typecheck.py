"""Type-check kappaflow as it is installed: one package, ``kappaflow``.

The repository keeps ``connectors/``, ``projections/``, ``ledger/`` and ``migrations/`` next to
``kappaflow/`` and maps them into it (``package-dir`` in pyproject.toml). mypy cannot follow that
mapping: run over the folders as they lie, it resolves ``import kappaflow.connectors...`` to
nothing and (with ``ignore_missing_imports``) types every such import as ``Any``, so calls across
those packages go unchecked. This script builds the installed layout out of symlinks in a scratch
directory, runs mypy there with the project's settings, and prints the findings with repository
paths. Exit status is mypy's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("connectors", "projections", "ledger", "migrations")  # kappaflow.<name> lives in <name>/


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kf-typecheck-") as tmp:
        top = Path(tmp) / "kappaflow"
        top.mkdir()
        for entry in (ROOT / "kappaflow").iterdir():
            if entry.name != "__pycache__":
                (top / entry.name).symlink_to(entry)
        for name in MAPPED:
            (top / name).symlink_to(ROOT / name)
        run = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
             "--cache-dir", str(ROOT / ".mypy_cache"), "kappaflow"],
            cwd=tmp, capture_output=True, text=True,
        )
    mapped = "|".join(MAPPED)
    for stream, text in ((sys.stdout, run.stdout), (sys.stderr, run.stderr)):
        # kappaflow/connectors/x.py -> connectors/x.py: the file a reader opens
        stream.write(re.sub(rf"(?m)^kappaflow{re.escape(os.sep)}({mapped}){re.escape(os.sep)}", r"\1/", text))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
