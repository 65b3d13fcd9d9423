"""Routing oracle: one token at a time, written from the DeepSeek-V3 and gpt-oss model code, in float64.

Same contracts as :mod:`.routing` (weights ``[T, top_k]``, ids ``[T, top_k]``, descending selection score),
computed without batched masking tricks so the tests compare two independent formulations. Exact ties: the lowest
expert (and group) first, Python's stable sort. Non-finite input as :mod:`.routing` with ``check_values=False``: a
NaN selection key ranks as -inf (ties in a fixed order), a weight computed from a NaN is NaN.
"""
from __future__ import annotations

import math

import torch


def _rank(value: float) -> float:
    """A sort key, descending: NaN ranks as -inf."""
    return math.inf if math.isnan(value) else -value


def deepseek_topk_torch(logits, bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0):
    """``logits[T, E]``, ``bias[E]`` or None -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)``."""
    num_experts = logits.shape[1]
    group_size = num_experts // n_group
    weights, ids = [], []
    for row in logits.double().tolist():
        score = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(score)]
        key = [-math.inf if math.isnan(c) else c for c in choice]
        groups = [key[g * group_size:(g + 1) * group_size] for g in range(n_group)]
        group_rank = sorted(range(n_group), key=lambda g: _rank(sum(sorted(groups[g], reverse=True)[:2])))
        allowed = sorted(e for g in group_rank[:topk_group] for e in range(g * group_size, (g + 1) * group_size))
        chosen = sorted(allowed, key=lambda e: -key[e])[:top_k]  # (equal keys: the lowest expert first)
        w = [math.nan if math.isnan(choice[e]) else score[e] for e in chosen]
        total = sum(w) if norm_topk_prob else 1.0
        weights.append([(v / total if total else math.nan) * routed_scaling_factor for v in w])  # 0 / 0: NaN
        ids.append(chosen)
    return _pack(weights, ids, top_k, logits.device)


def softmax_topk_torch(logits, top_k, renormalize=True):
    """``logits[T, E]`` -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)``."""
    weights, ids = [], []
    for row in logits.double().tolist():
        chosen = sorted(range(len(row)), key=lambda e: _rank(row[e]))[:top_k]
        pool = chosen if renormalize else range(len(row))
        if any(math.isnan(row[e]) for e in pool):
            weights.append([math.nan] * top_k)
            ids.append(chosen)
            continue
        peak = max(row[e] for e in pool)
        total = sum(math.exp(row[e] - peak) for e in pool)
        weights.append([math.exp(row[e] - peak) / total for e in chosen])
        ids.append(chosen)
    return _pack(weights, ids, top_k, logits.device)


def route_torch(logits, routing, bias=None):
    """The oracle of :func:`.routing.route` for a :class:`.routing.RoutingConfig`."""
    if routing.mode == "deepseek":
        return deepseek_topk_torch(logits, bias, routing.top_k, routing.n_group, routing.topk_group,
                                   routing.norm_topk_prob, routing.routed_scaling_factor)
    return softmax_topk_torch(logits, routing.top_k, routing.norm_topk_prob)


def _pack(weights, ids, top_k, device):
    return (torch.tensor(weights, dtype=torch.float32, device=device).reshape(len(ids), top_k),
            torch.tensor(ids, dtype=torch.int32, device=device).reshape(len(ids), top_k))
