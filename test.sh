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
# Debian packages some tests need, installed when their command is missing (root only, as for
# PostgreSQL above); without one, its tests fail under CI=true and skip elsewhere.
need_debian_package() {  # COMMAND PACKAGE
  command -v "$1" >/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null; }
  else
    echo "test.sh: no $1; install Debian's $2 package" >&2
  fi
}
# The alert rules of deploy/ are checked with promtool (only it, of the prometheus package).
need_debian_package promtool prometheus
# The live page (/ui) is tested in a real headless browser, driven over its DevTools pipe.
need_debian_package chromium chromium
# --durations: every run names its slowest tests, so the suite's wall time stays watched.
exec .venv/bin/python -m pytest --durations=25 "$@"
