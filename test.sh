#!/usr/bin/env bash
# Set up (idempotent) and run every check CI runs: lint, format, types, the whole test suite
# (including the real-vLLM integration tests, which build their own engine venv on first run).
# Extra arguments go to pytest, e.g. ./test.sh --slow  or  ./test.sh tests/evlog -x
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[engine,ray,postgres,plot,dev]' 2>&1 \
  | { grep -v "is ignored" || true; }
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy  # files and strictness: [tool.mypy] in pyproject.toml
# The PostgreSQL store's tests start their own throwaway server (tools/pg_server.py): install
# Debian's server package when no server binary is here (root only: CI is a fresh root
# machine), without the package's own always-running cluster. Without one, those tests fail
# under CI=true and skip elsewhere.
if ! .venv/bin/python -c 'import sys; from tools.pg_server import find_bin_dir as f; sys.exit(f() is None)'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    mkdir -p /etc/postgresql-common
    [ -e /etc/postgresql-common/createcluster.conf ] \
      || echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.conf
    export DEBIAN_FRONTEND=noninteractive UCF_FORCE_CONFFOLD=1  # keep our createcluster.conf
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold \
      -o Dpkg::Options::=--force-confdef postgresql >/dev/null
  else
    echo "test.sh: no PostgreSQL server binaries; install Debian's postgresql package" >&2
  fi
fi
# The alert rules of deploy/ are checked with promtool, from Debian's prometheus package (only
# promtool is used). Without it, those tests fail under CI=true and skip elsewhere.
if ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
  else
    echo "test.sh: no promtool; install Debian's prometheus package" >&2
  fi
fi
# The live page (/ui) is tested in a real headless browser, Debian's chromium (driven over its
# DevTools pipe). Without it, that test fails under CI=true and skips elsewhere.
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
  else
    echo "test.sh: no chromium; install Debian's chromium package" >&2
  fi
fi
# --durations: every run names its slowest tests, so the suite's wall time stays watched.
exec .venv/bin/python -m pytest --durations=25 "$@"
