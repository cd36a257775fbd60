#!/usr/bin/env bash
# One device call: GPU tests of the step kernels, the GEMM / prefetch probe, and `drafter bench`
# for EAGLE-3 8B with the new paths switched off and on (same run, same GPU).
#   OUT=/tmp/out bash bench/run_step_probe.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/drafter-probe}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; date -u +%FT%TZ
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_step_kernels.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"
fi
timeout "${PROBE_TIMEOUT:-150}" python3 bench/probe_step_gemms.py --out "$OUT" > "$OUT/probe.txt" 2>&1
grep -v "^   " "$OUT/probe.txt" | tail -40
BENCH_ARGS=${BENCH_ARGS:---heads eagle3-8b --batches 1,4,16,64 --ks 3 --contexts 1024 --no-eager}
for variant in ${VARIANTS:-"off:--skinny-gemm off --no-prefetch" "all:--skinny-gemm auto"}; do
  name=${variant%%:*}
  timeout "${BENCH_TIMEOUT:-120}" python3 -m drafter.bench --out "$OUT/bench-$name" $BENCH_ARGS ${variant#*:} \
    > "$OUT/bench-$name.txt" 2>&1
  echo "== $name"; grep -E "ratio|summary|loop/floor" "$OUT/bench-$name.txt" | cut -c1-260 | tail -8
  rm -f "$OUT/bench-$name/bench.log" "$OUT/bench-$name/bench.png" "$OUT/bench-$name.txt"  # at most 8 files return
done
ls -R "$OUT" | head -30
