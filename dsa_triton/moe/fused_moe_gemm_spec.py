"""Registry entry ``fused_moe_gemm``: :func:`.fused_moe_gemm.fused_moe_gemm` (the decode path's grouped GEMM on MXFP4
weights dequantized in registers) against :func:`.fused_moe_gemm_reference.fused_moe_gemm_torch`; baseline: cuBLAS bf16
``mm`` per active expert on pre-dequantized weights.

Config space: :data:`SPACE`. Shape: ``T`` (bucketed), ``E``, ``top_k``, ``N``, ``K``; ``gather`` (1: gate_up, rows
gather tokens; 0: down, sorted rows) is an input detail outside the key.
"""
from __future__ import annotations

import sys

import weakref

import torch

from .. import registry
from ..registry import Cost
from . import fused_moe_gemm, fused_moe_gemm_kernels, permute
from .formats import class_major
from .fused_moe_gemm import expected_active_experts
from .fused_moe_gemm_reference import fused_moe_gemm_torch
from .mxfp4 import mxfp4_dequantize
from .mxfp4_spec import random_mxfp4
from .permute import sort_by_expert
from .sort_and_align_spec import random_routing

def random_experts(experts: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``(blocks [E, N, K/32, 16], scales [E, N, K/32])`` with scales 2^-8 .. 2^-4: weights of a
    trained layer's magnitude (the inputs of :class:`ExpertWeights`)."""
    blocks, scales = random_mxfp4((experts, n), k, device, seed=7, spread=2)
    return blocks, scales - 6


class ExpertWeights:
    """Random MXFP4 expert weights shared by every input set of one shape (they dwarf the L2 anyway) and,
    for the baselines, their dense copy made on first use. Held weakly: freed with the last input set."""

    _live: "weakref.WeakValueDictionary[tuple, ExpertWeights]" = weakref.WeakValueDictionary()

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        self.blocks, self.scales = blocks, scales
        self._dense: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def random(cls, experts: int, n: int, k: int, device: torch.device) -> "ExpertWeights":
        """The weights of ``experts`` x ``[n, k]`` on ``device`` (:func:`random_experts`), made
        once while an input set holds them."""
        key = (experts, n, k, str(device))
        found = cls._live.get(key)
        if found is None:
            found = cls(*random_experts(experts, n, k, device))
            cls._live[key] = found
        return found

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """``[E, N, K]`` in ``dtype`` (the MXFP4 dequantize kernel), kept for later calls."""
        if dtype not in self._dense:
            self._dense[dtype] = mxfp4_dequantize(self.blocks, self.scales, dtype)
        return self._dense[dtype]


def _cost(phase, shape) -> Cost:
    """Floor: the MXFP4 bytes of the experts expected to get rows (4.25 bits per weight), x once, y once."""
    rows = shape["T"] * shape["top_k"]
    weight_bytes = expected_active_experts(shape) * shape["N"] * shape["K"] * 17 / 32
    x_bytes = (shape["T"] if shape.get("gather", 1) else rows) * shape["K"] * 2
    return Cost(bytes=weight_bytes + x_bytes + rows * shape["N"] * 2, flops=2.0 * rows * shape["N"] * shape["K"])


def _bench_shapes(phase, gpu):
    if gpu:  # DeepSeek-V3.2: 256 experts, top-8, hidden 7168, moe_intermediate 2048
        return [{"T": t, "E": 256, "top_k": 8, "N": n, "K": k, "gather": g}
                for n, k, g in ((4096, 7168, 1), (7168, 2048, 0)) for t in (1, 8, 32, 128)]
    return [{"T": 3, "E": 5, "top_k": 2, "N": 48, "K": 96, "gather": 1},
            {"T": 1, "E": 7, "top_k": 3, "N": 40, "K": 64, "gather": 0}]


def _make_inputs(phase, shape, device, seed):
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    weights, ids = random_routing(shape["T"], shape["E"], shape["top_k"], device, gen)
    sort = sort_by_expert(ids, weights, shape["E"], check_ids=False)
    gather = bool(shape.get("gather", 1))
    rows = shape["T"] if gather else sort.num_rows
    x = torch.randn(rows, shape["K"], generator=gen, device=device).to(dtype)
    bounds = sort.expert_offsets.tolist()
    active = [(e, a, b) for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    # the down GEMM gets class-major rows, as the layer's swiglu writes them; the baseline reads x_rows
    return {"x": x if gather else class_major(x), "x_rows": x, "sort": sort, "gather": gather, "active": active,
            "weights": ExpertWeights.random(shape["E"], shape["N"], shape["K"], device)}


def _run(inputs, config):
    w = inputs["weights"]
    return fused_moe_gemm.fused_moe_gemm(inputs["x"], inputs["sort"], w.blocks, w.scales, gather_tokens=inputs["gather"],
                                    config=config)


def _reference(inputs):
    w = inputs["weights"]
    return fused_moe_gemm_torch(inputs["x"], inputs["sort"], w.blocks, w.scales, inputs["gather"])


def compare_rows(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-2) -> str | None:
    """None when ``out`` matches ``ref`` (fp32) to ``rtol`` of the reference's largest magnitude."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.float()
    if not torch.isfinite(out).all():
        return "non-finite values in the output"
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return None if err <= rtol * scale + 1e-3 else f"max abs error {err:.3g} vs reference max {scale:.3g}"


def bf16_expert_loop(inputs) -> torch.Tensor:
    """Baseline: per active expert, ``torch.mm`` (cuBLAS) on pre-dequantized bf16 weights."""
    x = inputs["x_rows"]
    w = inputs["weights"].dense(x.dtype)
    sort = inputs["sort"]
    rows = x[sort.sorted_token] if inputs["gather"] else x
    y = rows.new_empty(sort.num_rows, w.shape[1])
    for e, start, end in inputs["active"]:
        torch.mm(rows[start:end], w[e].t(), out=y[start:end])
    return y


SPEC = registry.register(registry.KernelSpec(
    launch=fused_moe_gemm.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_rows,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=bf16_expert_loop,
    baseline_name="cuBLAS bf16 mm per active expert (pre-dequantized)",
    model_dims=lambda m: [{"E": m.experts, "top_k": m.top_k, **g} for g in m.expert_gemms()],
    count_roles={"T": "tokens"},
    source_modules=(fused_moe_gemm, fused_moe_gemm_kernels, sys.modules[__name__], permute),
))
