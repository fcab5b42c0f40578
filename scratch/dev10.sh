#!/usr/bin/env bash
# Session 7, call 1: the GPU tests of session 6 (positions mma attention, router/qkv_post/BF16 expert
# outputs/sampler in the decoder) and session 7 (one-launch small-batch routing, all-linear decoder),
# the CUDA tests of the graph engine / CUDA paths / record sink, then an A/B of the fused routing at
# 1k B=16/64 and the all-linear row. The full decode bench is call 2 (dev7.sh).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 200 python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention_gpu or kernels_gpu_small or decoder_gpu" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -40 > $OUT/tests_gpu.log
tail -12 $OUT/tests_gpu.log
timeout 150 python3 -m pytest tests/test_graph_engine.py tests/test_cuda_paths.py tests/test_record_sink.py \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -25 > $OUT/tests_cuda.log
tail -6 $OUT/tests_cuda.log
for rf in 0 1024; do
  timeout 80 python3 bench/rollout.py --recipes w4a4kv4 --batches 16,64 --contexts 1024 --no-max-batch \
    --steps 8 --warmup 2 --route-fused $rf --out $OUT/ab_rf$rf.json > $OUT/ab_rf$rf.log 2>&1
  grep "ms/step" $OUT/ab_rf$rf.log | cut -c1-160
done
timeout 80 python3 bench/rollout.py --recipes w4a4kv4:all-linear --batches 16,64 --contexts 1024 --no-max-batch \
  --steps 8 --warmup 2 --route-fused 1024 --out $OUT/ab_all.json > $OUT/ab_all.log 2>&1
grep "ms/step\|Error" $OUT/ab_all.log | cut -c1-160
