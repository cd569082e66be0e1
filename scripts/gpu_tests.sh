#!/usr/bin/env bash
# On the GPU machine (no network): install vLLM from the staged wheelhouse parts when it is not
# there yet (scripts/vllm_offline_wheelhouse.py), then run the GPU tests: the CUDA copy backend
# and kvtier inside real vLLM. Logs go to $OUT (or ./gpu-out). Usage: bash scripts/gpu_tests.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/tests/e2e${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
if ! python3 -c "import vllm" >/dev/null 2>&1; then
    python3 scripts/vllm_offline_wheelhouse.py install 2>&1 | tail -20 || exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
} | tee "$out/machine.txt"
if [[ $# -eq 0 ]]; then
    set -- tests/copy/cuda/test_cuda_backend.py tests/copy/cuda/test_cuda_worker.py tests/e2e/test_vllm_gpu_e2e.py
fi
python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log"
exit "${PIPESTATUS[0]}"
