#!/usr/bin/env bash
# Next session's first call (~9 min; split it in two if the budget allows): the GPU tests the seventh session's capped run did not reach
# (the decoder with the positions mma kernel as default, the quantize row tiles, the sampler split
# end to end), then the full tuned decode bench and the peer row for rollout_h100.json / rollout_h200.json.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 200 python3 -m pytest tests/test_gpu_kernels.py -k "gpu" -p no:cacheprovider -o addopts="" -q -rfE \
  --tb=short 2>&1 | tail -30 > $OUT/tests_gpu.log
tail -6 $OUT/tests_gpu.log
for hf in 0 1; do  # the launch order (fa.HEADS_FIRST): a row's KV heads together, or rows first
  timeout 60 python3 bench/attention_profile.py --sweep --points 1024:1776,8192:240,1024:256 --formats fp4-swizzled \
    --programs 256 --tiles 64:4 --words 1 --mma-programs 1024 --mma-maxnreg 144 --mma-kernels mma-pos \
    --heads-first $hf --out $OUT/attn_hf$hf.json > $OUT/attn_hf$hf.log 2>&1
  grep "^best" $OUT/attn_hf$hf.log | cut -c1-200
done
timeout 330 python3 bench/rollout.py --micro --time-budget 250 --recipes w4a4kv4,bf16,w4a16,w4a4 --steps 4 --warmup 1 \
  --profile 2 --profile-batches 16,256,1776,240,544 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "^tuned attention|speedup|ms/step" $OUT/rollout.log | cut -c1-200 | tail -40
timeout 60 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
