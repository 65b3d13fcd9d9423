"""Triton 3.6's CUDA launcher as the reference of dsa_triton's own (``dsa_triton/launcher.c``), without a GPU.

- :func:`triton_parameters` / :func:`reference_pack`: the kernel parameters Triton's launcher passes for a signature,
  read from the C source its ``make_launcher`` generates (each argument's ``PyArg_ParseTuple`` format character, the
  C type it is stored in, its float pack function, the ``params[]`` list), and packed with ``struct`` as that
  conversion and storage pack them.
"""
from __future__ import annotations

import ctypes
import functools
import random
import re
import struct
from types import SimpleNamespace

# Scalar and pointer signature types (Triton's ty_to_cpp table, pointers, constexpr) a signature may hold
TYPES = ["*fp32", "*bf16", "*i8", "i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64", "fp16", "bf16",
         "fp32", "f32", "fp64", "constexpr"]
# PyArg_ParseTuple's integer formats: (lowest, highest) accepted (else OverflowError), or the mask of the bits kept
RANGES = {"b": (0, 255), "h": (-2**15, 2**15 - 1), "i": (-2**31, 2**31 - 1), "L": (-2**63, 2**63 - 1)}
MASKS = {"B": 0xFF, "H": 0xFFFF, "I": 0xFFFFFFFF, "K": 2**64 - 1}
# The C type a kernel parameter is stored in (Triton's generated launcher's declaration) -> its struct format (int8_t:
# the "b" conversion gives 0..255)
STORAGE = {"int8_t": "<B", "int16_t": "<h", "int32_t": "<i", "int64_t": "<q", "uint8_t": "<B", "uint16_t": "<H",
           "uint32_t": "<I", "uint64_t": "<Q", "CUdeviceptr": "<Q"}


def triton_parameters(signature: dict) -> list[tuple[str, str | None, str | None]]:
    """Per signature entry of Triton's generated launcher: its format character, the C type of the kernel parameter
    it becomes (None: not passed) and its float pack function (None: not a float)."""
    from triton.backends.nvidia.driver import make_launcher

    src = make_launcher({}, signature, None)
    formats = re.search(r'PyArg_ParseTuple\(args, "iiiKKppOOOOOO([^"]*)"', src).group(1)
    declared = re.search(r"CUdeviceptr profile_scratch, ([^)]*)\)", src)
    types = dict(reversed(d.rsplit(" ", 1)) for d in declared.group(1).split(", ")) if declared else {}
    params = re.search(r"void \*params\[\] = \{ ([^}]*) \};", src).group(1).split(", ")
    assert params[-2:] == ["&global_scratch", "&profile_scratch"]
    passed = [p[1:] for p in params[:-2]]
    assert passed == sorted(passed, key=lambda a: int(a[3:])) and len(formats) == len(signature)
    packs = dict(re.findall(r"_arg(\d+)_storage = (pack_\w+)\(", src))
    return [(formats[i], types.get(f"arg{i}") if f"arg{i}" in passed else None, packs.get(str(i)))
            for i in range(len(signature))]


def convert(fmt: str, storage: str, pack: str | None, value) -> bytes:
    """The bytes of one argument's kernel parameter as Triton's launcher converts it (format character ``fmt``,
    float pack function ``pack``) and stores it (C type ``storage``); raises OverflowError where that conversion
    does."""
    if pack is not None:  # "d", then the pack function into the float's storage
        d = float(value)
        if pack == "pack_fp16":
            return struct.pack("<e", d)  # (PyFloat_Pack2, as Triton's)
        if pack == "pack_fp64":
            return struct.pack("<d", d)
        single = bytes(ctypes.c_float(d))  # (the C cast: out of range is infinite)
        return single if pack == "pack_fp32" else single[2:]  # bf16: the top half
    if fmt == "O":  # a pointer: an address, or None for 0
        value = 0 if value is None else value
        if not 0 <= value < 2**64:
            raise OverflowError("a pointer out of range")
    elif fmt in RANGES:
        low, high = RANGES[fmt]
        if not low <= int(value) <= high:
            raise OverflowError(f"{value} out of {fmt}'s range")
        value = int(value)
    else:
        value = int(value) & MASKS[fmt]
    return struct.pack(STORAGE[storage], value)


def reference_pack(signature: dict, args: tuple) -> bytes:
    """The kernel parameters Triton's launcher passes for ``args``, each one's bytes in order, the two scratch
    pointers (0) last; raises OverflowError where Triton's raises."""
    out = b""
    for (fmt, storage, pack), value in zip(triton_parameters(signature), args, strict=True):
        if storage is not None:
            packed = convert(fmt, storage, pack, value)
            assert len(packed) == struct.calcsize(STORAGE[storage]), (storage, fmt)
            out += packed
    return out + bytes(16)


@functools.cache
def format_of(ty: str) -> str:
    """The format character of a ``ty`` entry in Triton's launcher."""
    return triton_parameters({"x": ty})[0][0]


def random_signature(r: random.Random, n: int) -> dict:
    return {f"a{i}": r.choice(TYPES) for i in range(n)}


def random_value(r: random.Random, ty: str, out_of_range: bool = False):
    """A value Triton's launcher takes for a ``ty`` entry (edge values often); an int past the entry's range too
    when ``out_of_range``."""
    if ty == "constexpr":
        return r.choice([None, 16, 1, "s", 0.5])
    if ty[0] == "*":
        return r.choice([None, 0, 2**64 - 16, r.randrange(2**48) * 16, r.randrange(2**64)]
                        + ([-16, 2**64] if out_of_range else []))
    if ty[0] in "fb":  # floats (an int or a bool is taken too); past fp16's range, PyFloat_Pack2 raises
        wide = [3.4e38, 3.5e38, 1e300, r.uniform(-1e6, 1e6)]
        return r.choice([0.0, -0.0, 1.5, -2.75, 1e-45, 65504.0, 5e-324, float("inf"), -float("inf"), float("nan"), 3,
                         True, r.uniform(-1, 1)] + (wide if ty != "fp16" or out_of_range else []))
    bits = int(ty[1:])  # (an int of the entry's width, or past it)
    edges = [0, 1, -1, 2**(bits - 1) - 1, -2**(bits - 1), 2**bits - 1, 2**bits, 2**31 - 1, -2**31, 2**63 - 1,
             -2**63, 2**64 - 1, 255, 256, True, False]
    value = r.choice(edges + [r.randrange(-2**(bits + 1), 2**(bits + 1))])
    if not out_of_range:
        low, high = RANGES.get(format_of(ty), (-2**64 + 1, 2**64 - 1))
        value = min(max(value, low), high)
    return value


def metadata_of(**changes) -> SimpleNamespace:
    """A compiled kernel's metadata, as far as Triton's CudaLauncher reads it: no scratch, one CTA, no cooperative
    grid, no PDL, no tensor descriptor, unless ``changes`` says otherwise."""
    fields = dict(num_ctas=1, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                  profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=None)
    return SimpleNamespace(**{**fields, **changes})


def unbuilt_cuda_launcher(metadata: SimpleNamespace, launch=None):
    """Triton's CudaLauncher with the attributes its __init__ sets from ``metadata``, its C ``launch`` function
    ``launch`` (not built: no libcuda needed)."""
    from triton.backends.nvidia.driver import CudaLauncher

    run = object.__new__(CudaLauncher)
    run.num_ctas, run.launch = metadata.num_ctas, launch
    for name in ("global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align",
                 "launch_cooperative_grid", "launch_pdl"):
        setattr(run, name, getattr(metadata, name))
    return run


def kernel_of(signature: dict, metadata: SimpleNamespace, num_warps: int = 4, shared: int = 0,
              function: int = 0xF000, run=None):
    """A stand-in CompiledKernel of ``signature``: its ``run`` is Triton's real CudaLauncher (built against the
    libcuda found) unless ``run`` is given."""
    from triton.backends.nvidia.driver import CudaLauncher

    src = SimpleNamespace(signature=signature, constants={}, fn=None)
    return SimpleNamespace(run=run or CudaLauncher(src, metadata), src=src, metadata=metadata, function=function,
                           packed_metadata=(num_warps, metadata.num_ctas, shared))
