"""Registry entry of the prefill grouped GEMM, :func:`~dsa_triton.fp8_grouped_gemm`: inputs, cost and the cuBLAS FP8
baseline. Shape: ``M`` routed rows (bucketed), ``E`` experts, ``N`` output columns, ``K`` (exact).
"""
from __future__ import annotations

import sys
import weakref

import torch

from .. import registry
from ..registry import Cost
from . import fp8_grouped_gemm as op
from . import fp8_grouped_gemm_baselines, fp8_grouped_gemm_kernels, fp8_grouped_gemm_reference
from .fp8_grouped_gemm_reference import fp8_grouped_gemm_torch
from .fused_moe_gemm_spec import ExpertWeights
from .fused_moe_gemm_spec import compare_rows

def _bench_shapes(phase, gpu):
    if gpu:  # DeepSeek-V3.2, T = 4096 routed top-8 over 256 experts: gate_up and down
        return [{"M": 4096 * 8, "E": 256, "N": 4096, "K": 7168}, {"M": 4096 * 8, "E": 256, "N": 7168, "K": 2048}]
    return [{"M": 40, "E": 5, "N": 48, "K": 96}]


def random_offsets(rows: int, experts: int, device, gen: torch.Generator) -> torch.Tensor:
    """CSR offsets ``[E + 1]`` int32 of ``rows`` routed uniformly at random over ``experts``."""
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=gen, device=device), minlength=experts)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


_fp8_copies: "weakref.WeakKeyDictionary[ExpertWeights, tuple]" = weakref.WeakKeyDictionary()


def _make_inputs(phase, shape, device, seed):
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    offsets = random_offsets(shape["M"], shape["E"], device, gen)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # no bf16 tl.dot in the interpreter
    x = torch.randn(shape["M"], shape["K"], generator=gen, device=device).to(dtype)
    return {"x": x, "offsets": offsets, "weights": ExpertWeights.random(shape["E"], shape["N"], shape["K"], device),
            "spans": fp8_grouped_gemm_baselines.active_spans(offsets)}


def _run(inputs, config):
    """As the MoE layer calls it: offsets unchecked (the registers route then plans on the device: no host sync,
    so the tuner and the bench time it in CUDA graphs; the workspace routes still sync)."""
    w = inputs["weights"]
    return op.fp8_grouped_gemm(inputs["x"], inputs["offsets"], w.blocks, w.scales, config=config, check_values=False)


def _reference(inputs):
    w = inputs["weights"]
    return fp8_grouped_gemm_torch(inputs["x"], inputs["offsets"], w.blocks, w.scales)


def _baseline(inputs):
    """cuBLAS FP8 on an offline FP8 copy of every expert (per-tensor scales; x quantized beforehand, untimed)."""
    w, x = inputs["weights"], inputs["x"]
    if w not in _fp8_copies:
        _fp8_copies[w] = fp8_grouped_gemm_baselines.offline_fp8_experts(w.blocks, w.scales)
    if "xq" not in inputs:
        inputs["xq"] = fp8_grouped_gemm_baselines.tensorwise_fp8(x)
    if x.is_cuda:  # one cuBLAS grouped call: the faster FP8 baseline at the bench shapes (results/journal/moe.md)
        return fp8_grouped_gemm_baselines.scaled_grouped_mm(*inputs["xq"], *_fp8_copies[w], inputs["offsets"])
    xq, sx = inputs["xq"]
    xq_pad, pad, rows = fp8_grouped_gemm_baselines.padded_rows(xq, inputs["spans"])
    w8, s8 = _fp8_copies[w]
    return fp8_grouped_gemm_baselines.scaled_mm_loop(xq_pad, sx, w8, fp8_grouped_gemm_baselines.expert_scales(s8),
                                                     pad)[rows]


def _cost(phase, shape) -> Cost:
    """Floor: the MXFP4 bytes of every expert (all get rows at these sizes), x read once, y written once."""
    m, e, n, k = shape["M"], shape["E"], shape["N"], shape["K"]
    return Cost(bytes=e * n * k * 17 / 32 + m * k * 2 + m * n * 2, flops=2.0 * m * n * k, flop_dtype="fp8")


SPEC = registry.register(registry.KernelSpec(
    launch=op.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_rows,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_baseline,
    baseline_name="torch._scaled_grouped_mm (CPU: _scaled_mm per expert) on an offline FP8 copy, per-tensor scales",
    model_dims=lambda m: [{"E": m.experts, "N": g["N"], "K": g["K"]} for g in m.expert_gemms()],
    count_roles={"M": "rows"},
    source_modules=(op, fp8_grouped_gemm_kernels, sys.modules[__name__], fp8_grouped_gemm_reference,
                    fp8_grouped_gemm_baselines),
))
