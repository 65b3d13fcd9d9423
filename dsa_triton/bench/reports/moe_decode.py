"""Reports of the MoE decode path: ``moe_decode`` and ``moe_layer_decode``.

``moe_decode``: the fused MXFP4 grouped GEMM against the issue's acceptance, measured in one run.

For every ``fused_moe_gemm`` bench shape (GPU: E=256, top-8, gate_up N=4096 K=7168 and down N=7168 K=2048,
T in {1, 8, 32, 128}): the launch config checked against the reference, its median time, the fraction of the
measured copy bandwidth it reaches on the MXFP4 bytes of the experts that actually got rows (4.25 bits per
weight, counted from the routing of the timed input sets), and the speedup over cuBLAS bf16 on
pre-dequantized weights of the same experts, timed on the same input sets. Pass: >= 50% of copy bandwidth
(goal 75%) and >= 2x over bf16. On the GPU also: both in CUDA graphs, and the GEMM kernel's own time from
torch.profiler over the rotated sets (``kernel_us``: no launch path, no activation copy), to tell the kernel
from the fixed costs of a call at T = 1 (the part of the call that does not scale with the bytes), and
``steady_us``: per call in graphs of 8 calls on consecutive input sets (the graph's launch shared, the gaps
between kernels kept: a call inside a decode step's graph).
The down GEMM reads class-major rows, as the layer's :func:`.activation.swiglu` writes them (no copy in its
call); the gate_up GEMM reads the tokens as they come (its call copies them class-major when ``X_COPY``).
"""
from __future__ import annotations

import collections
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_triton.bench.harness import error_text, floor_us, graph_time_us, rotation, time_rotating
from dsa_triton.registry import Cost
from dsa_triton.moe.fused_moe_gemm_spec import SPEC
from dsa_triton.moe.moe_forward_spec import SPEC as LAYER

MIN_COPY_FRACTION, GOAL_COPY_FRACTION, MIN_SPEEDUP = 0.5, 0.75, 2.0
STEADY_CALLS = 8  # calls per CUDA graph of the steady_us column


def verdict(fraction: float, speedup: float) -> str:
    if speedup >= MIN_SPEEDUP and fraction >= GOAL_COPY_FRACTION:
        return "goal"
    return "pass" if speedup >= MIN_SPEEDUP and fraction >= MIN_COPY_FRACTION else "fail"


def copy_fraction(nbytes: float, us: float, ceilings) -> float:
    """Fraction of the measured copy bandwidth at which ``nbytes`` move in ``us`` (NaN when nothing was timed)."""
    return floor_us(Cost(bytes=nbytes), ceilings)[0] / us if us > 0 else float("nan")


def fused_kernel_us(config: dict, sets: list) -> float:
    """Device microseconds per call of the fused GEMM kernel alone (torch.profiler over two passes of ``sets``):
    without the launch path and ``X_COPY=1``'s activation copy. 0 when the profiler saw no such kernel."""
    calls = 2 * len(sets)
    gemm = [e for e in profiled_kernels(lambda s: SPEC.run(s, config), sets, calls)
            if e.key.startswith("_fused_moe_kernel")]
    return sum(e.self_device_time_total for e in gemm) / calls


def moe_decode_report(device, ceilings) -> list[dict]:
    device = torch.device(device)
    rows, keep = [], None
    for shape in SPEC.bench_shapes("decode", ceilings is not None):
        check_inputs = SPEC.make_inputs("decode", shape, device, 1234)
        keep = check_inputs["weights"]  # one weight set per (N, K) for all T (freed when the next is made)
        config = SPEC.launch_config("decode", shape, device)
        error = SPEC.compare(SPEC.run(check_inputs, config), SPEC.reference(check_inputs))
        sets = rotation(lambda i: SPEC.make_inputs("decode", shape, device, i), SPEC.cost("decode", shape).bytes, device)
        fused_us = time_rotating(lambda s: SPEC.run(s, config), sets, device)
        bf16_us = time_rotating(SPEC.baseline, sets, device)
        active = sum(len(s["active"]) for s in sets) / len(sets)
        mxfp4_bytes = active * shape["N"] * shape["K"] * 17 / 32
        row = {"gemm": "gate_up" if shape["gather"] else "down", "T": shape["T"], "N": shape["N"], "K": shape["K"],
               "active_experts": active, "mxfp4_MB": mxfp4_bytes / 1e6, "fused_us": fused_us, "bf16_us": bf16_us,
               "speedup_vs_bf16": bf16_us / fused_us}
        if ceilings is not None:
            fraction = copy_fraction(mxfp4_bytes, fused_us, ceilings)
            row.update(copy_fraction=fraction, verdict=verdict(fraction, row["speedup_vs_bf16"]))
            try:
                fused_graph_us = graph_time_us(lambda s: SPEC.run(s, config), sets, device)
                bf16_graph_us = graph_time_us(SPEC.baseline, sets, device)
                steady_us = graph_time_us(lambda s: SPEC.run(s, config), sets, device, calls_per_graph=STEADY_CALLS)
            except RuntimeError as exc:  # a capture failure must not hide the eager figures
                row["graph_error"] = error_text(exc)
            else:
                fraction_graph = copy_fraction(mxfp4_bytes, fused_graph_us, ceilings)
                row.update(fused_graph_us=fused_graph_us, bf16_graph_us=bf16_graph_us,
                           speedup_graph=bf16_graph_us / fused_graph_us, copy_fraction_graph=fraction_graph,
                           verdict_graph=verdict(fraction_graph, bf16_graph_us / fused_graph_us),
                           steady_us=steady_us, copy_fraction_steady=copy_fraction(mxfp4_bytes, steady_us, ceilings))
            kernel_us = fused_kernel_us(config, sets)
            row.update(kernel_us=kernel_us, copy_fraction_kernel=copy_fraction(mxfp4_bytes, kernel_us, ceilings))
        row["config"] = json.dumps(config)
        row["check"] = error or "ok"
        rows.append(row)
        del check_inputs, sets
    del keep
    return rows


# -- report: where the eager decode layer's time goes ----------------------------------------------
# aten ops that read device memory on the host (a sync on CUDA) or give data-dependent shapes (not capturable)
SYNCING_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                         "unique_dim", "unique_consecutive", "repeat_interleave", "bincount", "equal", "is_nonzero",
                         "allclose", "histc", "masked_scatter"})


class AtenOpCounter(TorchDispatchMode):
    """Counts the aten ops run inside ``with AtenOpCounter() as c:`` by name (``c.ops``); ``c.syncing()``: those
    in :data:`SYNCING_OPS`."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def syncing(self) -> dict[str, int]:
        return {op: n for op, n in self.ops.items() if op in SYNCING_OPS}


def _host_issue_us(call, sets, device) -> float:
    """Median host microseconds to issue one call, the GPU not waited for between the calls of a batch
    (a hidden sync shows up as device time here). A few calls only in the interpreter."""
    batches, per_batch = (20, 4) if device.type == "cuda" else (3, 1)
    samples = []
    for i in range(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(per_batch):
            call(sets[i % len(sets)])
        samples.append((time.perf_counter() - start) / per_batch * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples)


def profiled_kernels(call, sets, calls: int) -> list:
    """torch.profiler's CUDA kernels (key averages) over ``calls`` calls cycling through ``sets`` (weights and
    inputs not left in L2 by the call before), after one warm-up call per set."""
    from torch.profiler import ProfilerActivity, profile

    for s in sets:
        call(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            call(sets[i % len(sets)])
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]


def _device_profile(call, sets, calls: int = 5, top: int = 5) -> dict:
    """Summed kernel time per call, kernels per call and the longest ones (:func:`profiled_kernels`)."""
    kernels = profiled_kernels(call, sets, calls)
    longest = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {"device_us": sum(e.self_device_time_total for e in kernels) / calls,
            "kernels_per_call": sum(e.count for e in kernels) / calls,
            "longest_kernels_us": "; ".join(f"{e.key[:48]} {e.self_device_time_total / calls:.1f}" for e in longest)}


def moe_layer_decode_report(device, ceilings) -> list[dict]:
    """Report ``moe_layer_decode``: per ``moe_forward`` decode bench shape (GPU: DeepSeek-V3.2, T = 1 and 64), the
    eager median, the host time to issue one call, the aten ops and syncing ops of one call and, on CUDA, the
    summed kernel time of one call (torch.profiler), its longest kernels and the CUDA-graph replay median (the
    capture itself shows the path has no sync). Eager well above both host and device time means a stall."""
    device = torch.device(device)
    rows = []
    for shape in LAYER.bench_shapes("decode", ceilings is not None):
        config = LAYER.launch_config("decode", shape, device)
        sets = rotation(lambda i: LAYER.make_inputs("decode", shape, device, i), LAYER.cost("decode", shape).bytes,
                        device)
        call = lambda s: LAYER.run(s, config)  # noqa: E731
        row = {"T": shape["T"], "path": config["path"], "eager_us": time_rotating(call, sets, device),
               "host_issue_us": _host_issue_us(call, sets, device)}
        with AtenOpCounter() as counter:
            call(sets[0])
        row.update(aten_ops=sum(counter.ops.values()), syncing_ops=str(counter.syncing() or "none"))
        if device.type == "cuda":
            row.update(_device_profile(call, sets))
            try:
                row["graph_us"] = graph_time_us(call, sets, device)
            except RuntimeError as exc:  # a capture failure must not hide the eager figures
                row["graph_error"] = error_text(exc)
        rows.append(row)
        del sets
    return rows
