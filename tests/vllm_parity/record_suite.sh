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
import json, sys
from drafter.models.tiny import head_sizes, write_tiny
for m in ("eagle", "eagle3"):
    for v in ("plain", "aligned"):
        write_tiny(m, f"{sys.argv[1]}/{m}-{v}")
# heads whose config carries a real rope (and biases, partial rotary, head_dim 64): one checkpoint per run
# below; the other rope types are checked table by table (--rope-tables)
ROPE_HEADS = {  # name: (method, head_sizes flags)
    "llama3-legacy": ("eagle3", dict(rope="llama3")),
    "llama3-params": ("eagle3", dict(rope="llama3", rope_layout="params")),
    "qwen3-legacy": ("eagle3", dict(rope="qwen3")),
    "qwen3-params": ("eagle3", dict(rope="qwen3", rope_layout="params", eagle3_layout="plain", attention_bias=True,
                                    mlp_bias=True)),
    "yarn-legacy": ("eagle", dict(rope="yarn")),
    "yarn-params": ("eagle", dict(rope="yarn", rope_layout="params", partial_rotary_factor=0.5)),
    "linear-legacy": ("eagle3", dict(rope="linear", eagle3_layout="plain", head_dim=64)),
    "linear-params": ("eagle", dict(rope="linear", rope_layout="params", attention_bias=True, mlp_bias=True)),
}
for name, (m, flags) in ROPE_HEADS.items():
    write_tiny(m, f"{sys.argv[1]}/rope-{name}", sizes=head_sizes(m, **flags))
json.dump({f"rope-{name}": m for name, (m, _) in ROPE_HEADS.items()}, open(f"{sys.argv[1]}/rope_heads.json", "w"))
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
# rope heads: plain make-tiny weights (small argmax margins: a wrong rotation shows), fewer prompts
with open(f"{out}/ckpt/rope_heads.json") as f:
    runs += [(n, n, m, ["--num-prompts", "4"]) for n, m in json.load(f).items()]
print(json.dumps([["--target", f"{out}/ckpt/{ck}/target", "--head", f"{out}/ckpt/{ck}/head",
                   "--method", m, "--k", k, "--max-model-len", mml, "--out", f"{out}/rec/{n}", *x]
                  for n, ck, m, x in runs], indent=1))
PY
"$VLLM_PY" "$HERE/record_vllm.py" --runs "$OUT/rec/runs.json" \
  --rope-tables "$REPO/tests/fixtures/rope_cases.json" "$OUT/rec/rope" > "$OUT/rec/record.log" 2>&1 \
  || { tail -40 "$OUT/rec/record.log"; exit 1; }
grep '^{"out"\|^{"rope_tables"' "$OUT/rec/record.log"
echo "suite total $(( $(date +%s) - t0 ))s"
