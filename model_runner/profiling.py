"""Profile mode: where the time of one step goes (``torch.profiler``).

:func:`profile_call` runs a callable under the profiler and returns a :class:`Profile`: on a GPU, each kernel's GPU
time (kernels replayed from a CUDA graph included), the union of kernel intervals ("busy") and the GPU idle
fraction of the step's wall time (host call to synchronize); on a CPU, the CPU time of each op the step called
directly (no idle fraction). :func:`op_group` folds kernel names into the runner's ops (append, compress, indexer,
top-k, attention, MoE, ...). :class:`StepProfiler` profiles the first decode step and the first step with a prefill
chunk of an engine run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "model_runner.step"
# kernel-name fragments of each op, first match wins (Triton kernels by their function names, so the MoE's
# `_fused_gemm_kernel` before torch's "gemm"; torch's GEMM libraries by theirs)
OP_GROUPS = (
    ("append", ("append_kernel",)),
    ("compress", ("compress_kernel",)),  # DeepSeek-V4's compressors
    ("indexer", ("logits_kernel", "_select_pages_kernel")),
    ("top-k", ("topk_",)),
    ("attention", ("_sparse_attention_fwd", "_combine_splits")),
    ("moe", ("_route_kernel", "_permute_kernel", "_fused_moe_kernel", "_grouped_gemm_kernel", "_fused_gemm_kernel",
             "_quantize_rows_kernel", "_convert_kernel")),
    ("swiglu", ("_swiglu_kernel",)),
    ("fp8 linear", ("fp8_linear_kernel",)),
    ("gemm (torch)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_", "dot_kernel")),
)


def op_group(name: str) -> str:
    """The op a kernel (or CPU op) name belongs to; "torch other" for the rest (norms, RoPE, copies, ...)."""
    lower = name.lower()
    for group, fragments in OP_GROUPS:
        if any(f.lower() in lower for f in fragments):
            return group
    return "torch other"


@dataclass
class Profile:
    """One profiled call: ``ops`` ``{name: (calls, microseconds)}`` (GPU kernel time on a GPU, CPU op time on a
    CPU), ``wall_us`` the step's host span, ``busy_us`` the GPU's busy time in it (None on a CPU)."""
    device: str
    wall_us: float
    busy_us: float | None
    ops: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def idle_fraction(self) -> float | None:
        if self.busy_us is None or self.wall_us <= 0:
            return None
        return max(0.0, 1.0 - self.busy_us / self.wall_us)

    @property
    def op_us(self) -> float:
        return sum(us for _, us in self.ops.values())

    def groups(self) -> dict[str, float]:
        """Microseconds by :func:`op_group`, largest first."""
        out: dict[str, float] = {}
        for name, (_, us) in self.ops.items():
            out[op_group(name)] = out.get(op_group(name), 0.0) + us
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def lines(self, title: str, top: int = 12) -> list[str]:
        what = "GPU kernel" if self.busy_us is not None else "CPU op"
        idle = "" if self.idle_fraction is None else f", GPU idle {100 * self.idle_fraction:.1f}% of the wall time"
        lines = [f"profile of {title}: wall {self.wall_us / 1e3:.3f} ms, {what} time {self.op_us / 1e3:.3f} ms{idle}"]
        total = self.op_us or 1.0
        lines += [f"  {group:<14} {us / 1e3:9.3f} ms  {100 * us / total:5.1f}%" for group, us in self.groups().items()]
        ranked = sorted(self.ops.items(), key=lambda kv: -kv[1][1])[:top]
        lines += [f"    {name[:70]:<70} x{calls:<4} {us / 1e3:9.3f} ms" for name, (calls, us) in ranked]
        return lines


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_call(fn, device) -> tuple[object, Profile]:
    """``(fn(), its Profile)``; ``device`` decides whether GPU kernels are recorded (and synchronized on)."""
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        with record_function(STEP_RANGE):
            out = fn()
            if cuda:
                torch.cuda.synchronize()
    events = prof.events()
    step = next(e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU)
    result = Profile("cuda" if cuda else "cpu", step.time_range.elapsed_us(), None)
    if cuda:
        chosen = [e for e in events if e.device_type == DeviceType.CUDA and e.name != STEP_RANGE]
        result.busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in chosen])
    else:
        chosen = [e for e in events if e.cpu_parent is not None and e.cpu_parent.id == step.id]
    for e in chosen:
        calls, us = result.ops.get(e.name, (0, 0.0))
        result.ops[e.name] = (calls + 1, us + e.time_range.elapsed_us())
    return out, result


class StepProfiler:
    """Profiles the first decode step and the first step with a prefill chunk ("prefill") of an engine run;
    ``profiles`` ``{"decode" | "prefill": (step tokens, Profile)}``."""

    def __init__(self):
        self.profiles: dict[str, tuple[int, Profile]] = {}

    @staticmethod
    def kind(step) -> str:
        return "decode" if step.kind == "decode" else "prefill"

    def wants(self, step) -> bool:
        return self.kind(step) not in self.profiles

    def run(self, step, fn, device):
        out, prof = profile_call(fn, device)
        self.profiles[self.kind(step)] = (step.tokens, prof)
        return out

    def lines(self) -> list[str]:
        out = []
        for kind, (tokens, prof) in self.profiles.items():
            out += prof.lines(f"a {kind} step ({tokens} tokens)")
        return out
