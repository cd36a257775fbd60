#!/usr/bin/env bash
# Issue 6's record in one device call: the GPU tests, `drafter bench` over the issue's grid, then
# the remote-vs-in-process run.  Everything lands in $OUT (a device call returns at most 8 files:
# gpu.txt, gpu_tests.txt, bench_log.txt, bench.json, bench.png, remote.json, remote_log.txt).
#   OUT=/tmp/out bash bench/run_on_gpu.sh [drafter bench arguments...]
# Carried when present: .whl/ (wheels the host lacks: pyzmq, msgspec, grpcio-health-checking,
# grpcio-reflection, and grpcio + protobuf as new as the generated stubs need) and the generated
# stubs drafter/_proto/drafter/v1/*_pb2*.py (`python -m drafter._proto.build` on any machine).
# Knobs: SKIP_TESTS, SKIP_BENCH, SKIP_REMOTE, TEST_TIMEOUT, BENCH_TIMEOUT, REMOTE_TIMEOUT, REMOTE_ARGS;
# TESTS (the test files, default the GPU set below); BOUND=1 adds issue 18's bound-session run
# (python -m coordinator.bench.bound: bound.json, bound.md, bound_log.txt), BOUND_TIMEOUT, BOUND_ARGS;
# PINGPONG=1 adds the two-process event ping-pong floor (python -m drafter.tools.bench.ipc_pingpong:
# pingpong.json, pingpong.md, pingpong_stdout.txt; run before BOUND), PINGPONG_TIMEOUT, PINGPONG_ARGS.
# Issue 18 in one call (~8 min on a cold machine):
#   SKIP_BENCH=1 SKIP_REMOTE=1 BOUND=1 TESTS=tests/gpu/test_bound_ipc.py TEST_TIMEOUT=180 BOUND_TIMEOUT=300 \
#     OUT=$OUT bash bench/run_on_gpu.sh
# On a fresh machine (cold Triton cache) the GPU tests alone take ~5-6 minutes: within one
# 10-minute device call, run SKIP_BENCH=1 SKIP_REMOTE=1 first, then SKIP_TESTS=1 on the warm machine.
# The bench's compiled peer (drafter/tools/bench/peer.py) compiles once per (head, k, batch), ~7 s each on a
# cold machine: the default grid's 54 shapes alone take ~6 minutes, so pass a narrower grid (issue 24's:
# --heads eagle3-8b --ks 3 --batches 1,2,4,8,16,32,64, as bench/run_issue24.sh does) or --no-peer.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"   # OUT, the carried wheels, PYTHONPATH
describe_device
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu tests/unit/test_triton_kernels.py \
    tests/unit/test_step_kernels.py tests/unit/test_graph_runner.py tests/unit/test_bound.py} > "$OUT/gpu_tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.txt" | tail -8
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 -m drafter.tools.bench.grid --out "$OUT" "$@" > "$OUT/bench_log.txt" 2>&1
  grep -E "summary|^  (eagle|host)|k=. ctx=|^NVIDIA|TFLOP" "$OUT/bench_log.txt" | cut -c1-300 | tail -45
  rm -f "$OUT/bench.log"  # the same lines as bench_log.txt
fi
if [ -z "${SKIP_REMOTE:-}" ]; then
  timeout "${REMOTE_TIMEOUT:-300}" python3 -m coordinator.bench.remote --out "$OUT" ${REMOTE_ARGS:-} > "$OUT/remote_log.txt" 2>&1
  tail -20 "$OUT/remote_log.txt"
fi
if [ -n "${PINGPONG:-}" ]; then
  timeout "${PINGPONG_TIMEOUT:-120}" python3 -m drafter.tools.bench.ipc_pingpong --out "$OUT" ${PINGPONG_ARGS:-} > "$OUT/pingpong_stdout.txt" 2>&1
  echo "pingpong exit $?"
  tail -22 "$OUT/pingpong_stdout.txt"
fi
if [ -n "${BOUND:-}" ]; then
  timeout "${BOUND_TIMEOUT:-420}" python3 -m coordinator.bench.bound --out "$OUT" ${BOUND_ARGS:-} > "$OUT/bound_stdout.txt" 2>&1
  echo "bound bench exit $?"
  tail -45 "$OUT/bound_stdout.txt"
fi
ls -la "$OUT"
