"""Hook vLLM's EAGLE proposer class, without importing vLLM's model code early.

vLLM calls plugins very early (argument parsing, engine core, each worker), before its model
runner exists; importing the proposer module there would pull in vLLM's model executor in
processes that never draft (the API server).  So `install_proposer_hook` patches the class if its
module is already loaded, and otherwise waits for vLLM to import it (an import-system finder that
patches the module right after it executes).

The patch itself only changes which class `EagleProposer(...)` builds: when remote drafting is
configured for that engine (settings.py) and the method is eagle / eagle3, vLLM's runner gets a
RemoteEagleProposer (a subclass, so every isinstance check in vLLM still holds).  Otherwise the
original class is built untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log

PROPOSER_MODULE = "vllm.v1.spec_decode.eagle"
_MARK = "_drafter_vllm_hooked"


def install_proposer_hook() -> None:
    module = sys.modules.get(PROPOSER_MODULE)
    if module is not None:
        patch_module(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != PROPOSER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # one module, once
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        patch_module(module)


def patch_module(module) -> None:
    cls = module.EagleProposer
    if getattr(cls, _MARK, False):
        return
    original_new = cls.__dict__.get("__new__")

    def __new__(klass, *args, **kwargs):
        if klass is cls:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if _wants_remote(vllm_config):
                from drafter_vllm.proposer import RemoteEagleProposer

                klass = RemoteEagleProposer
        if original_new is not None:
            return original_new(klass, *args, **kwargs)
        return object.__new__(klass)

    cls.__new__ = __new__
    setattr(cls, _MARK, True)
    log.debug("drafter plugin: hooked %s.EagleProposer", PROPOSER_MODULE)


def _wants_remote(vllm_config) -> bool:
    from drafter_vllm.settings import PluginSettings

    if vllm_config is None or vllm_config.speculative_config is None:
        return False
    settings = PluginSettings.from_vllm_config(vllm_config)
    if not settings.enabled:
        return False
    method = vllm_config.speculative_config.method
    if method not in ("eagle", "eagle3"):
        # configured, but for a method the drafter cannot stand in for here: say so, do not guess
        raise ValueError(f"drafter plugin: remote drafting is configured ({settings.transport} "
                         f"{','.join(settings.endpoints)}) but speculative method {method!r} is not "
                         f"supported; use eagle or eagle3, or unset DRAFTER_ENDPOINTS")
    return True
