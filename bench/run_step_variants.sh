#!/usr/bin/env bash
# One device call: the GPU tests, then `drafter bench` for EAGLE-3 8B with the skinny GEMMs off
# (cuBLAS + separate norm/SiLU launches) and on (timed per weight), same run, same GPU.
#   OUT=/tmp/out bash bench/run_step_variants.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/drafter-variants}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; date -u +%FT%TZ
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_step_kernels.py \
    tests/unit/test_triton_kernels.py tests/unit/test_attention_split_combine.py > "$OUT/gpu_tests.txt" 2>&1
  grep -E "FAILED|passed|failed" "$OUT/gpu_tests.txt" | tail -6
fi
BENCH_ARGS=${BENCH_ARGS:---heads eagle3-8b --batches 1,4,16,64 --ks 3,5 --contexts 1024,8192 --no-eager}
for variant in ${VARIANTS:-"off:--skinny-gemm off" "auto:--skinny-gemm auto --profile"}; do
  name=${variant%%:*}
  timeout "${BENCH_TIMEOUT:-240}" python3 -m drafter.tools.bench.grid --out "$OUT/bench-$name" $BENCH_ARGS ${variant#*:} \
    > "$OUT/bench-$name.txt" 2>&1
  echo "== $name"; grep -E "ratio|summary|loop/floor|Error|error" "$OUT/bench-$name.txt" | cut -c1-250 | tail -22
  rm -f "$OUT/bench-$name/bench.log" "$OUT/bench-$name/bench.png"
done
