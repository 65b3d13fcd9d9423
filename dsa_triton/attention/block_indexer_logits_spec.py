"""Registry entry of :func:`~dsa_triton.block_indexer_logits`, the block-level indexer path (page bounds, page
selection and the logits inside the selected pages), timed against the token-level path. A config whose ``path`` is
``token`` runs the token-level logits instead (checked against the token-level reference), so a study picks the
faster path per shape: what :func:`~dsa_triton.indexer_path` answers.

Shapes as ``indexer_logits`` (``P`` > 0), plus ``SEL`` pages selected.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import (block_indexer_logits, block_indexer_logits_reference, indexer_logits, indexer_logits_kernels,
               indexer_logits_spec, select_pages, select_pages_reference, select_pages_spec)
from .block_indexer_logits_reference import gather_selected_torch, page_bounds_torch, page_summaries_torch
from .indexer_logits_reference import indexer_logits_torch
from .indexer_logits_spec import compare_logits, random_paged_keys, random_queries


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    B, Q, L, P, H, DK = (shape[n] for n in ("B", "Q", "L", "P", "H", "DK"))
    q, w = random_queries(B * Q, H, DK, g)
    k, k_scale, table, lens = random_paged_keys(B, L, P, DK, g)
    summaries = page_summaries_torch(k, k_scale, table, lens).to(torch.bfloat16)  # exact, as PagedCache keeps them
    return {"q": q, "weights": w, "k": k, "k_scale": k_scale, "pmax": summaries[:, 0], "pmin": summaries[:, 1],
            "block_table": table, "seq_lens": lens, "n_select": shape["SEL"], "max_q": Q, "max_len": L,
            "limits": (L - Q + 1 + torch.arange(Q, device=device)).repeat(B).int(),
            "cu_seqlens_q": torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=device)}


def _run(inputs: dict, config: dict):
    """The path as a decode loop calls it: sizes given, value checks off (the inputs are valid); ``("token",
    logits)`` for a config of the token path."""
    if config["path"] == "token":
        return "token", _token_level(inputs)
    logits, positions, bounds = block_indexer_logits.block_indexer_logits(
        *(inputs[n] for n in ("q", "weights", "k", "k_scale", "pmax", "pmin", "block_table", "seq_lens", "limits",
                              "n_select")),
        cu_seqlens_q=inputs["cu_seqlens_q"], max_len=inputs["max_len"], max_q=inputs["max_q"], check_values=False,
        config=config, return_bounds=True)
    return bounds, logits, positions


def _token_level(inputs: dict) -> torch.Tensor:
    return indexer_logits.indexer_logits(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"], inputs["limits"],
                                  cu_seqlens_q=inputs["cu_seqlens_q"], block_table=inputs["block_table"],
                                  seq_lens=inputs["seq_lens"], num_cols=inputs["max_len"], max_q=inputs["max_q"],
                                  check_values=False)


def _reference(inputs: dict):
    q, w = inputs["q"], inputs["weights"]
    L = int(inputs["limits"].max())
    P = inputs["k"].shape[1]
    bounds = page_bounds_torch(q, w, inputs["pmax"], inputs["pmin"], inputs["block_table"], inputs["limits"],
                               P, cdiv(L, P), inputs["cu_seqlens_q"])
    dense = indexer_logits_torch(q, w, inputs["k"], inputs["k_scale"], inputs["limits"], L,
                                 cu_seqlens_q=inputs["cu_seqlens_q"], block_table=inputs["block_table"])
    return bounds, dense, inputs["n_select"], P, inputs["limits"]


def _compare(out, ref) -> str | None:
    """The token path's logits equal the dense reference's. The block path: bounds close to the reference; the chosen pages are a top set of the reference bounds (up to
    ties within tolerance); logits at the chosen positions equal the dense reference's."""
    bounds, logits, *positions = out
    positions = positions[0] if positions else None
    ref_bounds, dense, n_select, P, limits = ref
    if bounds == "token":
        return compare_logits(logits, dense)
    error = compare_logits(bounds, ref_bounds)
    if error:
        return f"bounds: {error}"
    pages = positions.view(positions.shape[0], -1, P).amax(dim=2)  # -1 where no position of the page is valid
    spare = ref_bounds.shape[1]  # where -1 entries go (scattered onto a real page, a False could overwrite a True)
    chosen = torch.zeros(ref_bounds.shape[0], spare + 1, dtype=torch.bool, device=ref_bounds.device)
    chosen = chosen.scatter_(1, (pages // P).where(pages >= 0, spare).long(), True)[:, :spare]
    if spare:  # (no page at all: the positions below must all be -1)
        tol = 2e-3 * ref_bounds.where(ref_bounds.isfinite(), 0.0).abs().amax(1).clamp_min(1e-12)
        worst_chosen = ref_bounds.where(chosen, float("inf")).amin(1)
        best_left = ref_bounds.where(~chosen & ref_bounds.isfinite(), float("-inf")).amax(1)
        full = chosen.sum(1) == torch.minimum(ref_bounds.isfinite().sum(1), torch.tensor(n_select))
        if not bool((full & ((worst_chosen >= best_left - tol) | ~chosen.any(1))).all()):
            return "pages: the chosen pages are not the top pages of the reference bounds"
    ref_logits, ref_pos = gather_selected_torch(dense, (pages // P).where(pages >= 0, -1), P, limits)
    if not torch.equal(positions, ref_pos):
        return "positions differ from the chosen pages' valid positions"
    error = compare_logits(logits, ref_logits)
    return f"logits: {error}" if error else None


def _cost(phase: str, shape) -> Cost:
    B, Q, L, P, H, DK, SEL = (shape[n] for n in ("B", "Q", "L", "P", "H", "DK", "SEL"))
    T, n_pages = B * Q, cdiv(L, P)
    summary_bytes = B * n_pages * 2 * DK * 2  # bf16
    selected_key_bytes = T * min(SEL, n_pages) * P * (DK + 4)
    out_bytes = T * n_pages * 4 + T * SEL * P * 8
    flops = 2.0 * T * H * DK * (4 * n_pages + min(SEL, n_pages) * P)
    return Cost(bytes=summary_bytes + selected_key_bytes + out_bytes + T * H * (DK + 4), flops=flops, flop_dtype="bf16")


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        return [{"B": 64, "Q": 1, "L": 131072, "P": 64, "H": 64, "DK": 128, "SEL": 64}]
    return [{"B": 2, "Q": 2, "L": 150, "P": 16, "H": 8, "DK": 32, "SEL": 3}]


SPEC = registry.register(KernelSpec(
    launch=block_indexer_logits.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_token_level,
    baseline_name="token-level indexer_logits (dense [T, L])",
    model_dims=lambda m: [{"P": m.page, "H": m.index_heads, "DK": m.index_dim}],
    count_roles={"B": "batch", "Q": "tokens", "L": "context"},
    source_modules=(block_indexer_logits_reference, indexer_logits_kernels, indexer_logits, indexer_logits_spec,
                    select_pages, select_pages_reference, select_pages_spec, block_indexer_logits,
                    sys.modules[__name__]),  # its kernels' modules too
))
