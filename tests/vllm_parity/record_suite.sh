#!/usr/bin/env bash
# Write make-tiny checkpoints and record the standard set of vLLM proposer runs.
#   record_suite.sh OUT_ROOT
# Env: PYTHON (has `drafter` importable, default python3), VLLM_PY (the vLLM venv's python,
# default .venv-vllm/bin/python), K (default 3), MML (max_model_len, default 128).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${1:?usage: record_suite.sh OUT_ROOT}"
PYTHON="${PYTHON:-python3}"
VLLM_PY="${VLLM_PY:-$REPO/.venv-vllm/bin/python}"
K="${K:-3}"
MML="${MML:-128}"
mkdir -p "$OUT/ckpt" "$OUT/rec"
t0=$(date +%s)
for m in eagle eagle3; do
  for v in plain aligned; do
    d="$OUT/ckpt/$m-$v"
    rm -rf "$d"
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
      "from drafter.models.tiny import write_tiny; write_tiny('$m', '$d')"
    if [ "$v" = aligned ]; then "$VLLM_PY" "$HERE/align_weights.py" "$d" --method "$m"; fi
  done
done
run() {  # name ckpt method extra-args...
  local name="$1" ck="$2" m="$3"; shift 3
  rm -rf "$OUT/rec/$name"
  local s=$(date +%s)
  "$VLLM_PY" "$HERE/record_vllm.py" --target "$OUT/ckpt/$ck/target" --head "$OUT/ckpt/$ck/head" \
      --method "$m" --k "$K" --max-model-len "$MML" --out "$OUT/rec/$name" "$@" \
      > "$OUT/rec/$name.log" 2>&1 || { tail -30 "$OUT/rec/$name.log"; exit 1; }
  echo "$name: $(tail -1 "$OUT/rec/$name.log") wall=$(( $(date +%s) - s ))s"
}
run eagle-padded          eagle-plain    eagle
run eagle3-padded         eagle3-plain   eagle3
run eagle-unpadded        eagle-plain    eagle  --disable-padded-drafter-batch
run eagle-aligned-chunked eagle-aligned  eagle  --max-num-batched-tokens 64
run eagle3-aligned        eagle3-aligned eagle3
echo "suite total $(( $(date +%s) - t0 ))s"
