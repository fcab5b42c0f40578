#!/usr/bin/env bash
# Session 5, call 4: the CUDA tests of the decoder's users after the GEMM tile and logits changes
# (graph engine, CUDA paths, record sink, the decoder's own GPU tests).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 -m pytest tests/test_graph_engine.py tests/test_cuda_paths.py tests/test_record_sink.py \
  tests/test_gpu_kernels.py -k "graph or cuda or sink or decoder_gpu" -p no:cacheprovider -o addopts="" -q -rfE \
  --tb=short -x 2>&1 | tail -25
