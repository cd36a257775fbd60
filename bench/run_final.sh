#!/usr/bin/env bash
# One device call for issue 6's record: GPU tests, then `drafter bench` over the issue's grid for
# one head (HEAD, default eagle3-8b) with eager timings, host breakdown and kernel profiles.
#   OUT=/tmp/out HEAD=eagle3-8b bash bench/run_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/drafter-final}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; date -u +%FT%TZ
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_step_kernels.py \
    tests/unit/test_triton_kernels.py tests/unit/test_graph_runner.py > "$OUT/gpu_tests.txt" 2>&1
  grep -E "FAILED|passed|failed" "$OUT/gpu_tests.txt" | tail -6
fi
timeout "${BENCH_TIMEOUT:-400}" python3 -m drafter.bench --out "$OUT/bench" --heads "${HEAD:-eagle3-8b}" \
  ${BENCH_ARGS:---profile} > "$OUT/bench_log.txt" 2>&1
grep -E "summary|^  (eagle|host)|TFLOP|copy" "$OUT/bench_log.txt" | cut -c1-300 | tail -30
rm -f "$OUT/bench/bench.log"
