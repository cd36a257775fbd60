#!/usr/bin/env bash
# The project's test command (README and .ci/run both call it).
#   Stage 1: record proposer calls from a real vLLM 0.32 engine (CPU build) on tiny checkpoints.
#            Its venv (.venv-vllm) and recordings (.vllm-recordings) live inside the clone.
#            Set DRAFTER_VLLM_RECORDINGS=DIR to reuse a recorded suite and skip this stage.
#   Stage 2: every test, the vLLM replay included.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${DRAFTER_VLLM_RECORDINGS:-}" ]; then
  t0=$(date +%s)
  [ -x .venv-vllm/bin/python ] || echo "building the vLLM 0.32 CPU venv in .venv-vllm (once: 2-3 min, up to 3.5 GB)"
  # pip runs quietly in there: a line every 20 s says it is still going
  ( while sleep 20; do echo "  ... vLLM venv / recordings: $(( $(date +%s) - t0 ))s"; done ) &
  ticker=$!
  trap 'kill $ticker 2>/dev/null || true' EXIT
  bash tests/vllm_parity/setup_venv.sh .venv-vllm
  VLLM_PY="$PWD/.venv-vllm/bin/python" PYTHON=python3 bash tests/vllm_parity/record_suite.sh .vllm-recordings
  kill $ticker 2>/dev/null || true
  echo "vLLM recording stage: $(( $(date +%s) - t0 ))s"
  export DRAFTER_VLLM_RECORDINGS="$PWD/.vllm-recordings"
fi
python3 -m pytest -q -p no:cacheprovider tests "$@"
