#!/usr/bin/env bash
# Session 5, call 3: the decode bench again with the micro GEMM tuning timed from CUDA-graph replays
# (call 2's per-call event timing picked small-batch GEMM variants 25% slower than the run before).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 330 python3 bench/rollout.py --micro --time-budget ${BUDGET:-250} --recipes w4a4kv4,bf16,w4a16,w4a4 \
  --steps 4 --warmup 1 --profile 2 --profile-batches 16,256,1776,240,544 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "tuned|speedup|ms/step" $OUT/rollout.log | cut -c1-220 | tail -45
timeout 60 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
