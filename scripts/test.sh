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
  bash tests/vllm_parity/setup_venv.sh .venv-vllm
  VLLM_PY="$PWD/.venv-vllm/bin/python" PYTHON=python3 bash tests/vllm_parity/record_suite.sh .vllm-recordings
  echo "vLLM recording stage: $(( $(date +%s) - t0 ))s"
  export DRAFTER_VLLM_RECORDINGS="$PWD/.vllm-recordings"
fi
python3 -m pytest -q -p no:cacheprovider tests "$@"
