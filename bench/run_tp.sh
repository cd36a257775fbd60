#!/usr/bin/env bash
# Issue 21's device record in one call: the tensor-parallel GPU tests, then `drafter bench
# --tensor-parallel-size N` (drafter/tools/bench/tp.py) for DeepSeek-V3 MTP as released (FP8 blocks)
# and an EAGLE-3 head of Llama-3.3-70B shapes, batches 1-64, k 1 and 3, context 1024.
#   OUT=/tmp/out bash bench/run_tp.sh                 # one GPU: TP = 1 through the spawned-rank code
#   OUT=/tmp/out TP=2 bash bench/run_tp.sh            # 2+ GPUs (also runs the NCCL tests there)
# Knobs: TP (default 1), SKIP_TESTS, SKIP_BENCH, TEST_TIMEOUT, BENCH_TIMEOUT, BENCH_ARGS (replace the grid below).
# A device call is 10 minutes at most: on a cold machine run the tests and the bench as two calls
# (SKIP_BENCH=1, then SKIP_TESTS=1).
# Writes $OUT/gpu.txt, tp_tests.txt, tp_bench_log.txt, bench_tp.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
OUT=${OUT:-/tmp/drafter-out}
TP=${TP:-1}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then   # pyzmq, msgspec, ... the device host lacks (see run_on_gpu.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; date -u +%FT%TZ
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp_gpu.py \
    > "$OUT/tp_tests.txt" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tp_tests.txt" | tail -8
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-540}" python3 -m drafter.tools.bench.tp --tensor-parallel-size "$TP" --out "$OUT" \
  ${BENCH_ARGS:---heads deepseek-v3-mtp,eagle3-70b --batches 1,2,4,8,16,32,64 --ks 1,3 --contexts 1024} \
  > "$OUT/tp_bench_log.txt" 2>&1
echo "== bench rc $?"
tail -32 "$OUT/tp_bench_log.txt"
