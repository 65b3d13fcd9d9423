"""Lean eager launches: a repeated launch calls the compiled kernel directly, past Triton's Python launcher.

An op launches with ``launch_with(kernel, grid, meta, *args)`` where it would write ``kernel[grid](*args, **meta)``,
``meta`` a dict of keyword arguments its plan keeps (:mod:`.plans`), so that a call spends nothing on packing them.
Triton's own launch (``JITFunction.run``) rebuilds on every call what a repeated call already knew: it binds the
arguments, specializes each one, formats the options into a string key, looks the compiled kernel up, builds the
launch metadata and calls the (empty) launch hooks. Here the first call of each specialization goes through
Triton unchanged (it compiles when needed and launches), and its compiled kernel is kept under a key of
everything Triton specializes on; a later call with an equal key launches that kernel with the current stream.

The key (:meth:`LeanKernel.layout_functions` builds the functions of each argument layout: the kind of each
positional argument and the keyword names, as Triton's binder is built per signature) holds, per positional
argument: a tensor's dtype and whether its address is a multiple of 16; an int's class (equal to 1; else int32,
int64 or uint64 range, each split by divisibility by 16); the kind of a bool, float or None; a constexpr's value
and type. Then every keyword argument's value and type (constexprs and options such as ``num_warps``), the current
device and Triton's two global option knobs (``debug`` and the instrumentation mode). That is at least as fine as
Triton's own cache key, so an equal key launches the kernel Triton itself would launch. In front of it sits a
cheaper key of the same call, the fast key: ints by value instead of by class, each tensor's dtype, the addresses'
residues modulo 16 (one 0 when all are aligned) and a token of the keyword values and types (the last call's while
each value is the same object, else that of an equal set; never one of another set). The layout's hit function
(:func:`launch_with` calls the first layout's; each hands a call of another layout to the next) builds it, looks it up
and launches a hit itself, with the tensors' addresses as ints (the launcher then skips its per-pointer
``data_ptr`` call and driver query); a tensor not on a CUDA device (``FAST_DEVICE``) is of no layout there, so its
call takes Triton's path. A fast miss that hits the class key launches once with the tensors themselves, whose
pointers the launcher checks, before its fast key is kept. Anything else (an argument of another kind, a callable
grid, a launch hook or pre-run hook set, a global the kernel reads changed since it compiled, a keyword value other
than an int, bool, str, None or ``tl.dtype``: floats, say, where ``0.0 == -0.0`` but Triton compiles them apart)
takes Triton's path. A key that differs only where Triton's does not costs one more pass through Triton's path,
never a wrong kernel.

That Python hit function is the reference. In front of it, each layout's hit is one compiled call where it can be
built (:mod:`dsa_triton.launch_hit`: C++ on torch's own tensor structure and CPython's API, built at first use and
cached): it reads the arguments, builds the same fast key as bytes (the layout's number, the device, each tensor's
dtype and address modulo 16, the ints and bools by value, the keyword token), looks it up in the same table, runs
the same checks (grid, launch and pre-run hooks, globals) and calls the entry's launcher with the same arguments, or
the miss path with its key. Any call it cannot read as the Python function would (a tensor subclass, whose
attributes may be its own; a torch function mode; a tensor of another device or without storage; an int past
int64; a grid not a tuple of 1 to 3 sizes; Triton's debug knob not a bool or an instrumentation mode set) goes to
the Python function unchanged, as does every call of a layout with a positional constexpr and every call where the
module could not be built. The two keep different keys (bytes against tuples) of the same entries: a call keyed by
one then missed by the other launches once more with the tensors, never another kernel. A tensor at the address a
tensor had at its position in the layout's last call (a persistent buffer, a recycled allocation) reuses that
call's int. The host cost of a hit through either form: ``python -m dsa_triton.bench.launchprof`` (measured:
results/journal/launch.md).

A hit's launcher is the lean path's own (:mod:`dsa_triton.launcher`: C, built at first use as Triton builds its
launchers) where it serves the compiled kernel: from a descriptor of the kernel made once (each signature entry's
type code, the block size, the dynamic shared memory, the PDL attribute) it packs the kernel parameters
Triton 3.6's CUDA launcher passes for the same arguments and calls ``cuLaunchKernelEx`` as that launcher does,
without its ``PyArg_ParseTuple`` of every argument (and is not handed the keyword arguments when they are all
constexprs, which it would skip). For any other kernel (scratch memory, clusters, a cooperative grid, a tensor
descriptor, another Triton release or backend), or with ``DSA_OWN_LAUNCHER=0``, a hit calls the C function of
Triton's launcher with the same arguments. A miss launches through Triton's launcher.

On a hit no device memory is allocated or read and no file is touched: the launch is capturable in a
CUDA graph once each specialization has run once eagerly. In the Triton interpreter (``TRITON_INTERPRET=1``)
kernels are not :class:`~triton.runtime.jit.JITFunction` objects and ``launch`` is ``kernel[grid](...)``, as is
any other launchable object (an autotuner, a test's stub).

``DSA_LEAN_LAUNCH=0`` in the environment (or ``ENABLED = False`` here) sends every launch through Triton's path.
The host cost per launch, Triton's path against this one (its hits through either launcher) with the kernels' own
launches: ``scripts/launch_cost.py``.
"""
from __future__ import annotations

import itertools
import os
import sys
from typing import NamedTuple

import torch
import triton.language as tl
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

from . import launcher
from .launch_hit import compiled_hit

ENABLED = os.environ.get("DSA_LEAN_LAUNCH", "1") != "0"  # off (DSA_LEAN_LAUNCH=0): every launch is Triton's
MAX_ENTRIES = 256  # compiled launches kept per kernel; past this the cache starts over (misses take Triton's path)
MAX_FAST_ENTRIES = 1024  # fast keys (ints by value) per kernel, keyword-set tokens per layout; past this, start over
MAX_LAYOUTS = 4  # argument layouts (kinds of the positional arguments, keyword names) with functions, per kernel
FAST_DEVICE = "cuda"  # the device type of the tensors a hit passes by address (Triton's CUDA launcher's; tests: cpu)
KEY_SAFE = (int, bool, str, type(None), tl.dtype)  # keyword values whose equality (with their type) fixes str()
_ATTRIBUTE = "_dsa_lean"
_TOKENS = itertools.count()  # the keyword-set tokens (_meta_token): none is handed out twice
# The current CUDA device (torch.cuda.current_device() without its init check: the first launch, through Triton,
# initialised CUDA) and a device's current stream as Triton's launcher takes it (a raw CUstream); None without CUDA
_device = getattr(torch._C, "_cuda_getDevice", None)
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def launch_with(kernel, grid, meta: dict, *args):
    """``kernel[grid](*args, **meta)``, through the kernel's :class:`LeanKernel` when it is a compiled-mode
    ``@triton.jit`` function. ``meta``: the keyword arguments (constexprs and options), a dict the caller keeps and
    nobody modifies; pass every argument that is not a constexpr positionally. Returns what Triton's launch returns
    (the compiled kernel)."""
    lean = kernel.__dict__.get(_ATTRIBUTE) if ENABLED else None
    if lean is None and (lean := _lean_kernel(kernel)) is None:
        return kernel[grid](*args, **meta)
    return lean.call(grid, args, meta)


def _lean_kernel(kernel) -> LeanKernel | None:
    """A new :class:`LeanKernel` for a compiled-mode ``@triton.jit`` function, kept on it; None for any other
    launchable (an interpreted kernel, an autotuner, a test's stub) or with the lean path off."""
    if not ENABLED or (type(kernel) is not JITFunction and not isinstance(kernel, JITFunction)):
        return None
    lean = LeanKernel(kernel)
    setattr(kernel, _ATTRIBUTE, lean)
    return lean


def hooks_idle() -> bool:
    """True when Triton's launch hooks do nothing (unset, or empty hook chains): a launch may pass None for them
    and for the launch metadata, which only the hooks read."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is None or (type(enter) is HookChain and not enter.calls))
            and (leave is None or (type(leave) is HookChain and not leave.calls)))


class _Mismatch(Exception):
    """An argument is not of the kind a layout's functions were built for."""


def _mismatch():
    raise _Mismatch


def _meta_token(tokens: dict, part: tuple) -> int:
    """The token of keyword values and types ``part`` in a layout's ``tokens``: one per part, never another's (a
    token is not handed out twice, even once ``tokens`` has started over)."""
    token = tokens.get(part)
    if token is None:
        if len(tokens) >= MAX_FAST_ENTRIES:
            tokens.clear()
        token = tokens.setdefault(part, next(_TOKENS))
    return token


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


def _tensor_lines(tensors: list[int]) -> list[str]:
    """The lines of a hit function that read the tensors ``a{i}`` (``i`` in ``tensors``): ``tensor_key``, each one's
    dtype, then 0 when every address is a multiple of 16, else the tuple of each address modulo 16; ``p{i}``, each
    one's address. A tensor not on a ``FAST_DEVICE`` device raises."""
    addresses = [f"p{i}" for i in tensors]
    return [*(f"p{i} = a{i}.data_ptr() if a{i}.is_{FAST_DEVICE} else _mismatch()" for i in tensors),
            f"tensor_key = ({''.join(f'a{i}.dtype, ' for i in tensors)}"
            f"({''.join(f'{p} & 15, ' for p in addresses)}) if ({' | '.join(addresses)}) & 15 else 0)"]


def _key_expression(kind: str, a: str) -> str:
    return {
        "tensor": f"{a}.dtype, not {a}.data_ptr() & 15",
        "int": _INT_CLASS.format(a=a),
        "bool": f"'u1' if type({a}) is bool else _mismatch()",
        "float": f"'fp32' if type({a}) is float else _mismatch()",
        "none": f"None if {a} is None else _mismatch()",
        "constexpr": f"{a}, type({a})",
    }[kind]


# The functions of a layout, as LeanKernel.layout_functions fills them in. The fast key starts with the layout,
# so that layouts share one table; the hit path reads Triton's launch hooks as hooks_idle does.
_SOURCE = """\
def key_of(args, meta, device):
    ({args}) = args
    if meta.keys() != NAMES:
        _mismatch()
    return (device, {n}, knobs.runtime.debug, knobs.compilation.instrumentation_mode, {key_parts}
            *meta, *meta.values(), *map(type, meta.values()))

def fast_key(args, meta, device):
    global LAST
{body4}    return ({fast_key}), ({launched})

def hit(grid, args, meta):
    global LAST
    try:
{body8}        device = lean_module._device()
        key = ({fast_key})
        entry = fast.get(key)
    except Exception:  # another layout, or a value that cannot be keyed
        key = None
    if key is None:
        return NEXT(grid, args, meta)
    if (entry is None or type(grid) is not tuple or fn.pre_run_hooks
            or (h := runtime.launch_enter_hook) is not None and (type(h) is not HookChain or h.calls)
            or (h := runtime.launch_exit_hook) is not None and (type(h) is not HookChain or h.calls)
            or lean.globals_changed()):
        return lean.miss(grid, args, meta, key, device, key_of)
    run, head, tail, kernel, _ = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, lean_module._stream(device), *head, {launched}
        *tail)
    return kernel
"""


class _Layout(NamedTuple):
    """The functions of one argument layout (module docstring), each raising on a call of another layout."""
    hit: object  # (grid, args, meta) -> the compiled kernel: launches a hit, else the miss path or the next layout's
    key: object  # (args, meta, device) -> the key
    fast_key: object  # (args, meta, device) -> (the fast key, the arguments to launch with: addresses for tensors)
    scope: dict  # the Python functions' globals (NEXT: the next layout's hit)


class LeanKernel:
    """The compiled launches of one ``@triton.jit`` function by key and by fast key (module docstring), and the
    functions of the argument layouts it was launched with; :func:`launch_with` calls :attr:`call`."""

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        self.entries: dict = {}  # key -> entry (_entry)
        self.fast: dict = {}  # fast key -> entry (the same entries)
        self.layouts: list[_Layout] = []
        self.call = self.unmatched  # the first layout's hit function (each hands a call of another layout on)
        self.watched: tuple = ()  # (scope, name, object found equal to its compile-time value) per used global
        self.watched_of = None  # the used_global_vals those are of

    def globals_changed(self) -> bool:
        """Triton's check before each launch: a global the kernel read at compile time has another value now
        (Triton then raises; so does the call that takes its path). Triton keeps deep copies of the values, so an
        equality test (a constexpr's ``!=`` builds objects, microseconds a launch for kernels that read several
        globals) runs only when a global is bound to another object than the one last found equal; else identity."""
        used = self.fn.used_global_vals
        if used is self.watched_of and len(used) == len(self.watched):
            for scope, name, seen in self.watched:
                if scope.get(name, _Mismatch) is not seen:
                    break
            else:
                return False
        watched = []
        for (name, _), (value, scope) in used.items():
            now = scope.get(name, _Mismatch)
            if now != value:
                return True
            watched.append((scope, name, now))
        self.watched, self.watched_of = tuple(watched), used
        return False

    def unmatched(self, grid, args: tuple, meta: dict):
        """A call no layout's functions take: Triton's launch."""
        return self.through_triton(grid, args, meta, None)

    def through_triton(self, grid, args: tuple, meta: dict, key):
        """Triton's own launch; then keep the compiled kernel under ``key`` (None: the call's key, from its layout's
        key function, built first for a new layout)."""
        kernel = self.fn[grid](*args, **meta)
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return kernel
        if key is None:
            key = self.key(args, meta, torch.cuda.current_device())
        tail = self.tail(args, meta)
        if key is not None and tail is not None:
            if len(self.entries) >= MAX_ENTRIES:
                self.entries.clear()
            self.entries[key] = _entry(kernel, tail)
        return kernel

    def miss(self, grid, args: tuple, meta: dict, fast_key: tuple, device: int, key_of):
        """A call whose fast key has no entry, or that failed a check of the hit path: Triton's launch, unless its
        key (``key_of``: its layout's) has an entry, which then launches with the tensors themselves (the launcher
        checks each pointer) before the fast key is kept."""
        if type(grid) is not tuple or self.fn.pre_run_hooks or not hooks_idle() or self.globals_changed():
            return self.through_triton(grid, args, meta, None)
        try:
            key = key_of(args, meta, device)
            entry = self.entries.get(key)
        except Exception:  # a value the key cannot take (an int past uint64: Triton raises) or cannot hash
            key = entry = None
        if entry is None:
            return self.through_triton(grid, args, meta, key)
        _, _, _, kernel, (run, head, tail) = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(device), *head, *args, *tail)
        if len(self.fast) >= MAX_FAST_ENTRIES:
            self.fast.clear()
        self.fast[fast_key] = entry
        return kernel

    def key(self, args: tuple, meta: dict, device: int):
        """The call's key from the first layout's key function that takes it, else from a new layout's (at most
        ``MAX_LAYOUTS``; its hit function joins the chain :attr:`call` starts); None when none takes it."""
        for layout in self.layouts:
            try:
                return _hashed(layout.key(args, meta, device))
            except Exception:
                continue
        layout = self.layout_functions(args, meta) if len(self.layouts) < MAX_LAYOUTS else None
        if layout is None:
            return None
        try:
            key = _hashed(layout.key(args, meta, device))
        except Exception:
            return None
        self.layouts.append(layout)
        for this, following in zip(self.layouts, self.layouts[1:] + [None]):
            this.scope["NEXT"] = following.hit if following else self.unmatched
        self.call = self.layouts[0].hit
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

    def layout_functions(self, args: tuple, meta: dict) -> _Layout | None:
        """The functions for calls with the layout of ``args`` and ``meta`` (the kind of each positional argument,
        the keyword names); None when an argument has no kind (:func:`argument_kind`) or there are more arguments
        than parameters."""
        params = self.fn.params
        if len(args) > len(params):
            return None
        kinds = []
        for value, p in zip(args, params):
            kinds.append("constexpr" if p.is_constexpr else argument_kind(value))
            if kinds[-1] is None:
                return None
        tensors = [i for i, kind in enumerate(kinds) if kind == "tensor"]
        checks = [f"len(meta) != {len(meta)}"]
        checks += [f"type(a{i}) is not float" for i, kind in enumerate(kinds) if kind == "float"]
        checks += [f"a{i} is not None" for i, kind in enumerate(kinds) if kind == "none"]
        body = [f"({''.join(f'a{i}, ' for i in range(len(args)))}) = args",
                f"if {' or '.join(checks)}:", "    _mismatch()", *(_tensor_lines(tensors) if tensors else []),
                "runtime = knobs.runtime"]
        if meta:  # keyword values and types: a token, the last call's while every value is the same object
            js = range(len(meta))
            body += [f"m{j} = meta[{name!r}]" for j, name in enumerate(meta)]
            body += [f"({''.join(f'v{j}, ' for j in js)}token) = LAST",
                     f"if not ({' and '.join(f'm{j} is v{j}' for j in js)}):",
                     f"    token = _meta_token(TOKENS, ({''.join(f'm{j}, type(m{j}), ' for j in js)}))",
                     f"    LAST = ({''.join(f'm{j}, ' for j in js)}token)"]
        parts = [repr(" ".join(kinds) + " | " + " ".join(meta)), "device", "runtime.debug",
                 "knobs.compilation.instrumentation_mode", *(["tensor_key"] if tensors else [])]
        for i, kind in enumerate(kinds):
            if kind in ("int", "bool"):
                parts.append(f"a{i} if type(a{i}) is {kind} else _mismatch()")
            elif kind == "constexpr":
                parts.append(f"a{i}, type(a{i})")
        parts += ["token"] if meta else []
        source = _SOURCE.format(
            args="".join(f"a{i}, " for i in range(len(args))), n=len(args),
            key_parts="".join(f"{_key_expression(kind, f'a{i}')}, " for i, kind in enumerate(kinds)),
            body4="".join(f"    {line}\n" for line in body), body8="".join(f"        {line}\n" for line in body),
            fast_key=", ".join(parts),
            launched="".join(f"p{i}, " if kind == "tensor" else f"a{i}, " for i, kind in enumerate(kinds)))
        scope = {"knobs": knobs, "HookChain": HookChain, "_mismatch": _mismatch, "NAMES": set(meta),
                 "lean_module": sys.modules[__name__], "lean": self, "fn": self.fn, "fast": self.fast,
                 "NEXT": self.unmatched, "TOKENS": {}, "_meta_token": _meta_token,
                 "LAST": (_Mismatch,) * len(meta) + (None,), "LAYOUT": next(_TOKENS)}
        exec(source, scope)
        return _Layout(_compiled(scope, kinds, tuple(meta)) or scope["hit"], scope["key_of"], scope["fast_key"], scope)


_KIND_LETTERS = {"tensor": "t", "int": "i", "bool": "b", "float": "f", "none": "n"}


def _compiled(scope: dict, kinds: list[str], names: tuple):
    """The layout's compiled hit (:mod:`dsa_triton.launch_hit`), which hands each call it does not take to the
    Python one (``scope["hit"]``); None where it is not built, for a ``FAST_DEVICE`` it does not know, or for a
    layout with a positional constexpr."""
    module = compiled_hit()
    device_type = getattr(module, FAST_DEVICE.upper(), None)
    if device_type is None or "constexpr" in kinds:
        return None
    return module.Hit(scope, "".join(_KIND_LETTERS[kind] for kind in kinds).encode(), names, device_type)


def _entry(kernel, tail: tuple) -> tuple:
    """``(run, head, hit_tail, kernel, checked)``: a hit calls ``run(gx, gy, gz, stream, *head, *args,
    *hit_tail)`` with the tensors' addresses; a miss calls Triton's launcher, ``checked`` being ``(run, head, tail)``
    (:func:`_triton_launcher`), the same way with the tensors themselves (that launcher checks each pointer);
    ``kernel``: the compiled kernel. A hit's launcher is the own one (:mod:`dsa_triton.launcher`, given the kernel's
    descriptor; ``hit_tail`` is empty when ``tail`` holds only constexprs) where it serves the kernel, else Triton's
    (then ``hit_tail`` is ``tail``)."""
    checked = (*_triton_launcher(kernel), tail)
    own = launcher.descriptor(kernel, tail) if launcher.ENABLED else None
    if own is None:
        return *checked, kernel, checked
    described, own_tail = own
    return launcher.compiled_launcher().launch, (described,), own_tail, kernel, checked


def _triton_launcher(kernel) -> tuple:
    """``(run, head)``: Triton's launcher of the compiled kernel, called as ``run(gx, gy, gz, stream, *head, *args,
    *tail)``. ``run`` is the kernel's ``run``, or, when that is Triton's CUDA launcher and the kernel needs no scratch
    memory, the C function it calls with the same arguments."""
    run = kernel.run  # (loads the module on first use)
    function, packed = kernel.function, kernel.packed_metadata
    if (getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
            and callable(getattr(run, "launch", None))):
        # CudaLauncher.__call__ adds (cooperative grid, PDL, scratch buffers: None without scratch)
        return run.launch, (function, run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None,
                            None)
    return run, (function, packed, None, None, None)
