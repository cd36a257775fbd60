#!/usr/bin/env bash
# Write make-tiny checkpoints and record the standard set of vLLM proposer runs: two recorder
# processes side by side (each imports vLLM once and records every other run; one also records the
# rope tables), since each runs on one OpenMP thread and CI has two cores.
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
"$VLLM_PY" "$HERE/align_weights.py" "$OUT/ckpt/eagle-aligned" --method eagle &
aligning=$!
"$VLLM_PY" "$HERE/align_weights.py" "$OUT/ckpt/eagle3-aligned" --method eagle3
wait "$aligning"
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
argv = [["--target", f"{out}/ckpt/{ck}/target", "--head", f"{out}/ckpt/{ck}/head",
         "--method", m, "--k", k, "--max-model-len", mml, "--out", f"{out}/rec/{n}", *x] for n, ck, m, x in runs]
print(json.dumps(argv, indent=1))
for i in (0, 1):  # one list per recorder process: every other run
    with open(f"{out}/rec/runs-{i}.json", "w") as f:
        json.dump(argv[i::2], f, indent=1)
PY
# recorder 0: runs 0, 2, 4, ...; recorder 1: runs 1, 3, ... and the rope tables (no engine, ~5 s)
"$VLLM_PY" "$HERE/record_vllm.py" --runs "$OUT/rec/runs-0.json" > "$OUT/rec/record-0.log" 2>&1 &
rec0=$!
rc1=0
"$VLLM_PY" "$HERE/record_vllm.py" --runs "$OUT/rec/runs-1.json" \
  --rope-tables "$REPO/tests/fixtures/rope_cases.json" "$OUT/rec/rope" > "$OUT/rec/record-1.log" 2>&1 || rc1=$?
rc0=0
wait "$rec0" || rc0=$?
for i in 0 1; do
  rc_var="rc$i"
  if [ "${!rc_var}" -ne 0 ]; then echo "recorder $i failed (${!rc_var}):"; tail -40 "$OUT/rec/record-$i.log"; fi
done
[ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || exit 1
grep -h '^{"out"\|^{"rope_tables"' "$OUT/rec/record-1.log" "$OUT/rec/record-0.log"
echo "suite total $(( $(date +%s) - t0 ))s"
