#!/usr/bin/env bash
# Session 5, call 1: GPU tests of the single-split fused output and the mma attention paths the last
# session CPU-checked only, then the expert GEMM tile sweep at the largest batches (1k: w4a4kv4 1776 rows,
# w4a16/w4a4 544) over row tiles 32/64/128.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 150 python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention or kernels_gpu_small or decoder_gpu" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -30 > $OUT/tests.log
tail -8 $OUT/tests.log
timeout 380 python3 bench/gemm_profile.py --sweep --batches 1776,544 --bms 32,64,128 --fmts w4a4s,w4a16s \
  --full w4a4s --workers 14 --out $OUT/gemm_large.json > $OUT/gemm_large.log 2>&1
grep -c '"ms"' $OUT/gemm_large.log; grep '"best": true' $OUT/gemm_large.log
