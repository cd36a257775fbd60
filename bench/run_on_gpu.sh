#!/usr/bin/env bash
# One call on a GPU host: the GPU tests, then `drafter bench`; everything lands in $OUT.
#   OUT=/tmp/out bash bench/run_on_gpu.sh [bench arguments...]
# A Triton cache carried in .triton_cache.tgz (from an earlier call) saves the kernel compiles.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/drafter-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -x tests/gpu tests/unit/test_triton_kernels.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
timeout "${BENCH_TIMEOUT:-420}" python3 -m drafter.bench --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench_stdout.log" \
  | grep -v "^  profile" | tail -45
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
ls -la "$OUT" "$OUT/bench"
