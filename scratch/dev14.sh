#!/usr/bin/env bash
# The next session's device calls (written 2026-12-08, eighth session: no device was lent, so nothing
# since 66b046c has run on a GPU). Each part fits one 600 s call; run them in order on one warm machine.
#   PART=1 (~7 min): every GPU test (test_quant_row_tiles_gpu, test_mma_selfcheck_gpu, the split-K and
#          all-linear decoder tests have never run), then the attention A/B: a row's KV heads launched
#          together or not (fa.HEADS_FIRST) at 1k B=1776, 8k B=240, 1k B=256, and 8k B=16 (now on the mma
#          kernel: fa.LARGE_ROW_POSITIONS) with the Triton kernel's config beside it.
#   PART=2 (~7 min): the full tuned decode bench of the four recipes and the peer row (for
#          bench/results/rollout_h100.json or rollout_h200.json; merge with bench/rollout.py --merge).
#   PART=3 (~6 min): programmatic dependent launch A/B (kernels/pdl.py, opt-in: w4a4kv4 and bf16 at
#          1k/8k B=16 and 64), split-K dense FP4 projections A/B (w4a4kv4:all-linear, B=16 and 64),
#          then the heads-first A/B in the whole step (w4a4kv4 1k B=1776 and 8k B=240).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
case "${PART:-1}" in
1)
  timeout 330 python3 -m pytest tests/test_gpu_kernels.py tests/test_graph_engine.py tests/test_cuda_paths.py \
    tests/test_record_sink.py -k "gpu or cuda or graph or sink" -p no:cacheprovider -o addopts="" -q -rfE \
    --tb=short 2>&1 | tail -30 > $OUT/tests_gpu.log
  tail -6 $OUT/tests_gpu.log
  for hf in 0 1; do
    timeout 75 python3 bench/attention_profile.py --sweep --points 1024:1776,8192:240,1024:256,8192:16 \
      --formats fp4-swizzled --programs 256 --tiles 64:4 --words 1 --mma-programs 1024 --mma-maxnreg 144 \
      --mma-kernels mma-pos --heads-first $hf --out $OUT/attn_hf$hf.json > $OUT/attn_hf$hf.log 2>&1
    grep "^best" $OUT/attn_hf$hf.log | cut -c1-200
  done
  ;;
2)
  timeout 330 python3 bench/rollout.py --micro --time-budget 250 --recipes w4a4kv4,bf16,w4a16,w4a4 --steps 4 \
    --warmup 1 --profile 2 --profile-batches 16,256,1776,240,544 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
  grep -E "^env|^tuned attention|speedup|ms/step" $OUT/rollout.log | cut -c1-200 | tail -40
  timeout 60 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
  ;;
3)
  for p in 0 1; do
    timeout 110 python3 bench/rollout.py --recipes w4a4kv4,bf16 --batches 16,64 --no-max-batch --steps 5 \
      --warmup 2 --pdl $p --out $OUT/pdl$p.json > $OUT/pdl$p.log 2>&1
    grep -E "ms/step|ERROR" $OUT/pdl$p.log | cut -c1-160
  done
  for sk in 0 1; do
    timeout 100 python3 bench/rollout.py --recipes w4a4kv4:all-linear --batches 16,64 --no-max-batch --steps 4 \
      --warmup 1 --split-k $sk --profile 2 --profile-batches 16 --out $OUT/splitk$sk.json > $OUT/splitk$sk.log 2>&1
    grep -E "ms/step|ERROR" $OUT/splitk$sk.log | cut -c1-160
  done
  for hf in 0 1; do
    timeout 100 python3 bench/rollout.py --recipes w4a4kv4 --batches 1776 --contexts 1024 --no-max-batch --steps 3 \
      --warmup 1 --heads-first $hf --out $OUT/step_hf$hf.json > $OUT/step_hf$hf.log 2>&1
    timeout 60 python3 bench/rollout.py --recipes w4a4kv4 --batches 240 --contexts 8192 --no-max-batch --steps 3 \
      --warmup 1 --heads-first $hf --out $OUT/step8k_hf$hf.json > $OUT/step8k_hf$hf.log 2>&1
    grep -hE "ms/step|ERROR" $OUT/step_hf$hf.log $OUT/step8k_hf$hf.log | cut -c1-160
  done
  ;;
esac
