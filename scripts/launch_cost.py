"""Host cost of the ops' Triton launches, Triton's launcher against the lean path (:mod:`dsa_triton.launch`).

    python scripts/launch_cost.py [--calls 200] [--rounds 5] [--kernels topk_indices,route_topk] [--out results]

For every registered kernel at its first CPU bench shape (tiny and odd: the device time is small, so the host
path is what shows) the op's call (``spec.run``, the path a decode loop or the tuner takes) is run once with
every launch through Triton's launcher, recording the launches (kernel, grid, arguments). Then:

- launches: each recorded launch, repeated ``--calls`` times back to back, the host clock read before the final
  ``torch.cuda.synchronize`` (the enqueue cost per launch; the launch queue does not fill at these counts) - through
  Triton (``kernel[grid](...)``), through the lean path (``launch(kernel, grid, ...)``; ``lean_with_us``:
  ``launch_with``, the keyword arguments in a dict, as the ops with a plan's dict call it) and through the compiled
  kernel's own runner (``compiled[grid](...)``, the floor Triton's ``CompiledKernel`` offers) - and the same launch
  replayed from a CUDA graph (20 a graph: its device time). ``launcher``: which launcher served the lean path's hits
  (``own``: :mod:`dsa_triton.launcher`; ``triton``: Triton's C launcher, for a kernel the own one does not serve or
  with it off); ``lean_with_triton_us``: ``launch_with`` with the own launcher off (as ``DSA_OWN_LAUNCHER=0``), its
  hits through Triton's C launcher (rounds alternating with ``lean_with_us``'s). ``lean_misses``: lean calls that
  still took Triton's path after the first (0 when every argument is keyable);
- ops: the whole call the same way (host enqueue and wall clock per call with the sync at the end, Triton's path,
  the lean one, and the lean one with the own launcher off), and the call replayed from a CUDA graph (NaN when it
  does not capture: an op that syncs).

Best of ``--rounds``. Prints both tables and the largest lean cost of a launch with either launcher (target: at
most 10 us on the H200 host), and writes them with :func:`dsa_triton.bench.results.write_results` (``--out``;
``--flat`` puts the files straight into it, e.g. ``--out $OUT --flat`` on the GPU machine).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_US = 10.0  # the lean path's host cost a launch, at most, on the H200 host


@contextlib.contextmanager
def recorded_launches(records: list):
    """Every launch inside the block goes through Triton's launcher (lean path off) and is recorded as
    ``(kernel, grid, args, kwargs)``."""
    from triton.runtime.jit import JITFunction

    from dsa_triton import launch as lean

    original, enabled = JITFunction.run, lean.ENABLED

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            records.append((self, grid, args, dict(kwargs)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run, lean.ENABLED = run, False
    try:
        yield records
    finally:
        JITFunction.run, lean.ENABLED = original, enabled


@contextlib.contextmanager
def lean_path(on: bool):
    from dsa_triton import launch as lean

    enabled = lean.ENABLED
    lean.ENABLED = on
    try:
        yield
    finally:
        lean.ENABLED = enabled


@contextlib.contextmanager
def own_launcher(on: bool, kernels):
    """The lean path's hits through the own launcher (``on``, where it serves the kernel) or Triton's C launcher:
    the lean state of ``kernels`` is dropped on entering and on leaving, so that their launches are kept anew with
    the launcher chosen."""
    from dsa_triton import launcher

    enabled = launcher.ENABLED
    launcher.ENABLED = on
    for kernel in kernels:
        kernel.__dict__.pop("_dsa_lean", None)
    try:
        yield
    finally:
        launcher.ENABLED = enabled
        for kernel in kernels:
            kernel.__dict__.pop("_dsa_lean", None)


def by_launcher(kernels, call, calls: int, rounds: int) -> dict:
    """Host enqueue microseconds per ``call`` (lean launches of ``kernels``, the lean path on) with the hits through
    Triton's C launcher and through the own one, ``{"triton": us, "own": us}``: a lean state of each kernel kept per
    launcher (three calls: through Triton's path, a miss, a hit), then the rounds alternating between the two (best
    of ``rounds``). The kernels keep their own launcher's state."""
    states = {}
    for name in ("triton", "own"):
        with own_launcher(name == "own", kernels):
            for _ in range(3):
                call()
            states[name] = {kernel: kernel.__dict__.get("_dsa_lean") for kernel in kernels}
    best = dict.fromkeys(states, math.inf)
    for _ in range(rounds):
        for name, kept in states.items():
            for kernel, state in kept.items():
                if state is None:  # (not kept: a kernel the lean path does not take)
                    kernel.__dict__.pop("_dsa_lean", None)
                else:
                    kernel._dsa_lean = state
            best[name] = min(best[name], host_us(call, calls, 1)[0])
    return best


def host_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """``(host enqueue, wall clock)`` microseconds per call of ``fn``, ``calls`` back to back with one sync at the end;
    best of ``rounds``."""
    fn()
    torch.cuda.synchronize()
    enqueue = wall = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        enqueue = min(enqueue, (issued - start) / calls * 1e6)
        wall = min(wall, (done - start) / calls * 1e6)
    return enqueue, wall


def device_us(fn, device) -> float:
    """Microseconds per call of ``fn`` replayed from CUDA graphs of 20 calls (NaN when it does not capture)."""
    from dsa_triton.bench.harness import graph_time_or_nan

    return graph_time_or_nan(lambda _: fn(), [None], device, calls_per_graph=20, warmup_ms=10, rep_ms=50)


def misses_of(fn, calls: int) -> int:
    """Calls of ``fn`` (the lean path on) that went through Triton's launcher."""
    from triton.runtime.jit import JITFunction

    count = [0]
    original = JITFunction.run

    def run(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    JITFunction.run = run
    try:
        for _ in range(calls):
            fn()
    finally:
        JITFunction.run = original
    torch.cuda.synchronize()
    return count[0]


def launch_rows(name: str, records: list, calls: int, rounds: int, device) -> list[dict]:
    from dsa_triton.launch import LeanKernel, launch, launch_with

    rows = []
    for i, (kernel, grid, args, kwargs) in enumerate(records):
        triton_call = lambda: kernel[grid](*args, **kwargs)  # noqa: E731
        lean_call = lambda: launch(kernel, grid, *args, **kwargs)  # noqa: E731
        lean_with_call = lambda: launch_with(kernel, grid, kwargs, *args)  # noqa: E731
        compiled = triton_call()
        tail = LeanKernel(kernel).tail(args, kwargs)
        runner = compiled[(*grid, 1, 1)[:3]] if tail is not None else None  # (its runner reads three grid sizes)
        full = (*args, *tail) if tail is not None else ()
        with lean_path(True):
            lean_call()
            lean_call()
            misses = misses_of(lean_call, 20)
            lean_us, _ = host_us(lean_call, calls, rounds)
            lean_with = by_launcher([kernel], lean_with_call, calls, rounds)
        with lean_path(False):
            triton_us, _ = host_us(triton_call, calls, rounds)
        compiled_us = host_us(lambda: runner(*full), calls, rounds)[0] if runner is not None else math.nan
        with lean_path(True):
            dev = device_us(lean_call, device)
            parts = lean_parts(kernel, grid, args, kwargs, calls, rounds)
        rows.append({"op": name, "launch": i, "kernel": kernel.fn.__name__, "grid": "x".join(map(str, grid)),
                     "args": len(args) + len(kwargs), "triton_us": triton_us, "lean_us": lean_us,
                     "lean_with_us": lean_with["own"], "lean_with_triton_us": lean_with["triton"],
                     "compiled_us": compiled_us, "device_us": dev, "lean_vs_triton": triton_us / lean_us,
                     "lean_misses": misses, **parts})
    return rows


def lean_parts(kernel, grid, args: tuple, kwargs: dict, calls: int, rounds: int) -> dict:
    """Host microseconds of the lean path's parts for one launch (after it has hit), and ``launcher``, which
    launcher served its hits (``own`` or ``triton``): ``with_python_us`` ``launch_with`` through the layouts' Python
    hit functions alone (the reference the compiled hit stands in front of), ``key_us`` the Python function's fast key
    (with the addresses), ``checks_us`` device, stream, hooks and globals, ``run_ints_us`` / ``run_tensors_us``
    Triton's C launcher given the addresses / the tensors, ``run_own_us`` the own launcher given the addresses (NaN
    where it does not serve the kernel; each of these launches the kernel)."""
    from dsa_triton import launch as lean
    from dsa_triton import launcher

    state = kernel._dsa_lean
    for layout in state.layouts:  # the one that takes the call
        try:
            key, pointers = layout.fast_key(args, kwargs, lean._device())
            break
        except Exception:
            continue
    else:
        raise RuntimeError(f"no layout of {kernel.fn.__name__} takes the call")
    fast_of = layout.fast_key
    run, head, tail, _, (triton_run, triton_head, triton_tail) = state.entries[layout.key(args, kwargs,
                                                                                          lean._device())]
    own = launcher.compiled_launcher()
    served = own is not None and run is own.launch
    gx, gy, gz = (*grid, 1, 1)[:3]

    def checks():
        device = lean._device()
        lean._stream(device)
        return kernel.pre_run_hooks or not lean.hooks_idle() or state.globals_changed()

    def best(fn):
        return min(host_us(fn, calls, 1)[0] for _ in range(rounds))

    built, lean.compiled_hit = lean.compiled_hit, lambda: None
    try:
        kernel._dsa_lean = lean.LeanKernel(kernel)
        for _ in range(3):
            lean.launch_with(kernel, grid, kwargs, *args)
        with_python = best(lambda: lean.launch_with(kernel, grid, kwargs, *args))
    finally:
        lean.compiled_hit, kernel._dsa_lean = built, state
    stream = lean._stream(lean._device())
    return {"launcher": "own" if served else "triton", "with_python_us": with_python,
            "key_us": best(lambda: fast_of(args, kwargs, 0)), "checks_us": best(checks),
            "run_ints_us": best(lambda: triton_run(gx, gy, gz, stream, *triton_head, *pointers, *triton_tail)),
            "run_own_us": best(lambda: run(gx, gy, gz, stream, *head, *pointers, *tail)) if served else math.nan,
            "run_tensors_us": best(lambda: triton_run(gx, gy, gz, stream, *triton_head, *args, *triton_tail))}


def op_row(name: str, call, kernels: set, n_launches: int, calls: int, rounds: int, device) -> dict:
    """The op's call (``kernels``: the ones it launches): host enqueue and wall clock through Triton's path and the
    lean one (the host enqueue with the hits through the own launcher and, ``lean_triton_host_us``, through Triton's
    C launcher: :func:`by_launcher`); its time replayed from a CUDA graph."""
    with lean_path(False):
        call()
        triton_host, triton_wall = host_us(call, calls, rounds)
    with lean_path(True):
        call()
        call()
        _, lean_wall = host_us(call, calls, rounds)
        lean_host = by_launcher(kernels, call, calls, rounds)
        graph = device_us(call, device)
    return {"op": name, "launches": n_launches, "triton_host_us": triton_host, "lean_host_us": lean_host["own"],
            "lean_triton_host_us": lean_host["triton"], "triton_wall_us": triton_wall, "lean_wall_us": lean_wall,
            "graph_us": graph, "host_saved_per_launch_us": (triton_host - lean_host["own"]) / max(n_launches, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best is kept)")
    parser.add_argument("--kernels", default="", help="comma-separated registry names (default: all)")
    parser.add_argument("--out", default="results", help="where the results files go")
    parser.add_argument("--flat", action="store_true", help="write straight into --out (no <device>/<date> folders)")
    args = parser.parse_args(argv)

    assert torch.cuda.is_available(), "scripts/launch_cost.py needs a GPU"
    import dsa_triton  # noqa: F401  (registers every kernel)
    from dsa_triton import registry
    from dsa_triton.bench.results import dict_table, write_results
    from dsa_triton.registry import shape_text

    device = torch.device("cuda")
    wanted = [n for n in args.kernels.split(",") if n]
    specs = [registry.get(n) for n in wanted] if wanted else registry.kernels()
    launches, ops = [], []
    for spec in specs:
        for phase in spec.phases:
            shapes = spec.bench_shapes(phase, False)
            if not shapes:
                continue
            shape = shapes[0]
            name = f"{spec.name} {phase} {shape_text(shape)}"
            try:
                inputs = spec.make_inputs(phase, shape, device, 0)
                config = spec.launch_config(phase, shape, device)
                call = lambda: spec.run(inputs, config)  # noqa: E731
                call()  # compiles
                records = []
                with recorded_launches(records):
                    call()
                torch.cuda.synchronize()
                ops.append(op_row(name, call, {r[0] for r in records}, len(records), args.calls, args.rounds,
                                  device))
                launches += launch_rows(name, records, args.calls, args.rounds, device)
            except Exception as exc:  # one op's failure is its row; the others still run
                ops.append({"op": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(f"{name}: {ops[-1]['error']}", flush=True)
                continue
            print(f"{name}: done", flush=True)
    from dsa_triton.launch import compiled_hit
    from dsa_triton.launcher import compiled_launcher

    hit = "the compiled hit" if compiled_hit() is not None else "the Python functions (the compiled hit did not build)"
    own = "built" if compiled_launcher() is not None else "not built (hits through Triton's C launcher)"
    n = len(launches)

    def spread(column):
        values = sorted(r[column] for r in launches)
        over = sum(v > TARGET_US for v in values)
        return f"{values[-1]:.1f} at most, median {values[n // 2]:.1f}, {over} over {TARGET_US:.0f}"

    summary = (f"lean path: {spread('lean_us')}; launch_with: {spread('lean_with_us')} (hits through the own "
               f"launcher in {sum(r['launcher'] == 'own' for r in launches)} of {n} launches), with Triton's "
               f"launcher on hits: {spread('lean_with_triton_us')}, through the Python hit functions alone: "
               f"{spread('with_python_us')}; Triton's path: median "
               f"{sorted(r['triton_us'] for r in launches)[n // 2]:.1f}; "
               f"{sum(r['lean_misses'] > 0 for r in launches)} launches missing the lean cache; hits through "
               f"{hit}") if launches else "no launch"
    print(dict_table(launches))
    print()
    print(dict_table(ops))
    print(summary)
    path = write_results(args.out, "launch-cost", {"launches": launches, "ops": ops}, note=summary,
                         data={"calls": args.calls, "rounds": args.rounds, "hit": hit,
                               "own_launcher": own}, flat=args.flat)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
