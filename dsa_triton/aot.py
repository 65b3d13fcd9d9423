"""Compile the kernels for an NVIDIA target on a machine without a GPU: lowering errors before a GPU session.

Triton's wheel bundles ptxas and cuobjdump, so ``triton.compile`` builds sm_90 (H200) cubins on the CPU. Two
steps, because a process runs Triton either in the interpreter or compiled, not both:

1. in the interpreter (the test suite's mode), :func:`record_launches` notes every kernel launch of some ops: the
   kernel, its arguments' Triton types and constexprs, warps and stages;
2. ``python -m dsa_triton.aot RECORDS.json`` (a process with ``TRITON_INTERPRET=0``) compiles each record with
   :func:`compile_for` and prints one JSON line per record: its kernel and the error, or None.

Arguments are specialized as Triton's launcher does (pointers and integers divisible by 16 marked so, integers
equal to 1 made constants), from the recorded CPU tensors' addresses: close to what a GPU run builds, still a
check that the kernels lower for the target, not of their speed (:func:`sass` shows the instructions).
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
_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float64: "*fp64",
                  torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
                  torch.bool: "*i1", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


def triton_type(value) -> str:
    """The Triton type of an argument: a tensor's pointer type, ``i32``/``i64``, ``fp32``, ``none``, or ``dtype``
    (a ``tl.dtype`` constexpr, recorded by name)."""
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if value is None:
        return "none"
    if isinstance(value, tl.dtype):
        return "dtype"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _divisible_by_16(value) -> bool:
    """What Triton's launcher marks ``tt.divisibility = 16``: a tensor's address or an integer divisible by 16."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


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
    """Compile one recorded launch for ``target`` (needs ``TRITON_INTERPRET=0`` in this process)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

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
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*target),
                          options={"num_warps": record["num_warps"], "num_stages": record["num_stages"]})


def sass(kernel) -> list[str]:
    """The SASS instructions of a compiled kernel (through the cuobjdump bundled with Triton)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def compile_in_subprocess(records: list[dict], timeout: float = 900) -> list[dict]:
    """Run ``python -m dsa_triton.aot`` on ``records``: ``[{"kernel", "error", "seconds"}]`` in the same order."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(records, f, default=str)
        f.flush()
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        done = subprocess.run([sys.executable, "-m", "dsa_triton.aot", f.name], capture_output=True, text=True,
                              env=env, timeout=timeout, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(path: str) -> None:
    with open(path) as f:
        records = json.load(f)
    for record in records:
        start = time.perf_counter()
        try:
            compile_for(record)
            error = None
        except Exception as exc:  # every failure is the answer for that record
            error = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(json.dumps({"kernel": f"{record['module']}.{record['kernel']}", "error": error,
                          "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
