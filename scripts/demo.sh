#!/usr/bin/env bash
# Quickstart 1: the main job end to end on the embedded log and Spark local[*].
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/kappaflow demo "$@"
