#!/usr/bin/env bash
# Create .venv and install kappaflow with everything the tests, benchmarks and demo need.
# Re-runs are cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.kappaflow-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing kappaflow[dev,bench] into .venv (first run downloads pyspark, ~5 min)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,bench]'
  echo "$want" > "$stamp"
fi
# The compose test validates compose/docker-compose.yml with Debian's docker-compose (no engine needed).
if ! command -v docker-compose >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: installing docker-compose (Debian package) to validate compose/" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >/dev/null 2>&1 \
    || echo "bootstrap: could not install docker-compose; tests/compose will fail" >&2
fi
# Monitoring tests: a real Prometheus server scrapes kappaflow's /metrics, and the status page is checked in
# headless Chromium driven through chromedriver (Debian packages; the tests skip, saying why, without them).
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: installing ${missing[*]} (Debian packages) for the monitoring tests" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") \
    >/dev/null 2>&1 || echo "bootstrap: could not install ${missing[*]}; tests/monitoring will skip those tests" >&2
fi
if ! command -v java >/dev/null 2>&1; then
  echo "bootstrap: Java 17+ is required by Spark (apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi
