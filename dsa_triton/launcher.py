"""The lean path's own launcher of compiled kernels (``launcher.c``), and which kernels it launches.

A hit of :mod:`dsa_triton.launch` (the arguments known, tensors as addresses) need not go through Triton's C
launcher, whose ``PyArg_ParseTuple`` of a format string of every argument, then per-pointer and float conversions,
are a fair part of a launch's host cost (measured: results/journal/launch.md). ``launch()`` here packs the same
kernel parameters from a descriptor made once per compiled kernel (each signature entry's type code, the block
size, dynamic shared memory, the PDL attribute; one per number of entries a hit passes, as a tail of constexprs is
not passed) and calls ``cuLaunchKernelEx`` as Triton's launcher does. The C source is built as
Triton builds its launchers (``compile_module_from_src``: the system C compiler, Triton's ``cuda.h``, the module
cached in Triton's cache directory; libcuda is opened at the first launch, so it builds and packs without a GPU).

:func:`descriptor` decides once per compiled kernel: the launcher serves a kernel of Triton 3.6's CUDA launcher
(whose C source it mirrors) with no global or profile scratch memory, ``num_ctas`` 1, no cooperative grid, and a
signature of scalar and pointer entries (no tensor descriptor, no tuple); any other, or when the module cannot be
built (one warning says why), keeps Triton's launcher. ``DSA_OWN_LAUNCHER=0`` in the environment (or ``ENABLED =
False`` here, before the launches are first kept) keeps Triton's launcher for every kernel.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType

import triton

ENABLED = os.environ.get("DSA_OWN_LAUNCHER", "1") != "0"  # off: hits call Triton's C launcher
TRITON = "3.6"  # the Triton release whose CUDA launcher launcher.c mirrors
NAME = "dsa_launcher"  # the module's name (its PyInit_ function)
SOURCE = Path(__file__).with_name("launcher.c")
_ATTRIBUTE = "_dsa_own_launch"  # on a CompiledKernel: what the own launcher knows of it (_Described)


@functools.cache
def compiled_launcher() -> ModuleType | None:
    """The built module (``describe``, ``launch``, ``pack``, the type codes ``TYPES`` and each code's parameter
    bytes ``SIZES``), or None (a warning says why)."""
    try:
        from triton.backends.nvidia.driver import include_dirs
        from triton.runtime.build import compile_module_from_src

        return compile_module_from_src(src=SOURCE.read_text(), name=NAME, include_dirs=include_dirs)
    except Exception as exc:  # no compiler, a failed build or load: Triton's launcher serves
        warnings.warn(f"dsa_triton.launch: the own launcher is not available ({type(exc).__name__}: {exc}); hits "
                      "call Triton's launcher", RuntimeWarning, stacklevel=2)
        return None


def type_codes(signature: dict, types: dict) -> bytes | None:
    """Each entry's type code of a kernel ``signature`` (Triton's: parameter name -> type, constexprs as
    ``"constexpr"``), by Triton's own names for its conversion (``types``: the module's ``TYPES``): ``constexpr``;
    a float by its pack function (``FLOAT_PACK_FUNCTION``), anything else by its C type (``ty_to_cpp``: pointers are
    ``CUdeviceptr``). None when an entry has none (a tuple, a tensor descriptor)."""
    from triton.backends.nvidia.driver import FLOAT_PACK_FUNCTION, ty_to_cpp

    codes = []
    for ty in signature.values():
        if not isinstance(ty, str):
            return None
        try:
            name = "constexpr" if ty == "constexpr" else FLOAT_PACK_FUNCTION.get(ty) or ty_to_cpp(ty)
        except KeyError:
            return None
        if name not in types:
            return None
        codes.append(types[name])
    return bytes(codes)


def descriptor(kernel, tail: tuple) -> tuple | None:
    """``(descriptor, tail)``: the own launcher's descriptor of ``kernel`` (a CompiledKernel whose ``run`` is
    loaded) for calls whose last arguments are ``tail``, and what of ``tail`` to pass it: nothing when each of its
    entries is a constexpr (the descriptor then covers the entries before it: a hit builds no tuple of them), else
    all of it. None where Triton's launcher must serve the kernel (module docstring): decided once per kernel, kept on
    it with each descriptor made."""
    known = kernel.__dict__.get(_ATTRIBUTE)
    if known is None:
        known = _Described(kernel)
        setattr(kernel, _ATTRIBUTE, known)
    codes = known.codes
    if codes is None or len(tail) > len(codes):
        return None
    kept = len(codes) - len(tail)
    if any(code != known.skip for code in codes[kept:]):
        kept = len(codes)
    made = known.made.get(kept)
    if made is None:
        made = known.made[kept] = compiled_launcher().describe(*known.launch, codes[:kept])
    return made, tail if kept == len(codes) else ()


class _Described:
    """What the own launcher knows of a compiled kernel: ``codes``, each signature entry's type code (None where
    Triton's launcher must serve the kernel), the code of a constexpr (``skip``), ``launch`` (its function handle,
    warps, dynamic shared memory and PDL flag, as ``describe`` takes them), and the descriptors ``made`` by the
    number of entries they cover."""

    def __init__(self, kernel) -> None:
        from triton.backends.nvidia.driver import CudaLauncher

        self.codes, self.made = None, {}
        run = kernel.run
        if (triton.__version__.split(".")[:2] != TRITON.split(".") or type(run) is not CudaLauncher
                or run.global_scratch_size or run.profile_scratch_size or run.launch_cooperative_grid
                or run.num_ctas != 1 or getattr(kernel.metadata, "tensordesc_meta", None)):
            return
        signature = getattr(kernel.src, "signature", None)
        module = compiled_launcher() if isinstance(signature, dict) else None
        if module is None:
            return
        codes = type_codes(signature, module.TYPES)
        if codes is None:
            return
        num_warps, _, shared = kernel.packed_metadata
        self.skip, self.launch = module.TYPES["constexpr"], (kernel.function, num_warps, shared, bool(run.launch_pdl))
        try:  # (the descriptor of every entry; describe refuses more than 512 entries or warps past 32)
            self.made[len(codes)] = module.describe(*self.launch, codes)
        except ValueError:
            return
        self.codes = codes
