#!/usr/bin/env bash
# Session 6's device call, not run (no device was lent that session): the first call of the next one.
# The positions mma attention ("mma-pos", compiled for sm_90 and emulated on CPU only): its GPU tests and
# one layer's timing against the heads kernel at the large batches; then the CUDA tests of the decoder's
# users that dev8.sh (also never run) held. If "mma-pos" passes and wins, make it fa.MMA_DEFAULT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 150 python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention_gpu" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -30 > $OUT/tests_mma.log
tail -8 $OUT/tests_mma.log
timeout 120 python3 bench/attention_profile.py --sweep --points 1024:1776,8192:240,1024:256,1024:16 \
  --formats fp4-swizzled --programs 256 --tiles 64:4 --words 1 --mma-programs 1024,2048 \
  --out $OUT/attn.json > $OUT/attn.log 2>&1
grep "^best\|\"mma" $OUT/attn.log | cut -c1-260
timeout 200 python3 -m pytest tests/test_graph_engine.py tests/test_cuda_paths.py tests/test_record_sink.py \
  tests/test_gpu_kernels.py -k "graph or cuda or sink or decoder_gpu" -p no:cacheprovider -o addopts="" -q -rfE \
  --tb=short 2>&1 | tail -25 > $OUT/tests_cuda.log
tail -8 $OUT/tests_cuda.log
