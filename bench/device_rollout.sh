#!/usr/bin/env bash
# GPU decode backend on the lent GPU: kernel/decoder tests, then bench/rollout.py (sweep + peer).
# Run from the repo root on the device (torch + triton + transformers there; tracerl not installed):
#     OUT=/path/to/out bash bench/device_rollout.sh
# Writes $OUT/{env.txt,gpu_test.log,rollout.log,rollout.json,peer.log,peer.json}. Each step has a
# time limit so that the whole run stays under 10 minutes. BENCH_ARGS adds bench/rollout.py flags.
set -u
OUT=${OUT:-out/device_rollout}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest tests/test_fp4_swizzle.py tests/test_gpu_kernels.py -p no:cacheprovider \
  -o addopts="" -q -rfE --tb=short --durations=8 2>&1 | tee "$OUT/gpu_test.log"
timeout "${BENCH_TIMEOUT:-300}" python3 bench/rollout.py --micro --time-budget "${BENCH_BUDGET:-240}" \
  --out "$OUT/rollout.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/rollout.log"
timeout "${PEER_TIMEOUT:-100}" python3 bench/rollout.py --recipes "" --peer --out "$OUT/peer.json" \
  2>&1 | tee "$OUT/peer.log"
