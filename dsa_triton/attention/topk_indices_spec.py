"""Registry entry of :func:`~dsa_triton.topk_indices` (phase ``any``). Shape: ``T`` rows, ``L`` columns (both
bucketed), ``k`` (fixed).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost
from . import topk_indices, topk_indices_kernels, topk_indices_reference
from .topk_indices_reference import check_topk, topk_indices_torch

def _causal_lengths(T, L):
    """Row t of a chunk of T query tokens whose last token sees all L keys: ``L - (T - 1 - t)``, >= 0."""
    return (L - (T - 1) + torch.arange(T)).clamp(min=0)


def random_scores(lengths: torch.Tensor, L: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, L]`` fp32 N(0, 1) scores drawn from ``gen``, ``-inf`` past each row's length (``lengths [T]``)."""
    scores = torch.randn(lengths.shape[0], L, generator=gen, device=lengths.device)
    return scores.masked_fill_(torch.arange(L, device=lengths.device)[None, :] >= lengths[:, None], float("-inf"))


def _make_inputs(phase, shape, device, seed):
    """Random scores (-inf past each row's causal length), 64-token pages of up to 64 sequences."""
    T, L, k = shape["T"], shape["L"], shape["k"]
    g = torch.Generator(device=device).manual_seed(seed)
    lengths = _causal_lengths(T, L).to(device=device, dtype=torch.int32)
    scores = random_scores(lengths, L, g)
    page_size = 64
    seqs = max(1, min(T, 64))
    max_pages = cdiv(L, page_size)
    pages = torch.randperm(seqs * max_pages, generator=g, device=device).to(torch.int32)
    row_to_seq = (torch.arange(T, device=device) * seqs // max(T, 1)).to(torch.int32)
    return {"scores": scores, "k": k, "lengths": lengths, "block_table": pages.view(seqs, max_pages),
            "page_size": page_size, "row_to_seq": row_to_seq}


def _run(inputs, config):
    return topk_indices.topk_indices(**inputs, check_values=False, config=config)


def _reference(inputs):
    return topk_indices_torch(**inputs), inputs


def _compare(out, ref):
    ref_idx, inputs = ref
    return check_topk(out, ref_idx, **inputs)


def _cost(phase, shape):
    T, L, k = shape["T"], shape["L"], shape["k"]
    return Cost(bytes=4.0 * int(_causal_lengths(T, L).sum()) + 4.0 * T * k)


def _bench_shapes(phase, gpu):
    if gpu:
        return [{"T": 64, "L": 131072, "k": 2048}, {"T": 4096, "L": 131072, "k": 2048}, {"T": 1, "L": 131072, "k": 2048}]
    return [{"T": 3, "L": 4500, "k": 64}, {"T": 6, "L": 300, "k": 40}]


def _baseline(inputs):
    scores = inputs["scores"]
    return torch.topk(scores, min(inputs["k"], scores.shape[1]), dim=1)


SPEC = registry.register(registry.KernelSpec(
    launch=topk_indices.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_baseline,
    baseline_name="torch.topk",
    model_dims=lambda m: [{"k": m.index_topk}],
    count_roles={"T": "tokens", "L": "context"},
    source_modules=(topk_indices_kernels, topk_indices, sys.modules[__name__], topk_indices_reference),
))
