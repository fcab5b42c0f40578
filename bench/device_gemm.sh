#!/usr/bin/env bash
# Expert-GEMM investigation on the lent GPU: the tile x pipeline-depth sweep, then Nsight Compute's
# stall reasons for one launch of each GEMM kind. Run from the repo root on the device:
#     OUT=/path/to/out bash bench/device_gemm.sh
# Writes $OUT/{env.txt,gemm_sweep.json,gemm_sweep.log,ncu.txt}. SWEEP_ARGS / NCU_ARGS add flags;
# NCU=0 skips the profile, SWEEP=0 the sweep.
set -u
OUT=${OUT:-out/device_gemm}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  which ncu || true
} 2>&1 | tee "$OUT/env.txt"
if [ "${SWEEP:-1}" != 0 ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 bench/gemm_profile.py --sweep --batches "${SWEEP_BATCHES:-16,64,256}" \
    --out "$OUT/gemm_sweep.json" ${SWEEP_ARGS:-} 2>&1 | tail -n 400 > "$OUT/gemm_sweep.log"
fi
if [ "${NCU:-1}" != 0 ]; then
  timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --profile-from-start off --kernel-name regex:grouped \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 bench/gemm_profile.py --ncu --batches "${NCU_BATCHES:-16,256}" ${NCU_ARGS:-} > "$OUT/ncu.txt" 2>&1
  tail -n 5 "$OUT/ncu.txt"
fi
