#!/usr/bin/env bash
# Session 4: CUDA tests (mma attention, graph engine, sinks, cuda paths, dequant_out), then the decode bench
# (tune_attention now also times the mma kernel) and the transformers peer.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 100 python3 -m pytest tests/test_gpu_kernels.py -k "mma or attention or dequant_out" \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -30 > $OUT/tests_mma.log
tail -8 $OUT/tests_mma.log
timeout 320 python3 bench/rollout.py --micro --time-budget ${BUDGET:-270} --recipes w4a4kv4,bf16,w4a16,w4a4 \
  --steps 4 --warmup 1 --profile 2 --profile-batches ${PB:-16,256} --out $OUT/rollout.json > $OUT/rollout.log 2>&1
grep -E "tuned|largest|speedup|x bf16|roofline" $OUT/rollout.log | tail -25
timeout 80 python3 bench/rollout.py --recipes "" --peer --out $OUT/peer.json > $OUT/peer.log 2>&1; tail -3 $OUT/peer.log
timeout 150 python3 -m pytest tests/test_graph_engine.py tests/test_record_sink.py tests/test_cuda_paths.py \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short -x 2>&1 | tail -25 > $OUT/tests1.log; tail -4 $OUT/tests1.log
