"""Registry entry of the block-level indexer path (``indexer_block_path``): page bounds, page selection and the
logits inside the selected pages, timed against the token-level path.

Config space: the bound launch's ``bound_BLOCK_M``, ``bound_BLOCK_N`` (pages per tile), ``bound_CHUNK``,
``bound_warps``, ``bound_stages``, and the selected-page launch's ``BLOCK_N``, ``CHUNK``, ``num_warps``,
``num_stages`` (one query row per program). Shapes as ``indexer_logits`` (``P`` > 0), plus ``SEL`` pages selected.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import (block_scores, block_scores_reference, indexer, indexer_kernels, indexer_spec, page_select,
               page_select_reference, page_select_spec)
from .block_scores_reference import gather_selected_torch, page_bounds_torch, page_summaries_torch
from .indexer_reference import indexer_logits_torch
from .indexer_spec import compare_logits, random_paged_keys, random_queries, tile_error


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
    """The path as a decode loop calls it: sizes given, value checks off (the inputs are valid)."""
    logits, positions, bounds = block_scores.block_indexer_logits(
        *(inputs[n] for n in ("q", "weights", "k", "k_scale", "pmax", "pmin", "block_table", "seq_lens", "limits",
                              "n_select")),
        cu_seqlens_q=inputs["cu_seqlens_q"], max_len=inputs["max_len"], max_q=inputs["max_q"], check_values=False,
        config=config, return_bounds=True)
    return bounds, logits, positions


def _token_level(inputs: dict) -> torch.Tensor:
    return indexer.indexer_logits(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"], inputs["limits"],
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
    """Bounds close to the reference; the chosen pages are a top set of the reference bounds (up to
    ties within tolerance); logits at the chosen positions equal the dense reference's."""
    bounds, logits, positions = out
    ref_bounds, dense, n_select, P, limits = ref
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


def _default(phase: str, shape) -> dict:
    # bounds: 64-page bf16 tiles, double-buffered, small enough for two programs per SM
    return {"bound_BLOCK_M": 1, "bound_BLOCK_N": 64, "bound_CHUNK": 512, "bound_warps": 4, "bound_stages": 2,
            "BLOCK_N": 64, "CHUNK": 512, "num_warps": 4, "num_stages": 3}


def _constraint(config: dict, shape) -> str | None:
    if config["CHUNK"] % config["BLOCK_N"] or config["bound_CHUNK"] % config["bound_BLOCK_N"]:
        return "a CHUNK must be a multiple of its BLOCK_N"
    bound = tile_error(config["bound_BLOCK_N"], config["bound_BLOCK_M"], shape["H"], shape["DK"],
                       config["bound_warps"], config["bound_stages"], key_bytes=2, key_operands=2)  # bf16 pmax, pmin
    if bound:
        return f"bounds: {bound}"
    return tile_error(config["BLOCK_N"], 1, shape["H"], shape["DK"], config["num_warps"], config["num_stages"])


SPEC = registry.register(KernelSpec(
    name="indexer_block_path",
    phases=("decode",),
    space={"bound_BLOCK_M": (1, 2, 4), "bound_BLOCK_N": (16, 32, 64, 128), "bound_CHUNK": (128, 256, 512, 1024, 2048, 4096),
           "bound_warps": (4, 8), "bound_stages": (1, 2, 3, 4), "BLOCK_N": (32, 64, 128, 256), "CHUNK": (256, 512, 1024, 2048, 4096),
           "num_warps": (4, 8), "num_stages": (1, 2, 3, 4)},
    default=_default,
    fixed_dims=("P", "H", "DK"),
    bucketed_dims=("B", "Q", "L"),  # SEL (pages selected) only sizes the inputs
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=_token_level,
    baseline_name="token-level indexer_logits (dense [T, L])",
    source_modules=(block_scores_reference, indexer_kernels, indexer, indexer_spec, page_select, page_select_reference,
                    page_select_spec, block_scores, sys.modules[__name__]),  # its kernels' modules too
))
