#!/usr/bin/env bash
# Session 7, one call (the device came late; ~1000 s of budget left): GPU tests of sessions 6-7, the
# CUDA tests of the graph engine / CUDA paths / record sink, the decode bench for the two goal
# recipes, then (if time is left) the fused-routing A/B. Every step is capped by a deadline.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET_S:-540}))
left() { local l=$((DEADLINE - $(date +%s))); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout $(left 170) python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention_gpu or kernels_gpu_small or decoder_gpu" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -40 > $OUT/tests_gpu.log
tail -10 $OUT/tests_gpu.log; echo "t=$(( $(date +%s) - T0 ))"
timeout $(left 110) python3 -m pytest tests/test_graph_engine.py tests/test_cuda_paths.py tests/test_record_sink.py \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -25 > $OUT/tests_cuda.log
tail -5 $OUT/tests_cuda.log; echo "t=$(( $(date +%s) - T0 ))"
L=$(left 250)
timeout $L python3 bench/rollout.py --micro --time-budget $((L - 60)) --recipes w4a4kv4,bf16 --batches 16,64 --steps 4 --warmup 1 \
  --profile 2 --profile-batches 16,1776,240 --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "^tuned attention|speedup|ms/step" $OUT/rollout.log | cut -c1-200 | tail -24; echo "t=$(( $(date +%s) - T0 ))"
for rf in 0 1024; do
  L=$(left 60); [ $L -lt 30 ] && break
  timeout $L python3 bench/rollout.py --recipes w4a4kv4 --batches 16,64 --contexts 1024 --no-max-batch \
    --steps 8 --warmup 2 --route-fused $rf --sample-programs-per-sm $((rf ? 4 : 0)) --profile 2 --out $OUT/ab_rf$rf.json > $OUT/ab_rf$rf.log 2>&1
  grep "ms/step" $OUT/ab_rf$rf.log | cut -c1-160
done
echo "t=$(( $(date +%s) - T0 ))"
