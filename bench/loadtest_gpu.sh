#!/usr/bin/env bash
# `drafter loadtest` on a GPU host: `drafter serve` on cuda:0 with an EAGLE-3 head of Llama-3.1-8B
# shapes (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, draft vocab 32000, target vocab
# 128256; random weights written to /tmp), loaded from the same host over ZMQ and gRPC (bidi
# stream): open loop at a few rates, then closed loop.  One drafter start serves every run.
#
#   OUT=/tmp/out bash bench/loadtest_gpu.sh                  # on the GPU host (the device tool sets OUT)
#   LOADTEST_CPU=1 OUT=/tmp/out bash bench/loadtest_gpu.sh   # the same steps on a CPU, small head, seconds
#
# What comes back in $OUT (few files: the device tool returns at most 8):
#   loadtest_gpu.log          everything printed, the summary table included
#   gpu.txt                   nvidia-smi + torch versions
#   index.json                one line of numbers per run
#   loadtest_results.tgz      per run: REPORT.json (raw samples) + REPORT.png; server.log; index.json
# Commit the unpacked results under bench/results/<date>-<device>-loadtest/.
#
# The GPU host lacks pyzmq, msgspec, grpcio-health-checking, grpcio-reflection (and grpcio-tools):
# carry them as wheels in .whl/ and carry the generated stubs drafter/_proto/drafter/v1 (made on
# any machine with grpcio-tools by `python -m drafter._proto.build`).  Knobs: the variables below.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/drafter-loadtest}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/loadtest_gpu.log") 2>&1
T0=$(date +%s)

if [ -n "${LOADTEST_CPU:-}" ]; then  # dry run: same code path, a head a CPU serves in milliseconds
  : "${SHAPE:=mini-eagle3}" "${DEVICE:=cpu}" "${DURATION:=4}" "${WARMUP:=1}" "${RATES:=10,20}" "${DP:=2}"
  : "${MAX_NUM_SEQS:=8}" "${TOKENS:=128}" "${MML:=256}" "${PROMPT:=uniform:8:64}" "${OUTPUT:=uniform:8:64}"
  : "${CHUNK:=32}" "${SERVER_ARGS:=--server-arg=--torch-threads=1}" "${TIMEOUT_S:=5}"
else
  : "${SHAPE:=llama3-8b-eagle3}" "${DEVICE:=cuda:0}" "${DURATION:=20}" "${WARMUP:=4}" "${RATES:=50,100,200}"
  : "${DP:=4}" "${MAX_NUM_SEQS:=64}" "${TOKENS:=2048}" "${MML:=4096}" "${PROMPT:=lognormal:512:0.8}"
  : "${OUTPUT:=lognormal:256:0.7}" "${CHUNK:=512}" "${SERVER_ARGS:=}" "${TIMEOUT_S:=1}"
fi
: "${TRANSPORTS:=zmq,grpc}" "${TP:=2}" "${CONCURRENCY:=1}" "${LOADTEST_BUDGET_S:=420}"

# ---- packages the host lacks, from carried wheels
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# ---- generated gRPC stubs: carried, else generated here (needs grpcio-tools)
if [ ! -f drafter/_proto/drafter/v1/drafter_pb2.py ]; then
  python3 -m drafter._proto.build >/dev/null || {
    echo "no gRPC stubs: carry drafter/_proto/drafter/v1 or a grpcio-tools wheel in .whl/"; exit 1; }
fi
python3 - <<'EOF' || exit 1
import importlib, sys
missing = []
for name in ("torch", "numpy", "grpc", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "zmq",
             "msgspec", "prometheus_client", "safetensors", "rich", "matplotlib",
             "drafter._proto.drafter.v1.drafter_pb2"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    sys.exit("missing: " + "; ".join(missing))
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())
EOF

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, grpc, zmq; print('torch', torch.__version__, 'grpcio', grpc.__version__, 'pyzmq', zmq.__version__)"
  nproc; date -u +%FT%TZ; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

RESULTS=/tmp/loadtest-results
rm -rf "$RESULTS"
# One invocation: the drafter is written/loaded once; each transport x (rates, closed loop) is one run.
# timeout: SIGTERM ends the current run cleanly (reports kept, drafter stopped); the budget leaves
# room inside a 10-minute device call.
timeout -k 30 "$LOADTEST_BUDGET_S" python3 -m drafter loadtest --spawn-server --shape "$SHAPE" --device "$DEVICE" \
  --transport "$TRANSPORTS" --mode open,closed --rate "$RATES" --concurrency "$CONCURRENCY" \
  --duration "$DURATION" --warmup "$WARMUP" --timeout "$TIMEOUT_S" --dp "$DP" --tp "$TP" \
  --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$TOKENS" --max-model-len "$MML" \
  --prompt-len "$PROMPT" --output-len "$OUTPUT" --prefill-chunk "$CHUNK" --ready-timeout 300 \
  ${SERVER_ARGS} --out "$RESULTS" --quiet
RC=$?
echo "drafter loadtest exit code $RC after $(( $(date +%s) - T0 )) s"
[ -f "$RESULTS/index.json" ] && cp "$RESULTS/index.json" "$OUT/index.json"
tail -n 20 "$RESULTS/server.log" 2>/dev/null | cut -c1-400
tar czf "$OUT/loadtest_results.tgz" -C "$RESULTS" . && ls -la "$OUT"
exit $RC
