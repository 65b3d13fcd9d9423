"""Compile the kernels for an NVIDIA target on a machine without a GPU: lowering errors before a GPU session.

Triton's wheel bundles ptxas and cuobjdump, so ``triton.compile`` builds sm_90 (H200) cubins on the CPU. Two
steps, because a process runs Triton either in the interpreter or compiled, not both:

1. in the interpreter (the test suite's mode), :func:`record_launches` notes every kernel launch of some ops: the
   kernel, its arguments' Triton types and constexprs, warps and stages;
2. ``python -m dsa_triton.bench.aot RECORDS.json [--info]`` (a process with ``TRITON_INTERPRET=0``) compiles each record
   with :func:`compile_for` and prints one JSON line per record: its kernel and the error, or None, and whether the
   lean path's own launcher would pass the compiled kernel's parameters (:func:`launcher_mismatch`) (``--info``:
   registers, spills, ptxas's performance advisories and the wgmma counts too).

Arguments are specialized as Triton's launcher does (pointers and integers divisible by 16 marked so, integers
equal to 1 made constants), from the recorded CPU tensors' addresses: close to what a GPU run builds, still a
check that the kernels lower for the target, not of their speed (:func:`sass` shows the instructions,
:func:`ptxas_info` the registers, spills and ptxas's performance advisories).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

H200 = ("cuda", 90, 32)  # backend, compute capability, warp size


def triton_type(value) -> str:
    """The Triton type of an argument as Triton's launcher names it (``triton.runtime.jit.mangle_type``: ``*fp32``,
    ``i32``, ``u1``, ...), ``none`` for None or ``dtype`` for a ``tl.dtype`` constexpr (recorded by name)."""
    import triton.language as tl
    from triton.runtime.jit import mangle_type

    if value is None:
        return "none"
    if isinstance(value, tl.dtype):
        return "dtype"
    return mangle_type(value)


def _divisible_by_16(value) -> bool:
    """What Triton's launcher marks ``tt.divisibility = 16`` (its specialization's "D"): a tensor's address or an
    integer divisible by 16."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    if value is None or not isinstance(value, (torch.Tensor, int)) or isinstance(value, bool):
        return False
    return native_specialize_impl(BaseBackend, value, False, True, True)[1] == "D"


@contextlib.contextmanager
def record_launches(execute: bool = True):
    """In the interpreter: yields a list that collects ``{"module", "kernel", "types", "values", "aligned",
    "num_warps", "num_stages"}`` per distinct launch inside the block. ``types`` holds every argument's Triton
    type, ``values`` the scalar ones (the constexprs among them are known at compile time), ``aligned`` the
    pointers and integers divisible by 16. ``execute=False`` skips
    the launches (outputs stay unwritten: for ops whose host code reads no kernel output)."""
    from triton.runtime.interpreter import InterpretedFunction

    records, seen, original = [], set(), InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        types = {k: triton_type(v) for k, v in bound.items()}
        values = {k: v.name if types[k] == "dtype" else v for k, v in bound.items() if not isinstance(v, torch.Tensor)}
        aligned = [k for k, v in bound.items() if _divisible_by_16(v)]
        record = {"module": self.fn.__module__, "kernel": self.fn.__name__, "types": types, "values": values,
                  "aligned": aligned, "num_warps": options.get("num_warps", 4),
                  "num_stages": options.get("num_stages", 3)}
        key = json.dumps(record, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            records.append(record)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    InterpretedFunction.run = run
    try:
        yield records
    finally:
        InterpretedFunction.run = original


def compile_for(record: dict, target: tuple = H200):
    """Compile one recorded launch for ``target`` (needs ``TRITON_INTERPRET=0`` in this process); a Gluon kernel
    through Gluon's source class."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = getattr(importlib.import_module(record["module"]), record["kernel"])
    constexprs, signature, attrs = {}, {}, {}
    aligned = set(record.get("aligned", ()))
    for param in fn.params:
        name = param.name
        kind = record["types"].get(name, "none")
        value = record["values"].get(name)
        specialized = not param.do_not_specialize
        if param.is_constexpr or kind in ("none", "dtype") or (kind == "i32" and value == 1 and specialized):
            constexprs[name] = tl.dtype(value) if kind == "dtype" else value
            signature[name] = "constexpr"
            continue
        signature[name] = kind
        if name in aligned and specialized and not param.do_not_specialize_on_alignment:
            attrs[(param.num,)] = [["tt.divisibility", 16]]
    source = GluonASTSource if fn.is_gluon() else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=GPUTarget(*target),
                          options={"num_warps": record["num_warps"], "num_stages": record["num_stages"]})


def _bundled_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass(kernel) -> list[str]:
    """The SASS instructions of a compiled kernel (through the cuobjdump bundled with Triton)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_bundled_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def ptxas_info(kernel, arch: str = "sm_90a") -> dict:
    """The bundled ptxas's ``-v`` report on a compiled kernel's PTX: ``{"registers", "spill_bytes",
    "advisories"}``, the last the "Potential Performance Loss" lines (e.g. C7515: wgmma instructions serialized)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        report = subprocess.run([_bundled_tool("ptxas"), f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "advisories": [line.split("Potential Performance Loss:", 1)[1].strip()
                           for line in report.splitlines() if "Potential Performance Loss:" in line]}


def launcher_mismatch(kernel) -> str | None:
    """How the lean path's own launcher (:mod:`dsa_triton.launcher`) would not pass a compiled kernel's parameters:
    None when its type codes of the kernel's signature give one parameter of the PTX entry's size for each, in order
    (the two scratch pointers last), else what differs; "not built" without the launcher's module."""
    from .. import launcher

    module = launcher.compiled_launcher()
    if module is None:
        return "not built"
    codes = launcher.type_codes(kernel.src.signature, module.TYPES)
    if codes is None:
        return f"no type codes for the signature {kernel.src.signature}"
    ours = [module.SIZES[code] for code in codes if code != module.TYPES["constexpr"]] + [8, 8]
    entry = re.search(r"\.entry\s+\w+\s*\(([^)]*)\)", kernel.asm["ptx"]).group(1)
    ptx = []  # (".param .u32 name", ".param .u64 .ptr .global .align 1 name", ".param .align 2 .b8 name[2]")
    for param in entry.split(","):
        array = re.search(r"\[(\d+)\]", param)
        ptx.append(int(array.group(1)) if array else int(re.search(r"\.param\s+\.[a-z]+(\d+)", param).group(1)) // 8)
    return None if ours == ptx else f"the launcher's parameter bytes {ours}, the PTX entry's {ptx}"


def compile_in_subprocess(records: list[dict], timeout: float = 900, info: bool = False) -> list[dict]:
    """Run ``python -m dsa_triton.bench.aot`` on ``records``: ``[{"kernel", "error", "launcher", "seconds"}]`` in the
    same order (``launcher``: :func:`launcher_mismatch`, None when the own launcher passes the kernel's parameters);
    ``info`` adds :func:`ptxas_info`'s fields, the shared memory bytes (``shared``), the SASS's wgmma counts
    (``gmma``, ``arrive``, ``depbar``), per string of a record's optional ``ptx_needles`` whether the PTX holds it
    (``ptx_has``) and per string of its optional ``ptx_counted`` how often (``ptx_count``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(records, f, default=str)
        f.flush()
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        done = subprocess.run([sys.executable, "-m", "dsa_triton.bench.aot", f.name, *(["--info"] if info else [])],
                              capture_output=True, text=True, env=env, timeout=timeout, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(path: str, info: bool = False) -> None:
    with open(path) as f:
        records = json.load(f)
    for record in records:
        start = time.perf_counter()
        result = {"kernel": f"{record['module']}.{record['kernel']}", "error": None, "launcher": None}
        try:
            kernel = compile_for(record)
            result["launcher"] = launcher_mismatch(kernel)
            if info:
                ops = [line.split()[0] for line in sass(kernel) if line.split()]
                result.update(ptxas_info(kernel), shared=kernel.metadata.shared,
                              gmma=sum("GMMA" in op for op in ops),
                              arrive=ops.count("WARPGROUP.ARRIVE"), depbar=ops.count("WARPGROUP.DEPBAR.LE"),
                              ptx_has={s: s in kernel.asm["ptx"] for s in record.get("ptx_needles", ())},
                              ptx_count={s: kernel.asm["ptx"].count(s) for s in record.get("ptx_counted", ())})
        except Exception as exc:  # every failure is the answer for that record
            result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(json.dumps({**result, "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], info="--info" in sys.argv[2:])
