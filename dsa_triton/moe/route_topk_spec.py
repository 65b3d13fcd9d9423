"""Registry entry ``route_topk``: :func:`.route_topk.route_topk` (one launch) against the torch routing of
:func:`.routing.route` (its reference and its baseline, ~14 kernel-launching ops).

Config space: ``num_warps``, ``TOKENS`` (tokens per program). Shape: ``T`` (bucketed), ``E``, ``top_k``,
``n_group``, ``topk_group``, ``softmax`` (1: softmax routing, whose groups are 1).
"""
from __future__ import annotations

import sys
from importlib import import_module

import torch

from .. import registry
from ..registry import Cost, KernelSpec
from . import route_topk_kernels
from .routing import RoutingConfig, route

op = import_module(".route_topk", __package__)  # the module: the package exports its function by that name


def _routing_of(shape) -> RoutingConfig:
    """DeepSeek-V3.2-style (scaling 2.5) or gpt-oss-style (softmax over the chosen) routing of a bench shape."""
    if shape["softmax"]:
        return RoutingConfig("softmax", top_k=shape["top_k"])
    return RoutingConfig("deepseek", top_k=shape["top_k"], n_group=shape["n_group"], topk_group=shape["topk_group"],
                         routed_scaling_factor=2.5)


def _make_inputs(phase, shape, device, seed) -> dict:
    """fp32 router logits (the layer's dtype) and, in DeepSeek mode, a correction bias."""
    gen = torch.Generator(device).manual_seed(seed)
    routing = _routing_of(shape)
    logits = torch.randn(shape["T"], shape["E"], generator=gen, device=device) * 2
    bias = None if shape["softmax"] else torch.randn(shape["E"], generator=gen, device=device) * 0.1
    return {"logits": logits, "routing": routing, "bias": bias}


def compare_routes(out, ref, rtol: float = 1e-6) -> str | None:
    """None when the ids are equal and every weight is within ``rtol`` of the reference's (relative)."""
    (weights, ids), (ref_weights, ref_ids) = out, ref
    if ids.shape != ref_ids.shape or weights.shape != ref_weights.shape:
        return f"shapes {tuple(weights.shape)} / {tuple(ids.shape)} != reference {tuple(ref_ids.shape)}"
    if weights.dtype != torch.float32 or ids.dtype != torch.int32:
        return f"dtypes {weights.dtype} / {ids.dtype}, expected float32 / int32"
    if not torch.equal(ids, ref_ids):
        return f"{int((ids != ref_ids).sum())} of {ids.numel()} ids differ"
    error = ((weights - ref_weights).abs() / ref_weights.abs().clamp_min(1e-30)).nan_to_num(float("inf"))
    worst = error.max().item() if error.numel() else 0.0
    return None if worst <= rtol else f"weights: relative error {worst:.3g} over {rtol}"


def _cost(phase, shape) -> Cost:
    """Logits (fp32) and bias read once, weights and ids written once."""
    t, e, k = shape["T"], shape["E"], shape["top_k"]
    return Cost(bytes=t * e * 4 + (0 if shape["softmax"] else e * 4) + t * k * 8)


def _bench_shapes(phase, gpu) -> list[dict]:
    deepseek = {"E": 256, "top_k": 8, "n_group": 8, "topk_group": 4, "softmax": 0}  # DeepSeek-V3.2
    gpt_oss = {"E": 128, "top_k": 4, "n_group": 1, "topk_group": 1, "softmax": 1}
    if gpu:
        return [{"T": t, **dims} for dims in (deepseek, gpt_oss) for t in (1, 64, 256)]
    return [{"T": 3, "E": 12, "top_k": 3, "n_group": 4, "topk_group": 2, "softmax": 0},
            {"T": 5, "E": 10, "top_k": 4, "n_group": 1, "topk_group": 1, "softmax": 1}]


def _torch_route(inputs):
    return route(inputs["logits"], inputs["routing"], inputs["bias"], check_values=False)


SPEC = registry.register(KernelSpec(
    launch=op.LAUNCH,
    make_inputs=_make_inputs,
    run=lambda inputs, config: op.route_topk(inputs["logits"], inputs["routing"], inputs["bias"], check_values=False,
                                             config=config),
    reference=_torch_route,
    compare=compare_routes,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_torch_route,
    baseline_name="routing.route (torch, ~14 ops)",
    model_dims=lambda m: [{"E": m.experts, "top_k": m.top_k, "n_group": m.n_group, "topk_group": m.topk_group,
                           "softmax": m.softmax}],
    count_roles={"T": "tokens"},
    source_modules=(op, route_topk_kernels, sys.modules[__name__]),
))
