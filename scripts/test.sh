#!/usr/bin/env bash
# Quickstart 2: install everything, lint, type-check and run the whole test suite
# (private PostgreSQL, MariaDB, Redis, tansu and osmem servers start inside the run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
.venv/bin/ruff check .
.venv/bin/python scripts/typecheck.py  # mypy over the installed layout (see the script)
exec .venv/bin/pytest "$@"
