"""Registry entry ``moe_fused_gemm``: :func:`.fused_moe.fused_moe_gemm` (the decode path's grouped GEMM on MXFP4
weights dequantized in registers) against :func:`.fused_moe_reference.fused_moe_gemm_torch`; baseline: cuBLAS bf16
``mm`` per active expert on pre-dequantized weights.

Config space: :data:`SPACE`. Shape: ``T`` (bucketed), ``E``, ``top_k``, ``N``, ``K``; ``gather`` (1: gate_up, rows
gather tokens; 0: down, sorted rows) is an input detail outside the key.
"""
from __future__ import annotations

import math
import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, bucket
from . import fused_moe, fused_moe_kernels, permute
from .activation_reference import class_major
from .fused_moe_reference import fused_moe_gemm_torch
from .mxfp4_spec import random_mxfp4
from .permute import sort_by_expert
from .sort_and_align_spec import random_routing

GPU_SMS = 132  # H200: the default config splits K until the grid has a program per SM


def random_experts(experts: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``(blocks [E, N, K/32, 16], scales [E, N, K/32])`` with scales 2^-8 .. 2^-4: weights of a
    trained layer's magnitude (the inputs of :class:`.fused_moe.ExpertWeights`)."""
    blocks, scales = random_mxfp4((experts, n), k, device, seed=7, spread=2)
    return blocks, scales - 6


SPACE = {
    "BLOCK_M": (8, 16, 32, 64),  # routed rows per block, padded (8: mma.sync m16n8k16; 16+: wgmma where it fits)
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (64, 128, 256, 512),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5, 6),
    # [rows, K] activations: 1 copied class-major per call (the GEMM kernel is faster on class-major rows); 0 classes
    # split in registers (one kernel less, a slower GEMM kernel). No effect on class-major activations (the
    # registry's down-GEMM inputs, as the layer passes them)
    "X_COPY": (0, 1),
}


def _constraint(config, shape) -> str | None:
    bm, bn, bk, warps = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_warps"]
    if bm > max(16, bucket(shape["T"] * shape["top_k"])):
        return "BLOCK_M exceeds the routed rows"
    if bn > max(16, bucket(shape["N"])) or bk > max(64, bucket(shape["K"])):
        return "BLOCK_N or BLOCK_K exceeds the matrix"
    if config["SPLIT_K"] > cdiv(shape["K"], bk):
        return "SPLIT_K leaves a split without a K tile"
    if config["num_stages"] * (2 * bk * bm + bn * bk // 2 + bn * bk // 32) > 200 * 1024:
        return "pipelined x, weight and scale tiles exceed 200 KB of shared memory"
    if bn * bk > 256 * 32 * warps or bn * bm > 64 * 32 * warps:
        return "tile too large for the registers of num_warps warps"
    if bn * bk < 8 * 32 * warps or bn * bm < 128 * warps:
        return "tile too small for num_warps warps (a 16 x 8 mma tile and pairs of code quarters per thread)"
    return None


def expected_active_experts(shape) -> float:
    """Experts that get at least one of T * top_k routes when each token picks top_k distinct ones uniformly."""
    e, k, t = shape["E"], shape["top_k"], shape["T"]
    return e * (1.0 - (1.0 - k / e) ** t)


def _default(phase, shape):
    """8-row blocks (mma.sync m16n8k16) while experts average up to 8 rows, 64 x 512 weight tiles, 4 warps,
    3 stages; K split only when the grid would leave SMs idle.

    Decode is bound by the MXFP4 bytes: 16-row blocks run on wgmma, which ptxas serializes (the A registers are
    rewritten between wgmmas), and narrower weight tiles or a split K add work without reading the weights faster.
    N under 64 narrows the weight tile to N (16 or 32 columns), and the warps to those that keep 128 of the tile's
    rows x columns each (the constraint's 16 x 8 mma tile per warp): 2 or more, so 16 columns take 16-row blocks.
    """
    routed = shape["T"] * shape["top_k"]
    per_expert = routed / max(expected_active_experts(shape), 1.0)
    block_m = 8 if per_expert <= 8 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block_n, block_k = min(64, max(16, bucket(shape["N"]))), min(512, max(64, bucket(shape["K"])))
    block_m = max(block_m, 256 // block_n)  # a 16 x 8 mma tile for each of 2 warps at least
    warps = min(4, block_n * block_m // 128)
    blocks = expected_active_experts(shape) * math.ceil(per_expert / block_m)
    if block_m == 64:  # 3 stages of 64 x 512 x tiles exceed the shared memory
        block_k = min(block_k, 256)
    programs = blocks * cdiv(shape["N"], block_n)
    split = 1
    while programs * split < GPU_SMS and 2 * split <= min(8, cdiv(shape["K"], block_k)):
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": warps, "num_stages": 3, "X_COPY": 1}


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
            "weights": fused_moe.ExpertWeights.random(shape["E"], shape["N"], shape["K"], device)}


def _run(inputs, config):
    w = inputs["weights"]
    return fused_moe.fused_moe_gemm(inputs["x"], inputs["sort"], w.blocks, w.scales, gather_tokens=inputs["gather"],
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
    name="moe_fused_gemm",
    phases=("decode",),
    space=SPACE,
    default=_default,
    fixed_dims=("E", "top_k", "N", "K"),  # "gather" (1: gate_up, 0: down) is only an input detail
    bucketed_dims=("T",),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_rows,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=bf16_expert_loop,
    baseline_name="cuBLAS bf16 mm per active expert (pre-dequantized)",
    source_modules=(fused_moe, fused_moe_kernels, sys.modules[__name__], permute),
))
