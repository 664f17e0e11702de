#!/usr/bin/env bash
# Quickstart 2: install everything, lint, type-check and run the whole test suite
# (private PostgreSQL, MariaDB, Redis, tansu and osmem servers start inside the run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
.venv/bin/ruff check .
.venv/bin/python scripts/typecheck.py  # mypy over the installed layout (see the script)
# Two workers (KF_TEST_WORKERS to change; 0 runs in this process), each taking whole test files: a
# file's module fixtures and the session's private servers are started once per worker.
exec .venv/bin/pytest -n "${KF_TEST_WORKERS:-2}" --dist loadfile "$@"
