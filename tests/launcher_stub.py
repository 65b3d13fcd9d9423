"""Triton 3.6's CUDA launcher as the reference of dsa_triton's own (``dsa_triton/launcher.c``), without a GPU.

- :func:`triton_parameters` / :func:`reference_pack`: the kernel parameters Triton's launcher passes for a signature,
  read from the C source its ``make_launcher`` generates (each argument's ``PyArg_ParseTuple`` format character, the
  C type it is stored in, its float pack function, the ``params[]`` list), and packed with ``struct`` as that
  conversion and storage pack them.
- ``python tests/launcher_stub.py check``: on a stand-in libcuda (``stub_libcuda.c``: each launch recorded, nothing
  run), Triton's real ``CudaLauncher`` (its generated launcher built against the stand-in) and the lean path's
  launcher of the same kernel (``dsa_triton.launch._entry``) launch random arguments, grids, PDL settings, with and
  without a current context, with a failing driver: equal launches (function, grid, block, shared memory, stream,
  attributes, each parameter's bytes), driver calls and errors. Prints one JSON line; ``tests/test_launcher.py``
  runs it in a fresh interpreter (the stand-in takes libcuda.so.1's name there before anything opens the real one).
- ``python tests/launcher_stub.py bench``: host microseconds a launch of each launcher (the stand-in's driver call
  does nothing) for kernels of about 10 and 30 arguments.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

STUB = Path(__file__).with_name("stub_libcuda.c")
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


def build_stub(directory: str) -> str:
    """The stand-in built as ``directory/libcuda.so.1`` (soname libcuda.so.1)."""
    from triton.backends.nvidia.driver import include_dirs

    path = os.path.join(directory, "libcuda.so.1")
    subprocess.run([os.environ.get("CC", "gcc"), "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                    *(f"-I{d}" for d in include_dirs), str(STUB), "-o", path], check=True)
    return path


class Stub:
    """The loaded stand-in (under libcuda.so.1's name, its symbols global)."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        self.lib.stub_record.restype = self.lib.stub_log.restype = ctypes.c_size_t

    def expect(self, sizes: list[int]) -> None:
        self.lib.stub_expect(len(sizes), (ctypes.c_int * max(len(sizes), 1))(*sizes))

    def reset(self, record: bool = True, result: int = 0, context: bool = True) -> None:
        self.lib.stub_reset(int(record), result, int(context))

    def _read(self, fn) -> bytes:
        out = ctypes.c_void_p()
        n = fn(ctypes.byref(out))
        return ctypes.string_at(out, n) if n else b""

    def record(self) -> bytes:
        return self._read(self.lib.stub_record)

    def log(self) -> str:
        return self._read(self.lib.stub_log).decode()


def outcome(stub: Stub, call, result: int, context: bool) -> tuple:
    """``(record, driver calls, error)`` of one launch, the driver's launches returning ``result``; the record empty
    when nothing launched."""
    stub.reset(True, result, context)
    try:
        call()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}" if isinstance(exc, RuntimeError) else type(exc).__name__
    log = stub.log()
    return (stub.record() if "l" in log else b""), log, error


def parameter_sizes(signature: dict) -> list[int]:
    """The bytes of each kernel parameter Triton's launcher passes, the scratch pointers' last."""
    sizes = [struct.calcsize(STORAGE[storage]) for _, storage, _ in triton_parameters(signature) if storage]
    return sizes + [8, 8]


def check(seed: int) -> dict:
    """Random launches through both launchers: the differences found (none expected), the launches compared, and
    the calls both refused (an argument out of range: the same exception; ours before launching, Triton's after,
    for a negative address or an fp16 overflow, in ``refused_after_launch``)."""
    from dsa_triton import launch, launcher

    stub = Stub(os.environ["DSA_STUB_LIBCUDA"])
    r = random.Random(seed)
    ours_like = ["*fp32"] * 4 + ["i32"] * 4 + ["fp32", "i64"] + ["constexpr"] * 6  # (constexprs last, as ours)
    signatures = [random_signature(r, n) for n in (1, 12, 30)] + [{f"a{i}": ty for i, ty in enumerate(TYPES)},
                                                                   {f"a{i}": ty for i, ty in enumerate(ours_like)}]
    differences, launches, refused, refused_after_launch = [], 0, 0, 0
    for s, signature in enumerate(signatures):
        stub.expect(parameter_sizes(signature))
        types = list(signature.values())
        constexprs_last = len(types) - len("".join("c" if ty == "constexpr" else "x" for ty in types).rstrip("c"))
        for pdl in (False, True):
            kernel = kernel_of(signature, metadata_of(launch_pdl=pdl), r.choice([1, 4, 8]),
                               r.choice([0, 1024, 232448]), 0xF000 + s)
            for case in range(40):
                args = tuple(random_value(r, ty, out_of_range=case % 10 == 9) for ty in types)
                # the call's positional arguments and tail (a hit passes no tail of constexprs alone)
                split = len(types) - r.choice([0, constexprs_last, r.randrange(len(types) + 1)])
                run, head, tail, _, _ = launch._entry(kernel, args[split:])
                assert run is launcher.compiled_launcher().launch, "the own launcher does not serve the kernel"
                grid = r.choice([(1, 1, 1), (7, 3, 2), (0, 1, 1), (65535, 1, 1), (2, 0, 3)])
                stream = r.choice([0, 2**40 + 8])
                result = 1 if case % 13 == 12 else 0  # (CUDA_ERROR_INVALID_VALUE)
                context = case % 7 != 3
                ours = outcome(stub, lambda: run(*grid, stream, *head, *args[:split], *tail), result, context)
                theirs = outcome(stub, lambda: kernel.run(*grid, stream, kernel.function, kernel.packed_metadata,
                                                          None, None, None, *args), result, context)
                if ours[2] is not None and ours[2] == theirs[2] and not ours[0]:
                    refused += 1
                    refused_after_launch += bool(theirs[0])
                elif ours != theirs:
                    differences.append({"signature": signature, "args": repr(args), "grid": grid, "pdl": pdl,
                                        "ours": repr(ours), "triton": repr(theirs)})
                launches += bool(ours[0])
    return {"differences": differences[:5], "n_differences": len(differences), "launches": launches,
            "refused": refused, "refused_after_launch": refused_after_launch}


def bench() -> dict:
    """Host microseconds a launch (best of 5 rounds of 20000) of Triton's C launcher given addresses (as a hit calls
    it with the own launcher off), of the own launcher (as a hit calls it: no tail of constexprs), of the own
    launcher's packing alone, for kernels of 10 and 30 arguments (pointers, int32s, a float, then constexprs), the
    driver call the stand-in's (it does nothing)."""
    from dsa_triton import launch, launcher

    stub = Stub(os.environ["DSA_STUB_LIBCUDA"])
    stub.expect([])
    stub.reset(record=False)
    module = launcher.compiled_launcher()
    rows = {}
    for n in (10, 30):
        types = (["*fp32"] * (n // 3) + ["i32"] * (n // 3) + ["fp32"] + ["constexpr"] * n)[:n]
        signature = {f"a{i}": ty for i, ty in enumerate(types)}
        kernel = kernel_of(signature, metadata_of())
        args = tuple(2**40 + 16 * i if ty[0] == "*" else 0.5 if ty == "fp32" else 16 if ty == "constexpr"
                     else 1000 + i for i, ty in enumerate(types))
        split = types.index("constexpr")  # (the constexprs given by keyword, as the ops do)
        positional = args[:split]
        run, head, tail, _, (triton_run, triton_head, _) = launch._entry(kernel, args[split:])
        (descriptor,) = head

        def best(fn, calls=20000):
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - start) / calls * 1e6)
            return min(times)

        rows[f"{n} args"] = {
            "triton_c_launcher_us": best(lambda: triton_run(1, 1, 1, 0, *triton_head, *args)),
            "own_launcher_us": best(lambda: run(1, 1, 1, 0, *head, *positional, *tail)),
            "own_pack_us": best(lambda: module.pack(descriptor, *positional, *tail)),
            "loop_us": best(lambda: len(args)),  # (the timing loop's own cost, in each of the above)
        }
    return rows


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "check"
    if "DSA_STUB_LIBCUDA" not in os.environ:  # build the stand-in, then run in a fresh interpreter pointed at it
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, DSA_STUB_LIBCUDA=build_stub(tmp), TRITON_LIBCUDA_PATH=tmp)
            return subprocess.run([sys.executable, __file__, *argv], env=env).returncode
    Stub(os.environ["DSA_STUB_LIBCUDA"])  # (loaded before any launcher opens libcuda.so.1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    result = check(int(argv[1]) if len(argv) > 1 else 0) if mode == "check" else bench()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
