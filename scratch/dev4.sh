#!/usr/bin/env bash
# Session 4, last call: the mma attention's GPU tests, then the decode bench (small- and large-batch attention tuned).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 80 python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -30 > $OUT/tests_mma.log
tail -6 $OUT/tests_mma.log
timeout 330 python3 bench/rollout.py --micro --time-budget ${BUDGET:-250} --recipes w4a4kv4,bf16,w4a16,w4a4 \
  --steps 4 --warmup 1 --profile 2 --profile-batches 16,256,1776,240 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "tuned attention|speedup" $OUT/rollout.log | tail -25
