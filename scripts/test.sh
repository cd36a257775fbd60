#!/usr/bin/env bash
# The project's test command (README and .ci/run both call it).
# Stage 1: CPU tests.  Stage 2: vLLM parity, replaying proposer calls recorded from a real
# vLLM engine (its venv lives inside the clone, .venv-vllm, and is made on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q -p no:cacheprovider tests "$@"
