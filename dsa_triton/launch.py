"""Lean eager launches: a repeated launch calls the compiled kernel directly, past Triton's Python launcher.

An op launches with ``launch(kernel, grid, *args, **meta)`` where it would write ``kernel[grid](*args, **meta)``.
Triton's own launch (``JITFunction.run``) rebuilds on every call what a repeated call already knew: it binds the
arguments, specializes each one, formats the options into a string key, looks the compiled kernel up, builds the
launch metadata and calls the (empty) launch hooks. Here the first call of each specialization goes through
Triton unchanged (it compiles when needed and launches), and its compiled kernel is kept under a key of
everything Triton specializes on; a later call with an equal key launches that kernel with the current stream.

The key (:meth:`LeanKernel.key_function` builds one function per argument layout, as Triton's binder is built
per signature) holds, per positional argument: a tensor's dtype and whether its address is a multiple of 16; an
int's class (equal to 1; else int32, int64 or uint64 range, each split by divisibility by 16); the kind of a
bool, float or None; a constexpr's value and type. Then every keyword argument's value and type (constexprs and
options such as ``num_warps``), the current device and Triton's two global option knobs (``debug`` and the
instrumentation mode). That is at least as fine as Triton's own cache key, so an equal key launches the kernel
Triton itself would launch. In front of it sits a cheaper key of the same call (:meth:`LeanKernel.layout_functions`):
ints by value instead of by class, each tensor's dtype, alignment and ``is_cuda``; it also hands back the tensors'
addresses, and a hit launches with those ints (the launcher then skips its per-pointer ``data_ptr`` call and driver
query). A miss there that hits the class key launches once with the tensors themselves, whose pointers the launcher
checks, before its key is kept. Anything else (an argument of another kind, a callable grid, a launch hook or
pre-run hook set, a global the kernel reads changed since it compiled, a keyword value other than an int, bool,
str, None or ``tl.dtype``: floats, say, where ``0.0 == -0.0`` but Triton compiles them apart) takes Triton's path.
A key that differs only where Triton's does not costs one more pass through Triton's path, never a wrong kernel.

On a hit nothing is allocated, no file is touched and no device memory is read: the launch is capturable in a
CUDA graph once each specialization has run once eagerly. In the Triton interpreter (``TRITON_INTERPRET=1``)
kernels are not :class:`~triton.runtime.jit.JITFunction` objects and ``launch`` is ``kernel[grid](...)``, as is
any other launchable object (an autotuner, a test's stub).

``DSA_LEAN_LAUNCH=0`` in the environment (or ``ENABLED = False`` here) sends every launch through Triton's path.
The host cost per launch, Triton's path against this one with the kernels' own launches:
``scripts/launch_cost.py``.
"""
from __future__ import annotations

import os

import torch
import triton.language as tl
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

ENABLED = os.environ.get("DSA_LEAN_LAUNCH", "1") != "0"  # off (DSA_LEAN_LAUNCH=0): every launch is Triton's
MAX_ENTRIES = 256  # compiled launches kept per kernel; past this the cache starts over (misses take Triton's path)
MAX_FAST_ENTRIES = 1024  # fast keys (ints by value) kept per kernel; past this they start over
MAX_LAYOUTS = 4  # argument layouts (kinds of the positional arguments, arity) with a key function, per kernel
KEY_SAFE = (int, bool, str, type(None), tl.dtype)  # keyword values whose equality (with their type) fixes str()
_ATTRIBUTE = "_dsa_lean"


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``, through the kernel's :class:`LeanKernel` when it is a compiled-mode
    ``@triton.jit`` function. Pass every argument that is not a constexpr positionally: keyword arguments are
    keyed by value. Returns what Triton's launch returns (the compiled kernel)."""
    if not ENABLED or (type(kernel) is not JITFunction and not isinstance(kernel, JITFunction)):
        return kernel[grid](*args, **meta)
    lean = kernel.__dict__.get(_ATTRIBUTE)
    if lean is None:
        lean = LeanKernel(kernel)
        setattr(kernel, _ATTRIBUTE, lean)
    if not lean.layouts:  # the first call (CUDA may be uninitialised: _device does not initialise it)
        return lean.through_triton(grid, args, meta, None, None)
    device = _device()
    for fast_of, key_of in lean.layouts:  # (the hit path is inline: one Python frame less per launch)
        try:
            fast, pointers = fast_of(args, meta, device)
            break
        except Exception:  # another layout (or a value that cannot be keyed): the next one, or none
            pass
    else:
        return lean.through_triton(grid, args, meta, None, device)
    try:
        entry = lean.fast.get(fast)
    except TypeError:  # an unhashable keyword value
        return lean.through_triton(grid, args, meta, None, device)
    if type(grid) is not tuple or kernel.pre_run_hooks or not hooks_idle() or lean.globals_changed():
        return lean.through_triton(grid, args, meta, None, device)
    if entry is None:
        try:
            key = key_of(args, meta, device)
            entry = lean.entries.get(key)
        except Exception:  # a value the key cannot take (an int past uint64: Triton raises) or cannot hash
            key = None
        if entry is None:
            return lean.through_triton(grid, args, meta, key, device)
        pointers = args  # this once, the tensors: the launcher checks each pointer before the fast key is kept
    n = len(grid)
    run, head, tail = entry
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(device), *head, *pointers, *tail)
    if pointers is args:
        if len(lean.fast) >= MAX_FAST_ENTRIES:
            lean.fast.clear()
        lean.fast[fast] = entry
    return entry.kernel


def _device() -> int:
    """The current CUDA device (Triton launches on it; :func:`torch.cuda.current_device` without the init check:
    the first launch, through Triton, initialised CUDA)."""
    return torch._C._cuda_getDevice()


def _stream(device: int) -> int:
    """The current stream of ``device`` as Triton's launcher takes it (a raw ``CUstream``)."""
    return torch._C._cuda_getCurrentRawStream(device)


def hooks_idle() -> bool:
    """True when Triton's launch hooks do nothing (unset, or empty hook chains): a launch may pass None for them
    and for the launch metadata, which only the hooks read."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is None or (type(enter) is HookChain and not enter.calls))
            and (leave is None or (type(leave) is HookChain and not leave.calls)))


class _Mismatch(Exception):
    """An argument is not of the kind a key function was built for."""


def _mismatch():
    raise _Mismatch


def _hashed(key):
    """``key``, once it has hashed (raises TypeError for an unhashable keyword value)."""
    hash(key)
    return key


# An int's class in Triton's specialization: 1 (made a constant), else its type by range (int32, int64, uint64),
# plus one when divisible by 16; outside uint64 / int64 Triton raises, so no key.
_INT_CLASS = ("(1 if {a} == 1 else (2 if -2147483648 <= {a} <= 2147483647 else "
              "4 if -9223372036854775808 <= {a} <= 9223372036854775807 else "
              "6 if 0 <= {a} <= 18446744073709551615 else _mismatch()) + (not {a} & 15)) "
              "if type({a}) is int else _mismatch()")


def argument_kind(value) -> str | None:
    """The kind of a positional argument a key function takes apart: ``tensor`` (anything with ``data_ptr`` and
    ``dtype``, as Triton treats it), ``int``, ``bool``, ``float``, ``none``; None for any other (no key)."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "tensor"
    for kind, t in (("bool", bool), ("int", int), ("float", float)):
        if type(value) is t:
            return kind
    return "none" if value is None else None


def _key_expression(kind: str, a: str) -> str:
    return {
        "tensor": f"{a}.dtype, not {a}.data_ptr() & 15",
        "int": _INT_CLASS.format(a=a),
        "bool": f"'u1' if type({a}) is bool else _mismatch()",
        "float": f"'fp32' if type({a}) is float else _mismatch()",
        "none": f"None if {a} is None else _mismatch()",
        "constexpr": f"{a}, type({a})",
    }[kind]



def _fast_expression(kind: str, a: str, p: str) -> str:
    """A positional argument's part of the fast key: an int by value; a tensor (address ``p``) as in the key, plus
    whether it is a CUDA tensor (its address is passed to the launcher unchecked). The fast key starts with the
    layout's kinds, so that a bool and an int of equal value in two layouts never share one."""
    return {
        "tensor": f"{a}.dtype, {a}.is_cuda, not {p} & 15",
        "int": f"{a} if type({a}) is int else _mismatch()",
        "bool": f"{a} if type({a}) is bool else _mismatch()",
    }.get(kind) or _key_expression(kind, a)

class LeanKernel:
    """The compiled launches of one ``@triton.jit`` function by key and by fast key (module docstring), and the
    key functions of the argument layouts it was launched with; :func:`launch` looks them up."""

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        self.entries: dict = {}  # key -> _Entry
        self.fast: dict = {}  # fast key -> _Entry (the same entries)
        self.layouts: list = []  # (fast key function, key function) per argument layout
        self.seen_globals: dict = {}  # used global's key -> the object found equal to its compile-time value

    def globals_changed(self) -> bool:
        """Triton's check before each launch: a global the kernel read at compile time has another value now
        (Triton then raises; so does the call that takes its path). Triton keeps deep copies of the values, so an
        equality test (a constexpr's ``!=`` builds objects: 10-13 us a launch for the top-k kernels on the H200
        host) runs once per object a global is bound to; after that the same object passes on identity."""
        for key, (value, scope) in self.fn.used_global_vals.items():
            now = scope.get(key[0], _Mismatch)
            if now is self.seen_globals.get(key):
                continue
            if now != value:
                return True
            self.seen_globals[key] = now
        return False

    def through_triton(self, grid, args: tuple, meta: dict, key, device: int | None):
        """Triton's own launch; then keep the compiled kernel under ``key`` (None: the call's key, from its layout's
        key function, built first for a new layout)."""
        kernel = self.fn[grid](*args, **meta)
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return kernel
        if key is None:
            key = self.key(args, meta, torch.cuda.current_device() if device is None else device)
        tail = self.tail(args, meta)
        if key is not None and tail is not None:
            if len(self.entries) >= MAX_ENTRIES:
                self.entries.clear()
            self.entries[key] = _Entry(kernel, tail)
        return kernel

    def key(self, args: tuple, meta: dict, device: int):
        """The call's key from the first layout's key function that takes it, else from a new layout's (at most
        ``MAX_LAYOUTS``); None when none takes it."""
        for _, key_of in self.layouts:
            try:
                return _hashed(key_of(args, meta, device))
            except Exception:
                continue
        functions = self.layout_functions(args, meta) if len(self.layouts) < MAX_LAYOUTS else None
        if functions is None:
            return None
        try:
            key = _hashed(functions[1](args, meta, device))
        except Exception:
            return None
        self.layouts.append(functions)
        return key

    def tail(self, args: tuple, meta: dict) -> tuple | None:
        """The arguments after the positional ones, in signature order (keyword values, else the defaults), as
        Triton's binder passes them to the launcher; None when the call cannot be kept (a keyword value a key
        cannot pin down: a tensor, a float, a list...)."""
        if any(not isinstance(value, KEY_SAFE) for value in meta.values()):
            return None
        if any(not isinstance(a, KEY_SAFE) for a, p in zip(args, self.fn.params) if p.is_constexpr):
            return None
        tail = []
        for p in self.fn.params[len(args):]:
            if p.name in meta:
                tail.append(meta[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
        return tuple(tail)

    def layout_functions(self, args: tuple, meta: dict):
        """Two functions ``(args, meta, device) -> ...`` for calls with the layout of ``args`` (the kind of each
        positional argument, their number), each raising on a call of another layout: the fast key with the
        arguments to launch with (every tensor replaced by its address), and the key. None when an argument has no
        kind (:func:`argument_kind`) or there are more arguments than parameters."""
        params = self.fn.params
        if len(args) > len(params):
            return None
        kinds = []
        for value, p in zip(args, params):
            kinds.append("constexpr" if p.is_constexpr else argument_kind(value))
            if kinds[-1] is None:
                return None
        names = "".join(f"a{i}, " for i in range(len(args)))
        common = ("device, {n}, knobs.runtime.debug, knobs.compilation.instrumentation_mode, {parts}"
                  "*meta, *meta.values(), *map(type, meta.values())")
        key_parts = "".join(f"{_key_expression(kind, f'a{i}')}, " for i, kind in enumerate(kinds))
        fast_parts = "".join(f"{_fast_expression(kind, f'a{i}', f'p{i}')}, " for i, kind in enumerate(kinds))
        addresses = "".join(f"    p{i} = a{i}.data_ptr()\n" for i, kind in enumerate(kinds) if kind == "tensor")
        launched = "".join(f"p{i}, " if kind == "tensor" else f"a{i}, " for i, kind in enumerate(kinds))
        source = (f"def key(args, meta, device):\n"
                  f"    ({names}) = args\n"
                  f"    return ({common.format(n=len(args), parts=key_parts)})\n"
                  f"def fast(args, meta, device):\n"
                  f"    ({names}) = args\n"
                  f"{addresses}"
                  f"    return ({' '.join(kinds)!r}, {common.format(n=len(args), parts=fast_parts)}), ({launched})\n")
        scope = {"knobs": knobs, "_mismatch": _mismatch}
        exec(source, scope)
        return scope["fast"], scope["key"]


class _Entry(tuple):
    """``(run, head, tail)``: the launcher to call as ``run(gx, gy, gz, stream, *head, *args, *tail)``, and the
    compiled kernel (``.kernel``). ``run`` is the compiled kernel's ``run``, or, when that is Triton's CUDA
    launcher and the kernel needs no scratch memory, the C function it calls with the same arguments."""

    def __new__(cls, kernel, tail: tuple):
        run = kernel.run  # (loads the module on first use)
        function, packed = kernel.function, kernel.packed_metadata
        if (getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
                and callable(getattr(run, "launch", None))):
            # CudaLauncher.__call__ adds (cooperative grid, PDL, scratch buffers: None without scratch)
            entry = super().__new__(cls, (run.launch, (function, run.launch_cooperative_grid, run.launch_pdl, None,
                                                       None, packed, None, None, None), tail))
        else:
            entry = super().__new__(cls, (run, (function, packed, None, None, None), tail))
        entry.kernel = kernel
        return entry
