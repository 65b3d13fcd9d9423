"""Registry entry of :func:`~dsa_triton.topk_indices` (kernel ``topk_indices``, phase ``any``).

Config space: pass 1 (``SPLIT`` programs a row, ``TILE`` scores a step, ``WARPS``, ``GROUP`` scores a group
maximum, ``HIST_BITS``), the route threshold ``ROUTE_MIN``, pass 2 (``COLLECT_TILE``, ``COLLECT_WARPS``,
``CAP_K`` candidates a row in multiples of k) and pass 3 (``SEL_BITS``, ``SEL_TILE``, ``SEL_WARPS``); see
:mod:`.topk_kernels`. Shape: ``T`` rows, ``L`` columns (both bucketed), ``k`` (fixed).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost
from . import topk, topk_kernels, topk_reference
from .topk_reference import check_topk, topk_indices_torch

PHASE = "any"  # one kernel serves prefill and decode alike; T (bucketed) tells them apart
_SMS = 132  # H200: the default spreads the two passes over about 4 programs per SM

SPACE = {
    "SPLIT": (1, 2, 4, 8, 16, 32, 64, 128),  # programs per row in passes 1 and 2
    "TILE": (2048, 4096, 8192, 16384),  # scores per loop step of pass 1
    "WARPS": (1, 2, 4, 8),  # pass 1
    "GROUP": (8, 16, 32),  # scores per group maximum in pass 1
    # rows of at least ROUTE_MIN * k scores take passes 1-2 (64: only rows of 2 k GROUP); a low ROUTE_MIN keeps
    # mid-length rows of a mixed batch off the one-program route, which is slower for them
    "ROUTE_MIN": (2, 4, 8, 64),
    "HIST_BITS": (7, 8, 9, 10),  # pass 1 histogram: 2^HIST_BITS bins
    "COLLECT_TILE": (1024, 2048, 4096),  # pass 2
    "COLLECT_WARPS": (2, 4, 8),
    "CAP_K": (2, 4, 8),  # candidate buffer per row, in multiples of k
    "SEL_BITS": (4, 5, 6, 8),  # radix digit of pass 3
    "SEL_TILE": (512, 1024, 2048, 4096, 8192),  # pass 3 (ranks the last max(64, 8 * SEL_WARPS) at once)
    "SEL_WARPS": (2, 4, 8, 16),
}


def _constraint(config, shape):
    if config["TILE"] // config["GROUP"] < 128 * config["WARPS"]:
        return "TILE / GROUP must be >= 128 * WARPS (a thread owns 4 whole groups: 16-byte loads, no replicated maxima)"
    if config["ROUTE_MIN"] < 64 and config["TILE"] > 64 * 32 * config["WARPS"]:
        return ("the score histogram (ROUTE_MIN < 64) takes at most 64 scores per thread a tile: "
                "TILE <= 2048 * WARPS (more makes ptxas take minutes for sm_90)")
    if config["SPLIT"] > max(1, shape["L"] // max(config["TILE"], config["COLLECT_TILE"])):
        return "SPLIT leaves programs without a full tile"
    if config["COLLECT_TILE"] < 128 * config["COLLECT_WARPS"]:
        return "COLLECT_TILE must be >= 128 * COLLECT_WARPS (4 rows of one score per thread)"
    if not 128 <= config["SEL_TILE"] // config["SEL_WARPS"] <= 512:
        return "SEL_TILE must be 4 to 16 scores per thread (more spills registers, fewer wastes the sweeps)"
    return None


def _default(phase, shape):
    """Passes 1-2 with about a program per SM (smaller tiles when there are few scores); with few rows, wider
    collect programs and pass-3 programs of 8 warps; with many rows, 2048-score collect tiles and pass-3
    programs of 4 warps and ~100 registers (several per SM hide the latency of short sweeps). Chosen from a
    sweep of CUDA-graph times on an H200 (results/)."""
    T, L = shape["T"], shape["L"]
    tile, group, warps = (8192, 16, 4) if T * L >= 4 * _SMS * 8192 else (2048, 8, 2)
    split = 1
    while T * split < _SMS and (split * 2) * tile <= L and split * 2 <= max(SPACE["SPLIT"]):
        split *= 2
    few_rows = T <= 2 * _SMS
    return {"SPLIT": split, "TILE": tile, "WARPS": warps, "GROUP": group, "ROUTE_MIN": 2,
            "HIST_BITS": 8,
            "COLLECT_TILE": min(4096 if few_rows else 2048, tile), "COLLECT_WARPS": 8 if few_rows else 4,
            "CAP_K": 4, "SEL_BITS": 8 if few_rows else 6, "SEL_TILE": 1024 if few_rows else 512,
            "SEL_WARPS": 8 if few_rows else 4}


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
    return topk.topk_indices(**inputs, check_values=False, config=config)


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
    name="topk_indices",
    phases=(PHASE,),
    space=SPACE,
    default=_default,
    fixed_dims=("k",),
    bucketed_dims=("T", "L"),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=_baseline,
    baseline_name="torch.topk",
    source_modules=(topk_kernels, topk, sys.modules[__name__], topk_reference),
))
