"""Hook vLLM's drafting classes and runners, without importing vLLM's model code early.

vLLM calls plugins very early (argument parsing, engine core, each worker), before its model
runner exists; importing runner modules there would pull in vLLM's model executor in processes
that never draft (the API server).  So `install_proposer_hook` patches each module below if it is
already loaded, and otherwise when vLLM imports it (an import-system finder that patches the module
right after it executes):

  vllm.v1.spec_decode.eagle                        EagleProposer(...) builds RemoteEagleProposer (V1)
  vllm.v1.worker.gpu.spec_decode.eagle.speculator  EagleSpeculator(...) builds RemoteEagleSpeculator (MRv2)
  vllm.v1.worker.gpu_model_runner                  the V1 runner checks the drafter it built (plan.py)
  vllm.v1.worker.gpu.model_runner                  Model Runner V2 checks the speculator it built

The constructors build the plugin's subclass (so every isinstance check in vLLM still holds) only when
remote drafting is configured for that engine (settings.py) and the method is eagle / eagle3;
otherwise vLLM's own class is built untouched.  The runner checks stop vLLM at start-up when remote
drafting is configured and the drafter the runner built is not the plugin's (never a silent bypass).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log

PROPOSER_MODULE = "vllm.v1.spec_decode.eagle"
SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.eagle.speculator"
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
_MARK = "_drafter_vllm_hooked"


def install_proposer_hook() -> None:
    pending = []
    for name, patch in _patches().items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending.append(name)
    finder = next((f for f in sys.meta_path if isinstance(f, _PatchOnImport)), None)
    if finder is None and pending:
        sys.meta_path.insert(0, _PatchOnImport(pending))


def _patches() -> dict:
    return {PROPOSER_MODULE: patch_module, SPECULATOR_MODULE: patch_speculator_module,
            V1_RUNNER_MODULE: patch_v1_runner_module, V2_RUNNER_MODULE: patch_v2_runner_module}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self.names.discard(fullname)  # each module once
        if not self.names:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec.loader = _PatchingLoader(spec.loader, _patches()[fullname])
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner = inner
        self.patch = patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


# ---------------------------------------------------------------------- drafting classes
def patch_module(module) -> None:
    """V1: EagleProposer(vllm_config, ...) builds RemoteEagleProposer when remote drafting is on."""
    _build_stand_in(module.EagleProposer, "drafter_vllm.proposer", "RemoteEagleProposer")


def patch_speculator_module(module) -> None:
    """Model Runner V2: EagleSpeculator(vllm_config, device) builds RemoteEagleSpeculator when it is on."""
    _build_stand_in(module.EagleSpeculator, "drafter_vllm.mrv2", "RemoteEagleSpeculator")


def _build_stand_in(cls, stand_in_module: str, stand_in_name: str) -> None:
    if getattr(cls, _MARK, False):
        return
    original_new = cls.__dict__.get("__new__")

    def __new__(klass, *args, **kwargs):
        if klass is cls:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if _wants_remote(vllm_config):
                klass = getattr(importlib.import_module(stand_in_module), stand_in_name)
        if original_new is not None:
            return original_new(klass, *args, **kwargs)
        return object.__new__(klass)

    cls.__new__ = __new__
    setattr(cls, _MARK, True)
    log.debug("drafter plugin: hooked %s.%s", cls.__module__, cls.__qualname__)


def _wants_remote(vllm_config) -> bool:
    from drafter_vllm.plan import METHODS, RemoteDraftingBypassed, bypass_message, drafting_plan, remote_settings

    settings = remote_settings(vllm_config)
    if settings is None:
        return False
    if vllm_config.speculative_config.method not in METHODS:
        # configured, but for a method the drafter cannot stand in for here: say so, do not guess
        raise RemoteDraftingBypassed(bypass_message(drafting_plan(vllm_config), settings))
    return True


# ---------------------------------------------------------------------- runners: never bypassed
def patch_v1_runner_module(module) -> None:
    """The V1 runner builds its drafter in __init__: check it right after."""
    cls = module.GPUModelRunner
    if getattr(cls, _MARK, False):
        return
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, vllm_config, *args, **kwargs):
        from drafter_vllm.plan import check_built, check_plan

        check_plan(vllm_config)
        original_init(self, vllm_config, *args, **kwargs)
        check_built(vllm_config, getattr(self, "drafter", None))

    cls.__init__ = __init__
    setattr(cls, _MARK, True)


def patch_v2_runner_module(module) -> None:
    """Model Runner V2 builds its speculator through init_speculator (imported into its module)."""
    original = module.init_speculator
    if getattr(original, _MARK, False):
        return
    module.init_speculator = checked_init_speculator(original)


def checked_init_speculator(original):
    @functools.wraps(original)
    def init_speculator(vllm_config, *args, **kwargs):
        from drafter_vllm.plan import check_built, check_plan

        plan = check_plan(vllm_config)
        built = original(vllm_config, *args, **kwargs)
        check_built(vllm_config, built)
        if plan is not None:
            log.info("drafter plugin: %s builds %s; %s stands in for it", plan.runner, plan.builds, plan.stand_in)
        return built

    setattr(init_speculator, _MARK, True)
    return init_speculator
