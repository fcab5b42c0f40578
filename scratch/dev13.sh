#!/usr/bin/env bash
# Next session's first call (~8 min): the GPU tests the seventh session's capped run did not reach
# (the decoder with the positions mma kernel as default, the quantize row tiles, the sampler split
# end to end), then the full tuned decode bench and the peer row for rollout_h100.json / rollout_h200.json.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 200 python3 -m pytest tests/test_gpu_kernels.py -k "gpu" -p no:cacheprovider -o addopts="" -q -rfE \
  --tb=short 2>&1 | tail -30 > $OUT/tests_gpu.log
tail -6 $OUT/tests_gpu.log
timeout 330 python3 bench/rollout.py --micro --time-budget 250 --recipes w4a4kv4,bf16,w4a16,w4a4 --steps 4 --warmup 1 \
  --profile 2 --profile-batches 16,256,1776,240,544 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "^tuned attention|speedup|ms/step" $OUT/rollout.log | cut -c1-200 | tail -40
timeout 60 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
