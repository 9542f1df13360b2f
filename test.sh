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
exec .venv/bin/python -m pytest "$@"
