#!/usr/bin/env bash
# Session 7, the one call ~600 s of device budget allows (nine starts were refused): GPU tests of
# sessions 6-7 first, then an untuned decode bench of the two goal recipes (defaults only: the
# micro tuner would take half the call), then the graph engine's CUDA tests if time is left.
# (run 2026-12-08 on an H100; --route-fused was removed afterwards with the kernel it switched on:
# bench/RESULTS.md, "seventh session")
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET_S:-400}))
left() { local l=$((DEADLINE - $(date +%s))); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout $(left 150) python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention_gpu or kernels_gpu_small or decoder_gpu" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -40 > $OUT/tests_gpu.log
tail -10 $OUT/tests_gpu.log; echo "t=$(( $(date +%s) - T0 ))"
L=$(left 190)
timeout $L python3 bench/rollout.py --time-budget $((L - 40)) --recipes w4a4kv4,bf16 --batches 16 --steps 4 --warmup 1 \
  --profile 2 --profile-batches 16,1776,240 --route-fused 1024 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "speedup|ms/step|^ +[0-9]+ us" $OUT/rollout.log | cut -c1-150 | tail -60; echo "t=$(( $(date +%s) - T0 ))"
L=$(left 100); [ $L -gt 30 ] && timeout $L python3 -m pytest tests/test_graph_engine.py tests/test_cuda_paths.py \
  tests/test_record_sink.py -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -25 > $OUT/tests_cuda.log
tail -5 $OUT/tests_cuda.log 2>/dev/null; echo "t=$(( $(date +%s) - T0 ))"
