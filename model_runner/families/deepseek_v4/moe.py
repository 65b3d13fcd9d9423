"""DeepSeek-V4's MoE layer (every layer), as transformers' ``DeepseekV4SparseMoeBlock``: routed MXFP4 experts plus one
shared expert, both with the SwiGLU clip (gate ``<= swiglu_limit``, up in ``[-limit, limit]``).

Routing (fp32): scores ``scoring_func(x @ gate^T)`` (sqrt(softplus) or sigmoid); the experts are ``tid2eid[token]``
in "hash_moe" layers, else the top-k of ``scores + bias``; their weights are the chosen scores renormalized to sum
1 (+1e-20), times ``routed_scaling_factor``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import clip_gate_up
from .config import HASH_MOE, DeepseekV4Config

SCORES = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid}


class MoE:
    """One layer's router (``gate.weight [E, D]`` fp32, ``gate.bias`` or ``gate.tid2eid``), routed experts
    (stacked MXFP4) and shared expert (``w1``, ``w3``, ``w2``)."""

    def __init__(self, c: DeepseekV4Config, w: dict, prefix: str, layer: int):
        self.c, self.hashed = c, c.mlp_layer_types[layer] == HASH_MOE
        self.router = w[prefix + "gate.weight"]
        self.choice = w[prefix + ("gate.tid2eid" if self.hashed else "gate.bias")]
        self.experts = [w[f"{prefix}experts.{name}"] for name in ("gate_up_blocks", "gate_up_scales", "down_blocks",
                                                                 "down_scales")]
        s = prefix + "shared_experts."
        gate, up = w[s + "w1.weight"], w[s + "w3.weight"]
        self.shared_gate_up = [torch.cat([gate, up])] if isinstance(gate, torch.Tensor) else [gate, up]
        self.shared_down = w[s + "w2.weight"]

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64."""
        scores = SCORES[self.c.scoring_func](F.linear(x.float(), self.router.float()))
        if self.hashed:
            ids = self.choice[input_ids]
        else:
            ids = torch.topk(scores + self.choice.float(), self.c.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.c.routed_scaling_factor, ids

    def shared(self, x: torch.Tensor, ops) -> torch.Tensor:
        parts = [ops.linear(x, w) for w in self.shared_gate_up]
        h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return ops.linear(ops.swiglu(clip_gate_up(h, self.c.swiglu_limit)), self.shared_down)

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, ops) -> torch.Tensor:
        weights, ids = self.route(x, input_ids)
        routed = ops.routed_experts(x, ids, weights, self.experts, self.c.swiglu_limit)
        return routed.to(x.dtype) + self.shared(x, ops)
