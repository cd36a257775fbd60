#!/usr/bin/env bash
# Issue 18's end-to-end step figure in one device call (python -m coordinator.bench.e2e_step): the
# reference target at Llama-3.1-8B shapes (random weights) on cuda:0, batch 16, ctx 1000, k = 3, one
# decoding step timed without drafting, with free drafts, with the in-process drafter (validated and
# trusted calls), with `drafter serve` on the same GPU over bound cuda_ipc and over unbound ZMQ.
#   OUT=/tmp/out bash bench/run_e2e.sh [e2e_step arguments, e.g. --drafter-device cuda:1 --iters 300]
# Writes $OUT/gpu.txt, e2e_step.json, e2e_step.md, e2e_stdout.txt.  Knob: E2E_TIMEOUT (seconds, 420).
# E2E_FP32=1 first runs the losslessness check in float32 (plain and free drafts only, no drafter, 100 steps:
# the generated tokens must agree) into $OUT/fp32/; E2E_FP32_TIMEOUT (seconds, 150).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"   # OUT, the carried wheels, PYTHONPATH
describe_device
if [ -n "${E2E_FP32:-}" ]; then
  mkdir -p "$OUT/fp32"
  timeout "${E2E_FP32_TIMEOUT:-150}" python3 -m coordinator.bench.e2e_step --out "$OUT/fp32" --device cuda:0 \
    --dtype float32 --ways plain,free_drafts --iters 100 --warmup 5 > "$OUT/fp32/e2e_stdout.txt" 2>&1
  echo "e2e_step float32 exit $?"
  grep -E "outputs_|^\| \(a" "$OUT/fp32/e2e_step.md"
fi
timeout "${E2E_TIMEOUT:-420}" python3 -m coordinator.bench.e2e_step --out "$OUT" --device cuda:0 "$@" \
  > "$OUT/e2e_stdout.txt" 2>&1
echo "e2e_step exit $?"
tail -45 "$OUT/e2e_stdout.txt"
ls -la "$OUT"
