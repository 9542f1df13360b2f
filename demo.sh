#!/usr/bin/env bash
# Set up (idempotent) and run the embedded demo: a SQLite ledger, two local engines, a trainer
# publishing versions while multi-turn sessions generate, a reclaim and an engine restart.
# Extra arguments go to `loraledger demo`, e.g. ./demo.sh --quick
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[engine,plot]' 2>&1 \
  | { grep -v "is ignored" || true; }
exec .venv/bin/loraledger demo "$@"
