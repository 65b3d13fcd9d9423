"""Host time of lean launch hits on the CPU: ``TRITON_INTERPRET=0 python -m dsa_triton.bench.launchprof [kernels]``.

No GPU needed. Every registered op runs once at its first CPU bench shape with Triton's launch recorded instead of
run (the ops' checks told to take CPU tensors); the first launch of each kernel is then repeated through the lean
path (:mod:`dsa_triton.launch`) with ``FAST_DEVICE`` set to the CPU's type, so that those plain CPU tensors take the
hit path as CUDA tensors do on a GPU. Triton's C launcher is replaced by a Python no-op and the device and stream
queries by C builtins. Per kernel, with the hits through the layouts' Python functions and through the compiled hit
(:mod:`dsa_triton.launch_hit`; rounds interleaved): ``launch_with`` (the plan's keyword dict, as the ops call it)
and ``launch`` (keywords packed per call); the Python function's fast key alone; best of 15 rounds of 2000 calls, in
us; and the no-op launcher alone (part of every launch column). Kernels compile under ``TRITON_INTERPRET=0`` (a compiled-mode
``JITFunction``), hence the variable.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from triton.runtime.jit import JITFunction

from .. import checks, launch, registry
from ..runtime import interpreting


@contextlib.contextmanager
def launches_recorded_not_run(records: list):
    """Triton's launch records ``(kernel, grid, args, kwargs)`` instead of compiling (the lean path off); the ops'
    checks take CPU tensors."""
    run, enabled, checked = JITFunction.run, launch.ENABLED, checks.interpreting

    def record(self, *args, grid, warmup, **kwargs):
        records.append((self, grid, args, kwargs))

    JITFunction.run, launch.ENABLED, checks.interpreting = record, False, lambda: True
    try:
        yield records
    finally:
        JITFunction.run, launch.ENABLED, checks.interpreting = run, enabled, checked


def first_launches(names: list[str]) -> list[tuple]:
    """The first recorded launch of each kernel (of those named, or all) over the registered ops' runs."""
    records, device = [], torch.device("cpu")
    with launches_recorded_not_run(records):
        for spec in registry.kernels():
            for phase in spec.phases:
                shapes = spec.bench_shapes(phase, False)
                if not shapes:
                    continue
                try:
                    spec.run(spec.make_inputs(phase, shapes[0], device, 0),
                             spec.launch_config(phase, shapes[0], device))
                except Exception:  # a later step read what a stubbed kernel did not write: its launches are kept
                    pass
    first = {}
    for record in records:
        name = record[0].fn.__name__
        if not names or name in names:
            first.setdefault(name, record)
    return list(first.values())


class Compiled:
    """Stands in for a compiled kernel (``run``: the launcher, a no-op)."""
    function, packed_metadata = 0, ()

    @staticmethod
    def run(*args):
        pass


@contextlib.contextmanager
def stubbed_device():
    """Triton's launch returns :class:`Compiled`; the CUDA device and stream queries are C builtins returning 0; CPU
    tensors take the hit path."""
    saved = JITFunction.run, launch._device, launch._stream, torch.cuda.current_device, launch.FAST_DEVICE
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: Compiled
    launch._device, launch._stream, torch.cuda.current_device, launch.FAST_DEVICE = int, abs, int, "cpu"
    try:
        yield
    finally:
        JITFunction.run, launch._device, launch._stream, torch.cuda.current_device, launch.FAST_DEVICE = saved


def lean_state(kernel, grid, args: tuple, kwargs: dict, compiled: bool) -> launch.LeanKernel:
    """A new LeanKernel of ``kernel`` whose hits go through the compiled hit or the Python functions, after the
    launch has hit."""
    built = launch.compiled_hit
    launch.compiled_hit = built if compiled else (lambda: None)
    try:
        state = launch.LeanKernel(kernel)
        kernel._dsa_lean = state
        for _ in range(3):
            launch.launch_with(kernel, grid, kwargs, *args)
    finally:
        launch.compiled_hit = built
    assert len(state.entries) == 1 and len(state.fast) == 1, f"{kernel.fn.__name__}: the launch does not hit"
    return state


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def kernel_row(kernel, grid, args: tuple, kwargs: dict, calls: int = 2000, rounds: int = 15) -> dict:
    paths = ("python", "compiled") if launch.compiled_hit() is not None else ("python",)
    states = {path: lean_state(kernel, grid, args, kwargs, path == "compiled") for path in paths}
    _, head, tail, _, _ = next(iter(states["python"].fast.values()))
    best: dict = {}

    def keep(name, us):
        best[name] = min(best.get(name, us), us)

    for _ in range(rounds):
        keep("launcher_us", per_call_us(lambda: Compiled.run(1, 1, 1, 0, *head, *args, *tail), calls))
        for path, state in states.items():
            kernel._dsa_lean = state
            keep(f"{path}_with_us", per_call_us(lambda: launch.launch_with(kernel, grid, kwargs, *args), calls))
            keep(f"{path}_launch_us", per_call_us(lambda: launch.launch(kernel, grid, *args, **kwargs), calls))
        fast_key = states["python"].layouts[0].fast_key
        keep("python_key_us", per_call_us(lambda: fast_key(args, kwargs, 0), calls))
    kinds = [launch.argument_kind(a) for a in args]
    return {"kernel": kernel.fn.__name__, "args": len(args) + len(kwargs), "tensors": kinds.count("tensor"),
            "ints": kinds.count("int"), **{name: round(us, 2) for name, us in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(prog="TRITON_INTERPRET=0 python -m dsa_triton.bench.launchprof")
    parser.add_argument("kernels", nargs="*", help="kernel names (default: every kernel the ops launch)")
    args = parser.parse_args()
    if interpreting():
        parser.error("run with TRITON_INTERPRET=0: the lean path takes compiled-mode kernels only")
    from .results import dict_table

    rows = []
    with stubbed_device():
        for kernel, grid, kernel_args, kwargs in first_launches(args.kernels):
            rows.append(kernel_row(kernel, grid, kernel_args, kwargs))
            print(rows[-1], flush=True)
    print(dict_table(rows))


if __name__ == "__main__":
    main()
