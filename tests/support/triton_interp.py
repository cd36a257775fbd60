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

`cache_np_dtypes()` answers the interpreter's Triton-dtype -> NumPy-dtype lookup from a memo: the
interpreter's own function builds its table of every dtype anew on each call (about 20 dtype hashes),
once per splat, cast and load of every program, which was ~6% of an engine test's time.  The memo is
filled by that same function, so every answer is the one it gives.

`skip_discarded_overflow_checks()`: every integer +, - and * of a kernel computes Triton's overflow
check (both operands cast to int64, the operation again, two comparisons, an and) and hands it to
device_assert, which drops it unless the builder's options have debug on; the interpreter's never do
(InterpreterOptions.debug is False), so the check was computed only to be dropped: about a quarter of
the interpreter's time.  The shortcut skips computing it while debug is off (the type assertions that
run before it still run) and runs Triton's own check when debug is on.

`install()` puts all three in place (tests/conftest.py for test processes, tests/support/ranks.py for the
ranks they spawn).
"""

from __future__ import annotations

import inspect

_state = {"pending": False, "patched": None}  # the running launch: its own patch still to come / its modules
_real: dict = {}  # the interpreter's own functions, once replaced: "patch_lang", "np_dtype"


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


def cache_np_dtypes() -> bool:
    """Install the memoized dtype lookup once per process; True when it is in place."""
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interp

        lookup = interp._get_np_dtype
    except (ImportError, AttributeError):
        return False
    if getattr(lookup, "_memoized", False):
        return True
    pointer = np.dtype(np.uint64)
    memo: dict = {}
    _real["np_dtype"] = lookup

    def np_dtype(tt_dtype):
        # the interpreter's order: a pointer (or a block of pointers) is uint64, a block its element's dtype
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        found = memo.get(scalar)
        if found is None:
            found = memo[scalar] = lookup(scalar)
        return found

    np_dtype._memoized = True
    interp._get_np_dtype = np_dtype
    return True


def skip_discarded_overflow_checks() -> bool:
    """Install the shortcut on the interpreter's semantic object (not the class: compiled kernels keep
    Triton's own); True when it is in place."""
    try:
        import triton.runtime.interpreter as interp

        semantic = interp.interpreter_semantic
        check = type(semantic).binary_op_sanitize_overflow_impl
    except (ImportError, AttributeError):
        return False
    if "binary_op_sanitize_overflow_impl" in vars(semantic):
        return True
    _real["overflow_check"] = check

    def overflow_check(lhs, rhs, binary_op):
        options = semantic.builder.options
        if options.debug:  # device_assert would keep it: Triton's own check
            return _real["overflow_check"](semantic, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not options.sanitize_overflow:
            return None
        # what Triton's check asserts before it builds the dropped condition
        assert lhs.type.scalar == rhs.type.scalar, f"expected matching operand types, got {lhs.type.scalar} and " \
                                                   f"{rhs.type.scalar}"
        assert lhs.type.scalar.is_int(), f"expected integer type, got {lhs.type.scalar}"
        return None

    semantic.binary_op_sanitize_overflow_impl = overflow_check
    return True


def install() -> bool:
    """The three shortcuts; True when all are in place."""
    return skip_repatching() & cache_np_dtypes() & skip_discarded_overflow_checks()
