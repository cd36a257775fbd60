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

`share_block_types()`: every op of every program builds Triton type objects whose construction walks
Triton's own tuple classes (a block type's shape becomes a triton.language tuple with a tuple_type of
constexpr_types; a tensor's shape, a tuple of constexprs, the same again): a block type of an (element
type, int shape) seen before takes the shape, numel and name that Triton's constructor computed the first
time, and a tensor of a shape seen before takes that shape's constexpr tuple and numel (shared, never
mutated: Triton only rewrites tuples it builds from kernel source, which the interpreter never compiles).
Any other argument (a constexpr in a shape, an invalid one) goes through Triton's own constructor.

`skip_equal_shape_broadcasts()`: the interpreter's implicit broadcast of a binary op's operands returns
them unchanged when both are scalars or both blocks of one shape, but only after comparing Triton tuples
with lists (each comparison builds a tuple and its tuple_type): the shortcut returns them at once in
those two cases and hands every other pair (a splat, a real broadcast) to Triton's own.  Together with
the block-type sharing, about a third off an engine test's interpreted time (tests/unit/test_tp_graphs.py's
EAGLE-3 graph path on one process: 7.3 s -> 4.7 s CPU).

`install()` puts all five in place (tests/conftest.py for test processes, tests/support/ranks.py for the
ranks they spawn).
"""

from __future__ import annotations

import inspect

_state = {"pending": False, "patched": None}  # the running launch: its own patch still to come / its modules
_real: dict = {}  # Triton's own functions, once replaced: "patch_lang", "np_dtype", "block_init" ...


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


def _override_on_semantic(method: str, make) -> bool:
    """Install make(semantic, real) as `method` on the interpreter's semantic object (not the class:
    compiled kernels keep Triton's own; real is the class's function); True when it is in place."""
    try:
        import triton.runtime.interpreter as interp

        semantic = interp.interpreter_semantic
        real = getattr(type(semantic), method)
    except (ImportError, AttributeError):
        return False
    if method not in vars(semantic):
        _real[method] = real
        setattr(semantic, method, make(semantic, real))
    return True


def skip_discarded_overflow_checks() -> bool:
    """The interpreter's integer overflow check builds a condition it then drops (no device_assert
    outside debug): skipped, its operand checks kept."""
    def make(semantic, real):
        def overflow_check(lhs, rhs, binary_op):
            options = semantic.builder.options
            if options.debug:  # device_assert would keep it: Triton's own check
                return real(semantic, lhs, rhs, binary_op)
            if lhs.type.scalar.int_bitwidth >= 64 or not options.sanitize_overflow:
                return None
            # what Triton's check asserts before it builds the dropped condition
            assert lhs.type.scalar == rhs.type.scalar, f"expected matching operand types, got {lhs.type.scalar} " \
                                                       f"and {rhs.type.scalar}"
            assert lhs.type.scalar.is_int(), f"expected integer type, got {lhs.type.scalar}"
            return None
        return overflow_check

    return _override_on_semantic("binary_op_sanitize_overflow_impl", make)


def _element_key(element_ty) -> tuple:
    """What a block type's name and equality read of its element type (a pointer's too)."""
    return (type(element_ty), str(element_ty), getattr(element_ty, "address_space", None),
            getattr(element_ty, "const", None))


def share_block_types() -> bool:
    """Install the shared block-type and tensor-shape attributes once per process; True when in place."""
    try:
        import triton.language.core as core

        block_init, tensor_init = core.block_type.__init__, core.tensor.__init__
    except (ImportError, AttributeError):
        return False
    if getattr(block_init, "_shared", False):
        return True
    _real["block_init"], _real["tensor_init"] = block_init, tensor_init
    triton_tuple = core.tuple
    elements: dict = {}  # id(element type) -> (that element type, _element_key): kept alive, so ids stay its
    blocks: dict = {}  # (_element_key, dims) -> (shape, numel, name) as Triton's constructor computed them
    shapes: dict = {}  # a tensor's dimensions -> (numel, shape) as Triton's constructor computed them

    def block_key(element_ty, shape) -> tuple | None:
        """None where the shape is no list or Triton tuple of plain ints (Triton's constructor decides)."""
        dims = shape.values if type(shape) is triton_tuple else shape if type(shape) is list else None
        if not dims or any(type(d) is not int for d in dims):
            return None
        known = elements.get(id(element_ty))
        if known is None or known[0] is not element_ty:
            known = elements[id(element_ty)] = (element_ty, _element_key(element_ty))
        return known[1], (*dims,)

    def block_type_init(self, element_ty, shape):
        key = block_key(element_ty, shape)
        seen = blocks.get(key) if key is not None else None
        if seen is None:
            block_init(self, element_ty, shape)  # raises as Triton does on a shape it refuses
            if key is not None:
                blocks[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = seen

    def shared_tensor_init(self, handle, ty):
        dims = (*ty.shape.values,) if ty.is_block() else ()
        seen = shapes.get(dims)
        if seen is None:
            tensor_init(self, handle, ty)
            shapes[dims] = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, ty, ty.scalar
        self.numel, self.shape = seen

    block_type_init._shared = True
    core.block_type.__init__, core.tensor.__init__ = block_type_init, shared_tensor_init
    return True


def skip_equal_shape_broadcasts() -> bool:
    """Two scalars, or two blocks of one shape, returned at once as Triton's broadcast returns them;
    every other pair goes through Triton's own."""
    def make(semantic, real):
        def broadcast_pair(lhs, rhs):
            lhs_block, rhs_block = lhs.type.is_block(), rhs.type.is_block()
            if lhs_block == rhs_block and (not lhs_block or lhs.type.shape.values == rhs.type.shape.values):
                return lhs, rhs
            return real(semantic, lhs, rhs)
        return broadcast_pair

    return _override_on_semantic("broadcast_impl_value", make)


def install() -> bool:
    """The five shortcuts; True when all are in place."""
    return (skip_repatching() & cache_np_dtypes() & skip_discarded_overflow_checks() & share_block_types()
            & skip_equal_shape_broadcasts())
