#!/usr/bin/env bash
# Write make-tiny checkpoints and record the standard set of vLLM proposer runs (one process).
#   record_suite.sh OUT_ROOT
# Env: PYTHON (has `drafter` importable, default python3), VLLM_PY (the vLLM venv's python,
# default .venv-vllm/bin/python), K (default 3), MML (max_model_len, default 128).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$(mkdir -p "${1:?usage: record_suite.sh OUT_ROOT}" && cd "$1" && pwd)"
PYTHON="${PYTHON:-python3}"
VLLM_PY="${VLLM_PY:-$REPO/.venv-vllm/bin/python}"
K="${K:-3}"
MML="${MML:-128}"
t0=$(date +%s)
rm -rf "$OUT/ckpt" "$OUT/rec"
mkdir -p "$OUT/ckpt" "$OUT/rec"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$OUT/ckpt" <<'PY'
import sys
from drafter.models.tiny import write_tiny
for m in ("eagle", "eagle3"):
    for v in ("plain", "aligned"):
        write_tiny(m, f"{sys.argv[1]}/{m}-{v}")
PY
for m in eagle eagle3; do "$VLLM_PY" "$HERE/align_weights.py" "$OUT/ckpt/$m-aligned" --method "$m"; done
"$VLLM_PY" - "$OUT" "$K" "$MML" > "$OUT/rec/runs.json" <<'PY'
import json, sys
out, k, mml = sys.argv[1], sys.argv[2], sys.argv[3]
runs = [  # name, checkpoint, method, extra flags
    ("eagle-padded", "eagle-plain", "eagle", []),
    ("eagle3-padded", "eagle3-plain", "eagle3", []),
    ("eagle-unpadded", "eagle-plain", "eagle", ["--disable-padded-drafter-batch"]),
    ("eagle-aligned-chunked", "eagle-aligned", "eagle", ["--max-num-batched-tokens", "64"]),
    ("eagle3-aligned", "eagle3-aligned", "eagle3", []),
]
print(json.dumps([["--target", f"{out}/ckpt/{ck}/target", "--head", f"{out}/ckpt/{ck}/head",
                   "--method", m, "--k", k, "--max-model-len", mml, "--out", f"{out}/rec/{n}", *x]
                  for n, ck, m, x in runs], indent=1))
PY
"$VLLM_PY" "$HERE/record_vllm.py" --runs "$OUT/rec/runs.json" > "$OUT/rec/record.log" 2>&1 \
  || { tail -40 "$OUT/rec/record.log"; exit 1; }
grep '^{"out"' "$OUT/rec/record.log"
echo "suite total $(( $(date +%s) - t0 ))s"
