"""MoE layer oracle: the loop-per-token router oracle, then one expert at a time on weights dequantized by
the MXFP4 reference, everything in fp32 (no intermediate rounding)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .mxfp4_reference import mxfp4_dequantize_torch
from .routing_reference import route_torch


def _swiglu_fp32(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def moe_forward_torch(x, router_weight, gate_up_blocks, gate_up_scales, down_blocks, down_scales, *, routing,
                      router_bias=None, shared_gate_up=None, shared_down=None) -> torch.Tensor:
    """Same arguments as :func:`.layer.moe_forward`; returns ``y[T, H]`` fp32."""
    weights, ids = route_torch(F.linear(x.float(), router_weight.float()), routing, router_bias)
    return moe_experts_torch(x, ids, weights, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                             shared_gate_up=shared_gate_up, shared_down=shared_down)


def moe_experts_torch(x, topk_ids, topk_weights, gate_up_blocks, gate_up_scales, down_blocks, down_scales, *,
                      shared_gate_up=None, shared_down=None) -> torch.Tensor:
    """Same arguments as :func:`.layer.moe_experts` (``topk_weights`` None: ones); returns ``y[T, H]`` fp32."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in topk_ids.unique().tolist():
        token, choice = (topk_ids == e).nonzero(as_tuple=True)
        w1 = mxfp4_dequantize_torch(gate_up_blocks[e], gate_up_scales[e])
        w2 = mxfp4_dequantize_torch(down_blocks[e], down_scales[e])
        y = _swiglu_fp32(xf[token] @ w1.t()) @ w2.t()
        out.index_add_(0, token, y if topk_weights is None else y * topk_weights[token, choice].float().unsqueeze(1))
    if shared_gate_up is not None:
        out += _swiglu_fp32(xf @ shared_gate_up.float().t()) @ shared_down.float().t()
    return out
