#!/usr/bin/env bash
# The GPU comparison suite on the lent GPU, resumable across calls and device sessions.
# Run from the repo root on the device (torch + triton there; tracerl not installed):
#     OUT=/path/to/out COMPARE_BUDGET=400 [TASKS=arith,maze] [TESTS=0] [ENGINE_BENCH=1] [PROBE_LRS=3e-5,1e-4]
#       [PROBE_VARY=rollout.engine=reference,graph PROBE_ROW=trace PROBE_SEEDS=0,1] [CUDA_TESTS="tests/..."]
#       bash bench/device_compare.sh
# 1. with PROBE_LRS, bench/lr_probe.py (one row of PROBE_TASK, default arith, at each rate;
#    $OUT/lr_probe.json, its cells under reports/<suite>/probes/lr); with PROBE_VARY, the same for each
#    value of another setting ($OUT/probe_vary.json, probes/vary); PROBE_OVERRIDES (space-separated
#    KEY=VALUE) applies to both probes' runs, e.g. "rollout.engine=graph";
# 2. CUDA tests of the engine/trainer paths (skipped if TESTS=0); with ENGINE_BENCH=1
#    bench/engine_rollout.py (reference vs graph engine; $OUT/engine_rollout.json);
# 3. unless COMPARE_BUDGET=0, `tracerl compare --suite ${SUITE:-small} --time-budget $COMPARE_BUDGET`
#    writing into reports/ (cells already committed under reports/<suite>/cells are reused; weights
#    stay in reports/<suite>/cache on the machine, so a second call while it is warm reuses them too);
# 4. packs reports/<suite> (cells, probe cells, report; not the weights in cache/) as
#    $OUT/reports_<suite>.tgz, beside the logs.
# Locally afterwards: `tar xzf reports_<suite>.tgz -C reports` (adds the new cells) and run
# `tracerl compare --suite <suite> --time-budget 0` to assemble the (partial) report from cells.
# Untar BEFORE the next call: every call replaces the device's reports/<suite>/cells with this
# checkout's, so cells not yet untarred here are lost there and re-run (cache/ weights survive
# while the machine stays warm). A fresh machine re-trains the bf16 row if ptq still needs it.
set -u
OUT=${OUT:-out/device_compare}
SUITE=${SUITE:-small}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
copy_back() {  # $OUT returns at most 8 files, 2 folders down: the suite's records travel as one tar
  # records only: cache/ (weights) and runs/ (checkpoints, logs) are GBs and would not come back
  (cd reports && tar czf "$OUT/reports_$SUITE.tgz" "$SUITE/cells" $(ls -d "$SUITE"/probes/*/cells 2>/dev/null) $(cd "$SUITE" 2>/dev/null && ls *.json *.md *.png 2>/dev/null | sed "s|^|$SUITE/|")) 2>/dev/null
  nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/env.txt" 2>&1
  # the next call replaces cells/ with the caller's checkout; a copy in the ignored cache/ survives
  # while the machine stays warm, and compare takes a record from there when cells/ lacks it
  mkdir -p "reports/$SUITE/cache" && cp reports/"$SUITE"/cells/*.json "reports/$SUITE/cache/" 2>/dev/null
}
trap copy_back EXIT
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [ -n "${PROBE_LRS:-}" ]; then  # e.g. PROBE_LRS=3e-5,1e-4: RL at each rate on one task first (bench/lr_probe.py)
  timeout "${PROBE_TIMEOUT:-200}" python3 bench/lr_probe.py --suite "$SUITE" --task "${PROBE_TASK:-arith}" \
    --lrs "$PROBE_LRS" --work "reports/$SUITE/probes/lr" --cache "reports/$SUITE/cache" --out "$OUT/lr_probe.json" \
    ${PROBE_OVERRIDES:+--overrides $PROBE_OVERRIDES} 2>&1 | tee "$OUT/lr_probe.log"
fi
if [ -n "${PROBE_VARY:-}" ]; then  # e.g. PROBE_VARY=rollout.engine=reference,graph PROBE_ROW=trace: an RL A/B
  timeout "${PROBE_TIMEOUT:-200}" python3 bench/lr_probe.py --suite "$SUITE" --task "${PROBE_TASK:-arith}" \
    --row "${PROBE_ROW:-bf16}" --vary "$PROBE_VARY" ${PROBE_SEEDS:+--seeds $PROBE_SEEDS} --work "reports/$SUITE/probes/vary" --cache "reports/$SUITE/cache" \
    --out "$OUT/probe_vary.json" ${PROBE_OVERRIDES:+--overrides $PROBE_OVERRIDES} 2>&1 | tee "$OUT/probe_vary.log"
fi
if [ "${TESTS:-1}" = 1 ]; then
  tests=$(ls ${CUDA_TESTS:-tests/test_record_sink.py tests/test_cuda_paths.py tests/test_engine_kernels_cuda.py tests/test_kernels.py tests/test_graph_engine.py} 2>/dev/null)
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest $tests -p no:cacheprovider -o addopts="" -q -rfEs \
    --durations=10 2>&1 | tee "$OUT/cuda_tests.log"
fi
if [ "${ENGINE_BENCH:-0}" = 1 ]; then  # RL rollout time, reference vs graph engine, and recording's cost
  timeout "${ENGINE_TIMEOUT:-240}" python3 bench/engine_rollout.py --out "$OUT/engine_rollout.json" 2>&1 | tee "$OUT/engine_rollout.log"
fi
if [ "${COMPARE_BUDGET:-400}" != 0 ]; then
  timeout "${COMPARE_TIMEOUT:-$(( ${COMPARE_BUDGET:-400} + 60 ))}" python3 -m tracerl.cli compare --suite "$SUITE" \
    --out reports --time-budget "${COMPARE_BUDGET:-400}" ${TASKS:+--tasks $TASKS} 2>&1 | tee -a "$OUT/compare.log"
  echo "compare exit ${PIPESTATUS[0]}" | tee -a "$OUT/compare.log"
fi
