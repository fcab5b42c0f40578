#!/usr/bin/env bash
# FP4 Triton kernels on the lent GPU: bit-exactness tests vs tracerl.fp4, then the throughput bench.
# Run from the repo root on the device (torch + triton + pytest + numpy there; tracerl not installed):
#     OUT=/path/to/out bash bench/device_fp4.sh
# Writes $OUT/{env.txt,kernels_test.log,fp4_quant.log,fp4_quant.json}. Each step has a time limit so
# that the whole run stays under 10 minutes and the bench runs even if the tests fail.
set -u
OUT=${OUT:-out/device_fp4}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout 380 python3 -m pytest tests/test_kernels.py -p no:cacheprovider -o addopts="" -q -rfE \
  --maxfail=30 --durations=15 2>&1 | tee "$OUT/kernels_test.log"
timeout 200 python3 bench/fp4_quant.py --out "$OUT/fp4_quant.json" 2>&1 | tee "$OUT/fp4_quant.log"
