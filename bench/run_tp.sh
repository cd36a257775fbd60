#!/usr/bin/env bash
# Issue 21/22's device record in one call: the tensor-parallel GPU tests, then `drafter bench
# --tensor-parallel-size` (drafter/tools/bench/tp.py) for DeepSeek-V3 MTP as released (FP8 blocks)
# and an EAGLE-3 head of Llama-3.3-70B shapes, batches 1/4/16/64, k 1 and 3, context 1024.
#   OUT=/tmp/out bash bench/run_tp.sh                 # one GPU: TP = 1 through the spawned-rank code
#   OUT=/tmp/out TP=2 bash bench/run_tp.sh            # 2+ GPUs: the NCCL tests, then N = 1 and N = 2 in one
#                                                     # bench run (speedup per row), graphs at both
# Knobs: TP (default 1), SKIP_TESTS, SKIP_BENCH, TESTS (pytest node ids; default the whole file), TEST_TIMEOUT,
# DRAFTER_TP_TEST_TIMEOUT_S (a test's ranks are killed after it, default 150), BENCH_TIMEOUT, BENCH_ARGS (replace
# the grid below), BF16=1 (then DeepSeek with dequantised bf16 weights, k 3, into $OUT/bf16; BF16_TIMEOUT).
# Bench rows stream into $OUT/rows.jsonl as they are measured: a timeout keeps what finished.
# Writes $OUT/gpu.txt, tp_tests.txt, tp_bench_log.txt, rows.jsonl, bench_tp.json (and bf16/ likewise).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"   # OUT, the carried wheels, PYTHONPATH
TP=${TP:-1}
describe_device
if [ -z "${SKIP_TESTS:-}" ]; then
  # -v -s: each test's name and everything the ranks print reach the file at once (a cut run says
  # where it was); faulthandler dumps a test's stacks at 3/4 of the time left to it
  TEST_TIMEOUT=${TEST_TIMEOUT:-420}
  # shellcheck disable=SC2086
  timeout "$TEST_TIMEOUT" python3 -m pytest -v -s -p no:cacheprovider -rA -o faulthandler_timeout=$((TEST_TIMEOUT * 3 / 4)) \
    ${TESTS:-tests/gpu/test_tp_gpu.py} > "$OUT/tp_tests.txt" 2>&1
  echo "== tests rc $?"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tp_tests.txt" | tail -8
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0
SIZES=1
[ "$TP" != 1 ] && SIZES="1,$TP"
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-540}" python3 -m drafter.tools.bench.tp --tensor-parallel-size "$SIZES" --out "$OUT" \
  ${BENCH_ARGS:---heads deepseek-v3-mtp,eagle3-70b --batches 1,4,16,64 --ks 1,3 --contexts 1024 --iters 10 --no-eager} \
  > "$OUT/tp_bench_log.txt" 2>&1
echo "== bench rc $?"
tail -40 "$OUT/tp_bench_log.txt"
if [ -n "${BF16:-}" ]; then
  timeout "${BF16_TIMEOUT:-240}" python3 -m drafter.tools.bench.tp --tensor-parallel-size "$SIZES" --out "$OUT/bf16" \
    --heads deepseek-v3-mtp --deepseek-weights bf16 --batches 1,4,16,64 --ks 3 --contexts 1024 --iters 10 --no-eager \
    > "$OUT/tp_bench_bf16_log.txt" 2>&1
  echo "== bf16 bench rc $?"
  tail -12 "$OUT/tp_bench_bf16_log.txt"
fi
