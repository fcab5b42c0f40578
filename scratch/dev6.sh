#!/usr/bin/env bash
# Session 5, call 2: GPU tests of the large-batch GEMM tiles (fg.LARGE), the mma kernel's register cap
# at the largest batches, then the decode bench (as dev4.sh) and, warm, the transformers peer.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 150 python3 -m pytest tests/test_gpu_kernels.py -k "large_batch_tiles or attention_gpu or kernels_gpu_small or decoder_gpu_with_mma" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -30 > $OUT/tests.log
tail -6 $OUT/tests.log
timeout 90 python3 bench/attention_profile.py --sweep --points 1024:1776,8192:240 --formats fp4-swizzled \
  --programs 256 --tiles 64:4 --words 1 --mma-tiles 16 --mma-programs 1024 --mma-maxnreg 0,128 \
  --out $OUT/attn_maxnreg.json > $OUT/attn_maxnreg.log 2>&1
grep "^best\|\"mma\"" $OUT/attn_maxnreg.log | cut -c1-260
timeout 60 python3 scratch/quant_tiles.py > $OUT/quant_tiles.log 2>&1; tail -3 $OUT/quant_tiles.log
timeout 330 python3 bench/rollout.py --micro --time-budget ${BUDGET:-250} --recipes w4a4kv4,bf16,w4a16,w4a4 \
  --steps 4 --warmup 1 --profile 2 --profile-batches 16,256,1776,240,544 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "tuned attention|speedup" $OUT/rollout.log | tail -25
timeout 60 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
