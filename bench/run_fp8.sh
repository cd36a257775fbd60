#!/usr/bin/env bash
# Issue 24's FP8 record (--weights fp8) in one device call of at most ~5 minutes on an H100 (cold):
# `drafter bench --weights fp8`: eagle3-8b, k=3, batches 1, 16, 64, contexts 1k and 8k, the bf16 head
# and the same weights as per-channel FP8 in one process (fp8 / bf16 per row, floors with FP8 bytes);
# then, on the Triton cache the bench warmed, the FP8 GPU tests (tests/gpu/test_fp8_channel.py: the
# per-channel FP8 kernel against the dequantised reference at every candidate tile, the fused FP8
# engine against the eager one).
#   OUT=/tmp/out bash bench/run_fp8.sh [more drafter bench arguments...]
# Files in $OUT: gpu.txt, fp8_tests.txt, bench_log.txt, bench.json, bench.png.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
OUT=${OUT:-/tmp/drafter-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; date -u +%FT%TZ
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
start=$SECONDS
timeout "${BENCH_TIMEOUT:-200}" python3 -m drafter.tools.bench.grid --out "$OUT" --weights fp8 --heads eagle3-8b \
  --ks 3 --batches 1,16,64 --contexts 1024,8192 --no-eager --no-peer "$@" > "$OUT/bench_log.txt" 2>&1
echo "== bench: rc $? ($((SECONDS - start)) s)"
rm -f "$OUT/bench.log"  # the same lines as bench_log.txt
grep -E "^NVIDIA|TFLOP|weights per|engine built|^eagle|summary|^  eagle|FP8|^  head|Error" "$OUT/bench_log.txt" \
  | cut -c1-300 | tail -40
timeout "${TEST_TIMEOUT:-95}" python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_fp8_channel.py \
  > "$OUT/fp8_tests.txt" 2>&1
echo "== fp8 GPU tests: rc $? ($((SECONDS - start)) s)"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/fp8_tests.txt" | tail -20
