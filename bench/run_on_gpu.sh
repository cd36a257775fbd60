#!/usr/bin/env bash
# One call on a GPU host: the GPU tests, `drafter bench`, then the remote-vs-in-process run;
# everything lands in $OUT.
#   OUT=/tmp/out bash bench/run_on_gpu.sh [drafter bench arguments...]
# Carried alongside when present: .triton_cache.tgz (an earlier call's kernel compiles) and
# ../.whl (wheels the host lacks: pyzmq, msgspec, grpcio matching the generated stubs).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/drafter-out}
mkdir -p "$OUT"
if [ -d ../.whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_triton_kernels.py tests/unit/test_graph_runner.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
timeout "${BENCH_TIMEOUT:-420}" python3 -m drafter.bench --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench_stdout.log" \
  | grep -E "summary|^  (eagle|host|gemm)|^NVIDIA|^bf16|TFLOP" | cut -c1-400 | tail -60
if [ -z "${SKIP_REMOTE:-}" ]; then
  timeout "${REMOTE_TIMEOUT:-240}" python3 -m drafter.bench_remote --out "$OUT/bench" 2>&1 | tail -15
fi
# at most 8 files come back from a device call: the cache only when asked for
[ -n "${KEEP_CACHE:-}" ] && tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
ls -la "$OUT" "$OUT/bench"
