#!/usr/bin/env bash
# Session 4, call 2: CUDA tests (graph engine, sinks, cuda paths, dequant_out, the new mma attention), then
# the attention sweep triton vs mma at the decode points.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 150 python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention or dequant_out" tests/test_kernels.py \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short -x 2>&1 | tail -30 > $OUT/tests_mma.log
tail -12 $OUT/tests_mma.log
timeout 170 python3 bench/attention_profile.py --sweep --points 8192:240,1024:1776,8192:16,1024:16,1024:256 \
  --formats fp4-swizzled --programs 512 --tiles 64:2,64:4 --maxnreg 0 --words 1 --mma-tiles 16,32 \
  --mma-programs 1024,4096,16384 --out $OUT/sweep_mma.json 2>&1 | tee $OUT/sweep.log | grep -v "^{" 
grep error $OUT/sweep.log | head -3
timeout 200 python3 -m pytest tests/test_graph_engine.py tests/test_record_sink.py tests/test_cuda_paths.py \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -25 > $OUT/tests1.log
tail -4 $OUT/tests1.log
