"""One timing harness for benchmarks and the tuner.

- :func:`measure_ceilings`: copy bandwidth, bf16 and fp8 matmul rates, measured in this process;
- :func:`rotation`: enough input sets that one pass over them exceeds the L2 (60 MB on an H200);
- :func:`time_us`: warm-up, then ``triton.testing.do_bench`` median over the rotated sets
  (wall-clock median on the CPU interpreter, where only relative numbers mean anything);
- :func:`graph_time_us` / :func:`graph_us`: the same over CUDA-graph replays (GPU time without host launch cost);
- :func:`timed_us`: graph replay when the call captures, else eager, and which one it was (the tuner's timer);
- :func:`floor_us` / :func:`measurement`: the floor from a :class:`~dsa_triton.registry.Cost`, and a
  row with the ratio to a baseline timed in the same run and the fraction of the floor.
"""
from __future__ import annotations

import functools
import gc
import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..moe.workspace import release_shared_workspaces
from ..registry import Cost
from ..runtime import device_memory, release_cached_memory, release_stack, stack_bytes

T = TypeVar("T")

L2_BYTES = 60 * 2**20  # H200; read off the device when there is one


@dataclass(frozen=True)
class Ceilings:
    """Measured rates: copy in TB/s (bytes read + written), matmuls in TFLOP/s."""

    copy_tbps: float
    bf16_tflops: float
    fp8_tflops: float

    def rate(self, flop_dtype: str) -> float:
        return {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops}[flop_dtype]


def l2_bytes(device: torch.device | None = None) -> int:
    if device is not None and torch.device(device).type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", L2_BYTES))
    return L2_BYTES


def time_us(fn: Callable[[], Any], device: torch.device | str, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in microseconds: ``do_bench`` on CUDA, wall clock on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()  # warm-up (interpreter: first call compiles nothing but fills caches)
    samples = []
    budget_end = time.perf_counter() + rep_ms / 1e3
    while len(samples) < 3 or (time.perf_counter() < budget_end and len(samples) < 20):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def rotation(make_set: Callable[[int], T], bytes_per_set: float, device: torch.device | str, max_sets: int = 16) -> list[T]:
    """Input sets ``make_set(i)`` for i = 0..n-1, with n so that one sweep touches over twice the L2 (n >= 2)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [make_set(0)]
    n = min(max_sets, max(2, math.ceil(2 * l2_bytes(device) / max(bytes_per_set, 1.0))))
    return [make_set(i) for i in range(n)]


def time_rotating(call: Callable[[T], Any], sets: Sequence[T], device: torch.device | str, **kw) -> float:
    """Median microseconds of ``call(s)``, cycling through ``sets`` so no call finds its inputs in L2."""
    cycle = itertools.cycle(sets)
    return time_us(lambda: call(next(cycle)), device, **kw)


def graph_time_us(call: Callable[[T], Any], sets: Sequence[T], device: torch.device | str, calls_per_graph: int = 1,
                  **kw) -> float:
    """Median microseconds of ``call(s)`` replayed from CUDA graphs, one captured per set, replays cycled
    (``kw``: the ``time_us`` budget).

    Each set is run once on a side stream first (compiles kernels, fills host caches) so the capture records
    only launches; the graphs share one memory pool and are released after timing. ``calls_per_graph`` > 1: each graph holds that many calls on consecutive sets and the time is
    per call (the graph's own launch shared by them, as in a decode step's graph).
    NaN off the GPU. A capture failure (an op that syncs) raises ``RuntimeError``.
    """
    if not isinstance(calls_per_graph, int) or calls_per_graph < 1:
        raise ValueError(f"calls_per_graph: expected a positive int, got {calls_per_graph!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    side = side_stream(device)
    for s in sets:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            call(s)
        torch.cuda.current_stream(device).wait_stream(side)
    graphs, pool = [], torch.cuda.graph_pool_handle()  # one pool: the graphs replay one at a time, in capture order
    try:
        for i in range(len(sets)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                for j in range(calls_per_graph):
                    call(sets[(i + j) % len(sets)])
            graphs.append(graph)
        return time_rotating(lambda g: g.replay(), graphs, device, **kw) / calls_per_graph
    finally:
        for graph in graphs:
            graph.reset()


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of ``device`` that warm-up calls run on: each stream a matmul runs on gets its own cuBLAS
    workspace, kept for the process (a new stream per call would leave one behind each time, up to the 32 of
    PyTorch's stream pool, wherever a free block was: each can pin a segment :func:`settle` would return)."""
    return torch.cuda.Stream(device)


def timed_us(call: Callable[[T], Any], sets: Sequence[T], device: torch.device | str, mode: str = "auto",
             **kw) -> tuple[float, str]:
    """``(median microseconds, "graph" | "eager")`` of ``call(s)`` over ``sets`` (``kw``: the ``time_us`` budget).

    ``mode="auto"``: CUDA-graph replay (:func:`graph_time_us`) when on CUDA and the call captures, else eager
    (:func:`time_rotating`; always eager off the GPU); ``"eager"`` never tries a capture (for graph times alone,
    NaN when the call does not capture: :func:`graph_time_or_nan`). Graph times are the kernels' device time: an
    eager median of an op of a few launches is the host's launch path, which moves with the host's load.
    """
    if mode not in ("auto", "eager"):
        raise ValueError(f"mode: expected 'auto' or 'eager', got {mode!r}")
    if mode == "auto" and torch.device(device).type == "cuda":
        us = graph_time_or_nan(call, sets, device, **kw)
        if us == us:
            return us, "graph"
    return time_rotating(call, sets, device, **kw), "eager"


def graph_time_or_nan(call: Callable[[T], Any], sets: Sequence[T], device: torch.device | str, **kw) -> float:
    """:func:`graph_time_us`, NaN when the call does not capture (an op that syncs on the host)."""
    try:
        return graph_time_us(call, sets, device, **kw)
    except RuntimeError:
        torch.cuda.synchronize(device)  # the failed capture has ended; the stream runs on
        gc.collect()  # the graphs captured before the failure (and their memory pools) go now, not at some later
        torch.cuda.empty_cache()  # collection, so that a tuner's later jobs find the memory free
        return float("nan")


def graph_us(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Median microseconds of ``fn()`` replayed from one CUDA graph (see :func:`graph_time_us`)."""
    return graph_time_us(lambda _: fn(), [None], device)


def floor_us(cost: Cost, ceilings: Ceilings) -> tuple[float, str]:
    """The larger of bytes / copy bandwidth and FLOPs / matmul rate, in microseconds, and which one it is."""
    mem = cost.bytes / (ceilings.copy_tbps * 1e12) * 1e6
    compute = cost.flops / (ceilings.rate(cost.flop_dtype) * 1e12) * 1e6 if cost.flops else 0.0
    return (mem, "memory") if mem >= compute else (compute, f"{cost.flop_dtype} compute")


@dataclass
class Measurement:
    """One timed row: kernel and baseline medians, their ratio, and the fraction of the floor reached."""

    kernel: str
    phase: str
    shape: str
    config: str
    median_us: float
    baseline: str = ""
    baseline_us: float = float("nan")
    speedup: float = float("nan")  # baseline_us / median_us
    floor_us: float = float("nan")
    bound: str = ""
    floor_fraction: float = float("nan")  # floor_us / median_us
    tbps: float = float("nan")
    tflops: float = float("nan")
    check: str = "ok"
    graph_us: float = float("nan")  # the same call replayed from CUDA graphs (NaN: no GPU, or it does not capture)
    graph_baseline_us: float = float("nan")
    graph_speedup: float = float("nan")
    graph_floor_fraction: float = float("nan")
    outside_mib: float = float("nan")  # device memory outside PyTorch's allocator after the row (:func:`settle`)
    stack_bytes: int = 0  # the context's per-thread stack the row left (local memory of spilling kernels)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measurement(
    *,
    kernel: str,
    phase: str,
    shape: str,
    config: str,
    median_us: float,
    cost: Cost,
    ceilings: Ceilings | None,
    baseline: str = "",
    baseline_us: float = float("nan"),
    check: str = "ok",
    graph_us: float = float("nan"),
    graph_baseline_us: float = float("nan"),
) -> Measurement:
    row = Measurement(kernel, phase, shape, config, median_us, baseline, baseline_us, check=check, graph_us=graph_us,
                      graph_baseline_us=graph_baseline_us)
    if check != "ok":  # the kernel or its baseline failed: the times stay, no figure is made of them
        return row
    row.graph_speedup = graph_baseline_us / graph_us
    row.speedup = baseline_us / median_us
    row.tbps = cost.bytes / (median_us * 1e-6) / 1e12
    row.tflops = cost.flops / (median_us * 1e-6) / 1e12 if cost.flops else float("nan")
    if ceilings is not None:
        row.floor_us, row.bound = floor_us(cost, ceilings)
        row.floor_fraction = row.floor_us / median_us
        row.graph_floor_fraction = row.floor_us / graph_us
    return row


def measure_ceilings(device: torch.device | str = "cuda") -> Ceilings:
    """Copy bandwidth (2 GiB device-to-device), bf16 and fp8 e4m3 matmul rates at 8192^3, this process."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("measure_ceilings: needs a CUDA device; the interpreter has no meaningful ceilings")
    n_copy = 2**30  # bf16 elements: 2 GiB read + 2 GiB written
    src = torch.randn(n_copy, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src), device)
    copy_tbps = 2 * src.numel() * src.element_size() / (copy_us * 1e-6) / 1e12
    del src, dst

    n = 8192
    flops = 2 * n**3
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16_us = time_us(lambda: a @ b, device)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    fp8_us = time_us(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), device)
    return Ceilings(copy_tbps, flops / (bf16_us * 1e-6) / 1e12, flops / (fp8_us * 1e-6) / 1e12)


def release_memory(device: torch.device | str) -> None:
    """Between bench rows or tuning jobs (CUDA; nothing elsewhere): collect the garbage (a failed call's tensors can
    sit in reference cycles through its traceback's frames), drop the process-wide MoE workspaces, and return the
    cuBLAS workspaces and the caching allocator's free blocks (:func:`~dsa_triton.runtime.release_cached_memory`)."""
    if torch.device(device).type != "cuda":
        return
    gc.collect()
    release_shared_workspaces()
    release_cached_memory(device)


def settle(device: torch.device | str) -> dict[str, float]:
    """After a bench row: :func:`release_memory`, note the device memory outside
    the allocator and the per-thread stack the work left, then release the stack (the driver keeps local memory for
    the most demanding kernel launched so far, ``stack x resident threads``, until told otherwise). On the GPU:
    ``{"outside_mib", "stack_bytes", "outside_released_mib"}``; off it: ``{}``."""
    if torch.device(device).type != "cuda":
        return {}
    release_memory(device)
    outside, stack = device_memory(device)["outside"], stack_bytes(device) or 0
    release_stack(device)
    return {"outside_mib": outside / 2**20, "stack_bytes": stack,
            "outside_released_mib": device_memory(device)["outside"] / 2**20}


def error_text(exc: BaseException, prefix: str = "") -> str:
    """``prefix``, the exception's type and message, cut at 300 characters; an out-of-memory message whole (its
    last part, the caching allocator's summary of what it holds, is the part that explains it)."""
    text = f"{prefix}{type(exc).__name__}: {exc}"
    return text if does_not_fit(exc) else text[:300]


def does_not_fit(exc: BaseException) -> bool:
    """An out-of-memory error (PyTorch's, or the driver's as a RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
