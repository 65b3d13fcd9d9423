"""Registry entry ``moe_forward``: which grouped-GEMM path :func:`.layer.moe_forward` takes per shape (``fused``: MXFP4
dequantized in registers; ``workspace``: online MXFP4 -> FP8 and FP8 tensor cores), with the whole layer as its
problem; reference :func:`.moe_forward_reference.moe_forward_torch`; baseline the same layer in torch on pre-dequantized
bf16 experts.

Shape: ``T`` (bucketed), ``E``, ``top_k``, ``hidden``, ``I`` (bench shapes add DeepSeek's ``n_group`` /
``topk_group``, read by the inputs only).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .. import registry
from ..registry import Cost
from . import (activation, formats, fused_moe_gemm, fused_moe_gemm_kernels, fused_moe_gemm_spec, moe_forward, permute,
               route_topk, route_topk_kernels, route_topk_spec, sort_and_align, sort_and_align_kernels,
               sort_and_align_spec)
from .activation_reference import swiglu_torch
from .fused_moe_gemm_spec import ExpertWeights
from .fused_moe_gemm import expected_active_experts
from .moe_forward_reference import moe_forward_torch
from .permute import combine_rows, sort_by_expert
from .routing import RoutingConfig, route

def _routing_of(shape) -> RoutingConfig:
    return RoutingConfig("deepseek", top_k=shape["top_k"], n_group=shape.get("n_group", 1),
                         topk_group=shape.get("topk_group", 1), routed_scaling_factor=2.5)


def _make_inputs(phase, shape, device, seed):
    """A DeepSeek-style layer: random MXFP4 experts (shared by every seed), router, bias, bf16 shared expert."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    e, h, i = shape["E"], shape["hidden"], shape["I"]
    dense = lambda *size: (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5).to(dtype)
    return {"x": torch.randn(shape["T"], h, generator=gen, device=device).to(dtype),
            "router_weight": torch.randn(e, h, generator=gen, device=device) * h ** -0.5,
            "router_bias": torch.randn(e, generator=gen, device=device) * 0.1,
            "gate_up": ExpertWeights.random(e, 2 * i, h, device), "down": ExpertWeights.random(e, h, i, device),
            "shared_gate_up": dense(2 * i, h), "shared_down": dense(h, i), "routing": _routing_of(shape)}


def _layer_args(inputs):
    gu, dn = inputs["gate_up"], inputs["down"]
    return ((inputs["x"], inputs["router_weight"], gu.blocks, gu.scales, dn.blocks, dn.scales),
            dict(routing=inputs["routing"], router_bias=inputs["router_bias"],
                 shared_gate_up=inputs["shared_gate_up"], shared_down=inputs["shared_down"]))


def _run(inputs, config):
    args, kwargs = _layer_args(inputs)
    return moe_forward.moe_forward(*args, **kwargs, config=config)


def _reference(inputs):
    args, kwargs = _layer_args(inputs)
    return moe_forward_torch(*args, **kwargs)


def compare_layer(out: torch.Tensor, ref: torch.Tensor, max_relative: float = 0.06) -> str | None:
    """None when ``||out - ref|| / ||ref|| <= max_relative``. Loose enough for the workspace path, which rounds
    the activations to e4m3 (about 4% relative error against the fp32 oracle; the fused path is near 0.05%)."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.float()
    if not torch.isfinite(out).all():
        return "non-finite values in the output"
    error = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item() if ref.numel() else 0.0
    return None if error <= max_relative else f"relative error {error:.3g} over {max_relative}"


def bf16_layer(inputs) -> torch.Tensor:
    """Baseline: the same layer in plain torch on pre-dequantized bf16 experts (cuBLAS mm per active expert)."""
    x = inputs["x"]
    logits = F.linear(x.float(), inputs["router_weight"])
    weights, ids = route(logits, inputs["routing"], inputs["router_bias"], check_values=False)
    sort = sort_by_expert(ids, weights, inputs["gate_up"].blocks.shape[0], check_ids=False)
    rows = x[sort.sorted_token.long()]
    w1, w2 = inputs["gate_up"].dense(x.dtype), inputs["down"].dense(x.dtype)
    y = rows.new_empty(rows.shape[0], x.shape[1])
    bounds = sort.expert_offsets.tolist()  # the host needs the row ranges: one sync, as every torch loop has
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b > a:
            y[a:b] = swiglu_torch(rows[a:b] @ w1[e].t()) @ w2[e].t()
    shared = moe_forward.shared_expert(x, inputs["shared_gate_up"], inputs["shared_down"], act=swiglu_torch)
    return combine_rows(y, sort, add=shared).to(x.dtype)


def _cost(phase, shape) -> Cost:
    """Floor: the MXFP4 bytes of the experts expected to get rows, router and shared expert once, x and y."""
    t, h, i = shape["T"], shape["hidden"], shape["I"]
    rows = t * shape["top_k"]
    expert_bytes = expected_active_experts(shape) * 3 * h * i * 17 / 32
    dense_bytes = shape["E"] * h * 4 + 3 * h * i * 2 + 2 * t * h * 2
    flops = 2.0 * (rows + t) * 3 * h * i + 2.0 * t * h * shape["E"]
    return Cost(bytes=expert_bytes + dense_bytes, flops=flops)


def _bench_shapes(phase, gpu):
    if gpu:  # DeepSeek-V3.2
        tokens = (1, 64) if phase == "decode" else (4096,)
        return [{"T": t, "E": 256, "top_k": 8, "hidden": 7168, "I": 2048, "n_group": 8, "topk_group": 4}
                for t in tokens]
    return [{"T": 3 if phase == "decode" else 6, "E": 6, "top_k": 2, "hidden": 64, "I": 32, "n_group": 3,
             "topk_group": 2}]


SPEC = registry.register(registry.KernelSpec(
    launch=moe_forward.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_layer,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=bf16_layer,
    baseline_name="torch layer, cuBLAS bf16 mm per active expert (pre-dequantized)",
    model_dims=lambda m: [{"E": m.experts, "top_k": m.top_k, "hidden": m.hidden, "I": m.moe_inter,
                           "n_group": m.n_group, "topk_group": m.topk_group}],
    count_roles={"T": "tokens"},
    source_modules=(moe_forward, sys.modules[__name__], formats, activation, fused_moe_gemm, fused_moe_gemm_kernels, fused_moe_gemm_spec, permute,
                    route_topk, route_topk_kernels, route_topk_spec, sort_and_align, sort_and_align_kernels,
                    sort_and_align_spec),
))
