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
Triton itself would launch; anything else (an argument of another kind, a callable grid, a launch hook or
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
    if not lean.key_functions:  # the first call (CUDA may be uninitialised: _device does not initialise it)
        return lean.through_triton(grid, args, meta, None, None)
    device = _device()
    key = None
    for key_of in lean.key_functions:  # (the hit path is inline: one Python frame less per launch)
        try:
            key = key_of(args, meta, device)
            break
        except Exception:  # another layout (or a value that cannot be keyed): the next one, or none
            key = None
    try:
        entry = lean.entries.get(key) if key is not None else None
    except TypeError:  # an unhashable keyword value
        entry = key = None
    if entry is None or type(grid) is not tuple or kernel.pre_run_hooks or not hooks_idle() or lean.globals_changed():
        return lean.through_triton(grid, args, meta, key, device)
    n = len(grid)
    run, head, tail = entry
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(device), *head, *args, *tail)
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


class LeanKernel:
    """The compiled launches of one ``@triton.jit`` function by key (module docstring), and the key functions of
    the argument layouts it was launched with; :func:`launch` looks them up."""

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        self.entries: dict = {}
        self.key_functions: list = []

    def globals_changed(self) -> bool:
        """Triton's check before each launch: a global the kernel read at compile time has another value now
        (Triton then raises; so does the call that takes its path)."""
        for (name, _), (value, scope) in self.fn.used_global_vals.items():
            if scope.get(name, _Mismatch) != value:
                return True
        return False

    def through_triton(self, grid, args: tuple, meta: dict, key, device: int):
        """Triton's own launch; then keep the compiled kernel under ``key`` (built first, for a new layout)."""
        kernel = self.fn[grid](*args, **meta)
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return kernel
        if key is None and len(self.key_functions) < MAX_LAYOUTS:
            key_of = self.key_function(args, meta)
            if key_of is not None:
                device = torch.cuda.current_device() if device is None else device
                self.key_functions.append(key_of)
                try:
                    key = key_of(args, meta, device)
                    hash(key)
                except Exception:
                    key = None
        tail = self.tail(args, meta)
        if key is not None and tail is not None:
            if len(self.entries) >= MAX_ENTRIES:
                self.entries.clear()
            self.entries[key] = _Entry(kernel, tail)
        return kernel

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

    def key_function(self, args: tuple, meta: dict):
        """A function ``(args, meta, device) -> key`` for calls with the layout of ``args`` (the kind of each
        positional argument, their number); it raises on a call of another layout. None when an argument has no
        kind (:func:`argument_kind`) or there are more arguments than parameters."""
        params = self.fn.params
        if len(args) > len(params):
            return None
        parts = []
        for i, (value, p) in enumerate(zip(args, params)):
            kind = "constexpr" if p.is_constexpr else argument_kind(value)
            if kind is None:
                return None
            parts.append(_key_expression(kind, f"a{i}"))
        names = "".join(f"a{i}, " for i in range(len(args)))
        source = (f"def key(args, meta, device):\n"
                  f"    ({names}) = args\n"
                  f"    return (device, {len(args)}, knobs.runtime.debug, knobs.compilation.instrumentation_mode, "
                  f"{''.join(f'{part}, ' for part in parts)}"
                  f"*meta, *meta.values(), *map(type, meta.values()))\n")
        scope = {"knobs": knobs, "_mismatch": _mismatch}
        exec(source, scope)
        return scope["key"]


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
