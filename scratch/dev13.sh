#!/usr/bin/env bash
# The next session's device calls (written 2026-12-08). PART=1 (~7 min): every GPU test (the seventh
# session's capped run stopped after 19; test_quant_row_tiles_gpu and test_mma_selfcheck_gpu have not
# run), then the attention launch-order A/B (fa.HEADS_FIRST). PART=2 (~7 min): the full tuned decode
# bench of the four recipes and the peer row, for bench/results/rollout_h100.json / rollout_h200.json.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
if [ "${PART:-1}" = 1 ]; then
  timeout 330 python3 -m pytest tests/test_gpu_kernels.py tests/test_graph_engine.py tests/test_cuda_paths.py \
    tests/test_record_sink.py -k "gpu or cuda or graph or sink" -p no:cacheprovider -o addopts="" -q -rfE \
    --tb=short 2>&1 | tail -30 > $OUT/tests_gpu.log
  tail -6 $OUT/tests_gpu.log
  for hf in 0 1; do  # a row's KV heads launched together (1) or the rows first (0)
    timeout 60 python3 bench/attention_profile.py --sweep --points 1024:1776,8192:240,1024:256 --formats fp4-swizzled \
      --programs 256 --tiles 64:4 --words 1 --mma-programs 1024 --mma-maxnreg 144 --mma-kernels mma-pos \
      --heads-first $hf --out $OUT/attn_hf$hf.json > $OUT/attn_hf$hf.log 2>&1
    grep "^best" $OUT/attn_hf$hf.log | cut -c1-200
  done
else
  timeout 330 python3 bench/rollout.py --micro --time-budget 250 --recipes w4a4kv4,bf16,w4a16,w4a4 --steps 4 \
    --warmup 1 --profile 2 --profile-batches 16,256,1776,240,544 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
  grep -E "^env|^tuned attention|speedup|ms/step" $OUT/rollout.log | cut -c1-200 | tail -40
  timeout 60 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
fi
