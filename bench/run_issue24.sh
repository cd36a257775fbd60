#!/usr/bin/env bash
# Issue 24's device record, run from a clean export of a commit (git archive) whose sibling ../old
# holds the same tree with drafter/engine/graphs.py and drafter/kernels/cuda_timing.py from before the fix
# (the engine's graphs captured on torch.cuda.graph's shared default capture stream):
#   STAGE=tests  the neighbours test (tests/gpu/test_graph_neighbours.py) on the old code (expected to
#                fail: illegal memory access) and on the new one, side by side; the old code again with
#                cuBLAS workspaces of size 0 (CUBLAS_WORKSPACE_CONFIG=:0:0, the diagnosis: nothing left
#                to lose) and the graph tests of the GPU set, side by side; a small bench with the peer
#   STAGE=bench  drafter bench for eagle3-8b, k=3, batches 1-64, contexts 1k and 8k, with the peer
#   STAGE=verify the neighbours test and the graph tests (new code only, side by side), then STAGE=bench
#   OUT=/tmp/out STAGE=tests bash bench/run_issue24.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
OUT=${OUT:-/tmp/drafter-out}
mkdir -p "$OUT"
NEW=$PWD
OLD=$(cd ../old && pwd)
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; date -u +%FT%TZ
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
NEIGHBOURS=tests/gpu/test_graph_neighbours.py

# run NAME TREE LIMIT ARGS...: pytest in TREE, output to $OUT/NAME.txt
run() {
  local name=$1 tree=$2 limit=$3
  shift 3
  (cd "$tree" && PYTHONPATH=$tree timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rA "$@") \
    > "$OUT/$name.txt" 2>&1
  echo "== $name: rc $?"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed|illegal memory" "$OUT/$name.txt" | sort | uniq -c | sort -rn | head -12
}

if [ "${STAGE:-tests}" = verify ]; then
  start=$SECONDS
  run new_tests "$NEW" 240 $NEIGHBOURS &
  run graph_tests "$NEW" 240 tests/gpu/test_gpu_paths.py -k "graph or back_to_back or pinned or bound" \
    tests/unit/test_graph_runner.py tests/unit/test_bound.py
  wait
  echo "-- $((SECONDS - start)) s"
  STAGE=bench
fi
if [ "${STAGE:-tests}" = tests ]; then
  start=$SECONDS
  run old_tests "$OLD" 300 -x $NEIGHBOURS &
  run new_tests "$NEW" 300 $NEIGHBOURS
  wait
  echo "-- $((SECONDS - start)) s"
  CUBLAS_WORKSPACE_CONFIG=:0:0 run old_ws0_tests "$OLD" 150 $NEIGHBOURS -k "not reset and not empty and not second" &
  run graph_tests "$NEW" 150 tests/gpu/test_gpu_paths.py -k "graph or back_to_back or pinned or bound" \
    tests/unit/test_graph_runner.py tests/unit/test_bound.py
  wait
  echo "-- $((SECONDS - start)) s"
  (cd "$NEW" && PYTHONPATH=$NEW timeout 150 python3 -m drafter.tools.bench.grid --out "$OUT/smoke" --heads eagle3-8b --ks 3 \
    --batches 1,16 --contexts 1024 --iters 5 --no-eager) > "$OUT/smoke_log.txt" 2>&1
  echo "== smoke bench: rc $?"
  grep -E "^eagle|peer|summary|Error|error" "$OUT/smoke_log.txt" | cut -c1-400 | tail -12
  rm -rf "$OUT/smoke"
  echo "-- $((SECONDS - start)) s"
fi
if [ "${STAGE:-tests}" = bench ]; then
  (cd "$NEW" && PYTHONPATH=$NEW timeout "${BENCH_TIMEOUT:-540}" python3 -m drafter.tools.bench.grid --out "$OUT" \
    --heads eagle3-8b --ks 3 --batches 1,2,4,8,16,32,64 --contexts 1024,8192 "$@") > "$OUT/bench_log.txt" 2>&1
  echo "== bench: rc $?"
  rm -f "$OUT/bench.log"
  grep -E "summary|^  |k=. ctx=|^NVIDIA|TFLOP|Error" "$OUT/bench_log.txt" | grep -v "GEMM plan" | cut -c1-420 | tail -40
fi
ls -la "$OUT"
