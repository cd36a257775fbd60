"""The Triton interpreter without its per-call re-patching (CPU test runs only).

Under TRITON_INTERPRET=1 a kernel launch patches triton.language (its builtins, tensor methods and
math functions) for the launch and restores it afterwards.  Every call of a @triton.jit helper from
inside the kernel patches the same modules again (triton 3.x: `InterpretedFunction.__call__`), once
per helper call per program instance: each pass walks the modules with `inspect.getmembers` and
finds everything already patched.  That was about a fifth of the engine tests' time (5804 helper
calls, ~26 s of a 123 s tree-engine test).

`skip_repatching()` makes a helper's patch a no-op while a launch is running whose own patch, or
an earlier helper's in it (the interpreter never restores those), covered every language module
the helper sees (tl.sum, tl.zeros ... see triton.language.core, the kernels' own helpers see tl);
the first such helper call and any call outside a launch patch as before.  What the kernels
compute does not change: the modules are in the same patched state either way.  Where the interpreter's internals differ
(another Triton version), it changes nothing and says so by returning False.
"""

from __future__ import annotations

import inspect

_state = {"pending": False, "patched": None}  # the running launch: its own patch still to come / its modules
_real: dict = {}  # "patch_lang": the interpreter's own patching function, once installed


def _language_modules(fn, tl) -> frozenset[int]:
    """The triton.language modules `fn`'s globals name (what the interpreter patches for it)."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def skip_repatching() -> bool:
    """Install the shortcut once per process; True when it is in place."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        executor, patch_lang, empty_scope = interp.GridExecutor, interp._patch_lang, interp._LangPatchScope
    except (ImportError, AttributeError):
        return False
    if getattr(patch_lang, "_skips_repatching", False):
        return True
    launch = executor.__call__
    seen: dict = {}
    _real["patch_lang"] = patch_lang

    def patch_once(fn):
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = _language_modules(fn, tl)
        if _state["pending"]:  # the launch's own patch: done, and remembered
            _state["pending"], _state["patched"] = False, langs
            return _real["patch_lang"](fn)
        if _state["patched"] is not None and langs <= _state["patched"]:
            return empty_scope()  # a helper inside the launch: its modules are patched already
        scope = _real["patch_lang"](fn)  # a helper's patch is never restored: patched for the rest of the launch
        if _state["patched"] is not None:
            _state["patched"] = _state["patched"] | langs
        return scope

    def launch_tracked(self, *args, **kwargs):
        saved = dict(_state)
        _state["pending"], _state["patched"] = True, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.update(saved)

    patch_once._skips_repatching = True
    interp._patch_lang, executor.__call__ = patch_once, launch_tracked
    return True
