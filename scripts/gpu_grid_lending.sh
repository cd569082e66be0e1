#!/usr/bin/env bash
# One call's share of the vLLM GPU grid on a lent machine (vLLM 0.25.1 installed there with
# scripts/vllm_offline_wheelhouse.py), run from the repository root through the device tool:
#
#   bash scripts/gpu_grid_lending.sh COMMIT POINTS [GPUS] [MINUTES] [EXTRA...]
#
# COMMIT: the checkout's `git rev-parse --short HEAD` (the copy on the machine has no .git);
# POINTS: e.g. 4x8,8x8; GPUS: points at once (--gpus); MINUTES: --max-minutes (default 9.3, a
# call's 10 minutes less the start); EXTRA: more vllm_gpu_bench.py arguments (--reuse-baselines).
# Rows accumulate in /root/grid.json across the calls of one lending (seeded from the repo's
# H200 grid) and are copied to $OUT/grid.json after each configuration's round, so a call cut
# short still returns what it measured; the log goes to $OUT/log. The fs tiers get 24.5 GiB
# each, the size the single H200's 64 GiB disk gave.
set -euo pipefail
commit=${1:?commit}
points=${2:?points, e.g. 4x8,8x8}
gpus=${3:-1}
minutes=${4:-9.3}
shift $(( $# < 4 ? $# : 4 ))
out=${OUT:?the device tool sets OUT}
[ -e /root/grid.json ] || cp docs/results/vllm_gpu_bench_grid_h200.json /root/grid.json
cp /root/grid.json "$out/grid.json"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
rm -rf /tmp/kvtier-gpu-bench /dev/shm/vllm_offload_*
status=0
python3 benchmarks/vllm_gpu_bench.py --grid --grid-points "$points" --gpus "$gpus" \
    --fs-gib 24.5 --commit "$commit" --json "$out/grid.json" --skip-done \
    --max-minutes "$minutes" "$@" > "$out/log" 2>&1 || status=$?
cp "$out/grid.json" /root/grid.json
rm -rf /tmp/kvtier-gpu-bench /dev/shm/vllm_offload_*
grep -E "^\[|stopping|took [0-9.]+ min" "$out/log" || true
df -h / | tail -1
exit "$status"
