#!/usr/bin/env bash
# Issue 23's device record in one call (2 GPUs): pre-drafting against a simulated target
# (coordinator/bench/predraft_target.py): the target's verify on cuda:0, `drafter serve` with
# pushed pre-drafts on cuda:1, the in-process drafter on cuda:0 beside the target.  Pushes on bound
# sessions: --modes in_process,exact_bound,predraft_bound (cuda_ipc between the two GPUs).  Deeper
# pre-drafts (k' > k, a server per k' with --predraft-k): --ks 3,4,5,6 --remote-ks 3 --predraft-ks 3,6
# (in-process at every k, the served modes at k = 3, pre-drafts at k' = 3 and 6; the depth table).
#   OUT=/tmp/out bash bench/run_predraft.sh [predraft_target arguments...]
# Carried: .whl/ (pyzmq, msgspec, grpcio... the device host lacks) and the generated stubs
# drafter/_proto/drafter/v1 (see run_on_gpu.sh).  Knobs: BENCH_TIMEOUT (default 460 s).
# Writes $OUT/gpu.txt, predraft_target_log.txt, predraft_target.json, predraft_target.md, predraft_servers.log,
# clocks.csv (CLOCKS_MS).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"   # OUT, the carried wheels, PYTHONPATH
describe_device
# Both GPUs' clocks, power and utilisation every CLOCKS_MS (default 100; 0: none) while the bench runs
# (read only: nvidia-smi's query loop), to set beside each run's wall-clock window ("wall" in the JSON).
CLOCKS_PID=""
if [ "${CLOCKS_MS:-100}" != "0" ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,utilization.gpu,pstate \
    --format=csv,noheader -lms "${CLOCKS_MS:-100}" > "$OUT/clocks.csv" 2>/dev/null &
  CLOCKS_PID=$!
fi
timeout "${BENCH_TIMEOUT:-460}" python3 -m coordinator.bench.predraft_target --out "$OUT" "$@" \
  > "$OUT/predraft_target_log.txt" 2>&1
echo "== bench rc $?"
[ -n "$CLOCKS_PID" ] && kill "$CLOCKS_PID" 2>/dev/null
grep -vE "^\|" "$OUT/predraft_target_log.txt" | tail -60
[ -f "$OUT/predraft_target.md" ] && head -14 "$OUT/predraft_target.md"
[ -f "$OUT/predraft_servers.log" ] && grep -iE "error|exception|traceback" "$OUT/predraft_servers.log" | head -20
ls -la "$OUT"
# The drafter's own costs behind the table (optional, PCOST=1): the decode-step draft D and the
# pre-draft P after it, alone on cuda:1 (drafter/tools/bench/predraft.py: predraft.json, predraft.md).
if [ -n "${PCOST:-}" ]; then
  timeout "${PCOST_TIMEOUT:-80}" python3 -m drafter.tools.bench.predraft --out "$OUT" --device cuda:1 \
    ${PCOST_ARGS:---batches 1,16 --ks 3,6 --iters 20} > "$OUT/predraft_cost_log.txt" 2>&1
  echo "== cost bench rc $?"
  grep -E "b=|^\| [0-9]" "$OUT/predraft_cost_log.txt" | head -12
fi
