#!/usr/bin/env bash
# Session 4, call 1: the CUDA tests not rerun last session, then ncu on the FP4/BF16 attention.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 220 python3 -m pytest tests/test_graph_engine.py tests/test_record_sink.py tests/test_cuda_paths.py \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short --durations=5 2>&1 | tail -40 > $OUT/tests1.log
timeout 120 python3 -m pytest tests/test_gpu_kernels.py tests/test_kernels.py -k dequant_out \
  -p no:cacheprovider -o addopts="" -q -rfE --tb=short 2>&1 | tail -20 > $OUT/tests2.log
tail -3 $OUT/tests1.log $OUT/tests2.log
M="--metrics smsp__inst_executed.sum,smsp__cycles_active.avg,dram__bytes_read.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum"
timeout 150 ncu --clock-control none --profile-from-start off --kernel-name regex:decode_attn \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section LaunchStats --section SourceCounters $M -o $OUT/attn --force-overwrite \
  python3 bench/attention_profile.py --ncu --points 8192:240,1024:1776,8192:16 --formats bf16,fp4-swizzled \
  --programs 512 --tiles 64:2 --words 1 > $OUT/ncu_run.log 2>&1
tail -5 $OUT/ncu_run.log
ncu --import $OUT/attn.ncu-rep --page details --print-details all > $OUT/attn_details.txt 2>&1
ncu --import $OUT/attn.ncu-rep --page source --csv --print-source sass > $OUT/attn_source.csv 2>&1
ls -la $OUT; grep -n "Duration\|Issue Slots Busy\|Achieved Occupancy\|No Eligible\|Registers Per\|Memory Throughput\|DRAM Throughput\|Block Limit\|Warp Cycles Per Issued\|inst_executed.sum\|dram__bytes" $OUT/attn_details.txt | head -80
timeout 170 python3 bench/attention_profile.py --sweep --points 8192:240,1024:1776,8192:16 --formats fp4-swizzled \
  --programs 512,2048,8192 --tiles 64:2,32:1,64:1,16:1 --maxnreg 0 --words 1 --out $OUT/sweep_w1.json 2>&1 | grep best
