"""Block-level (two-level) indexer scoring over the paged FP8 K cache.

1. :func:`block_scores`: an upper bound of every page's best score from the page summaries
   (``pmax``/``pmin``), ``[T, n_pages]`` fp32 (the ``BOUND`` mode of the indexer kernel);
2. :func:`~.page_select.select_pages`: the ``n_select`` pages with the highest bounds per row (one
   Triton program per row), in ascending page order, -1 padded;
3. :func:`selected_page_logits`: token-level logits only inside the selected pages (the ``SELECTED``
   mode of the indexer kernel), ``[T, n_select * P]`` plus their logical positions.

:func:`block_indexer_logits` runs all three. Memory is ``O(T * (n_pages + n_select * P))``, never a
dense ``[T, L]``; with every page selected the logits equal :func:`~.indexer.indexer_logits`.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..checks import PlanCache, check_positive
from ..registry import Cost, KernelSpec
from . import block_scores_reference, indexer, page_select
from .block_scores_reference import gather_selected_torch, page_bounds_torch, page_summaries_torch
from ..hostmath import cdiv
from .cache import PAGE_SIZES
from .indexer import (BOUND, SELECTED, LogitsLaunch, call_cu, compare_logits, indexer_logits, logits_shape, made_cu,
                      random_paged_keys, random_queries, tile_error)
from .indexer_checks import (QueryRows, check_block_table, check_pages, check_paged_keys, check_queries,
                             check_summaries, check_size)
from .indexer_reference import indexer_logits_torch
from .page_select import SelectLaunch, select_pages  # noqa: F401  (select_pages: the path's step 2)


def _bound_config(config: dict) -> dict:
    return {"BLOCK_M": config["bound_BLOCK_M"], "BLOCK_N": config["bound_BLOCK_N"],
            "CHUNK": config["bound_CHUNK"], "num_warps": config["bound_warps"], "num_stages": config["bound_stages"]}


def _selected_config(config: dict) -> dict:
    return {"BLOCK_M": 1, "BLOCK_N": config["BLOCK_N"], "CHUNK": config["CHUNK"],
            "num_warps": config["num_warps"], "num_stages": config["num_stages"]}


def _path_config(config: dict | None, rows: QueryRows, block_table: torch.Tensor, P: int) -> dict:
    """The path's config; its shape key's L is the block table's capacity (host-known in every stage)."""
    _, shape = logits_shape(rows, block_table.shape[1] * P, P)
    if config is None:
        return SPEC.launch_config("decode", shape, rows.device)
    return SPEC.validate(config, shape)


def _bound_launch(rows: QueryRows, q, weights, pmax, block_table, P: int, n_pages: int, config: dict) -> LogitsLaunch:
    strides = (q.stride(0), q.stride(1), weights.stride(0), pmax.stride(0), block_table.stride(0), n_pages, 0)
    return LogitsLaunch(BOUND, rows.T, rows.H, rows.DK, rows.B, rows.max_q, n_pages, strides, _bound_config(config),
                        P, paged=True)


def _selected_launch(rows: QueryRows, q, weights, k, block_table, n_select: int, config: dict) -> LogitsLaunch:
    P = k.shape[1]
    strides = (q.stride(0), q.stride(1), weights.stride(0), k.stride(1), block_table.stride(0), n_select * P,
               n_select)
    return LogitsLaunch(SELECTED, rows.T, rows.H, rows.DK, rows.B, rows.max_q, n_select * P, strides,
                        _selected_config(config), P, paged=True)


def _bounds(launch: LogitsLaunch, cu, q, weights, pmax, pmin, block_table, limits) -> torch.Tensor:
    out = torch.empty(launch.shape, dtype=torch.float32, device=q.device)
    return launch(q, weights, pmax, pmin, cu, out, cu, limits, cu, block_table, cu, cu)


def _selected(launch: LogitsLaunch, cu, q, weights, k, k_scale, block_table, limits, pages):
    out = torch.empty(launch.shape, dtype=torch.float32, device=q.device)
    positions = torch.empty(launch.shape, dtype=torch.int32, device=q.device)
    launch(q, weights, k, k, k_scale, out, positions, limits, cu, block_table, cu, pages)
    return out, positions


_BOUND_PLANS, _SELECTED_PLANS, _PLANS = PlanCache(), PlanCache(), PlanCache()


def _check_page_size(page_size) -> int:
    if type(page_size) is not int or page_size not in PAGE_SIZES:  # 16.0 == 16 would reach the launch
        raise ValueError(f"page_size: must be one of {PAGE_SIZES}, got {page_size!r}")
    return page_size


def block_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    pmax: torch.Tensor,
    pmin: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    limits: torch.Tensor,
    page_size: int,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    num_cols: int | None = None,
    max_q: int | None = None,
    check_values: bool = True,
    config: dict | None = None,
) -> torch.Tensor:
    """Upper bounds ``[T, num_cols]`` fp32 of each logical page's best indexer score, ``-inf`` for pages
    at or past ``limits[t]``.

    q ``[T, H, DK]`` e4m3, weights ``[T, H]`` fp32 (scales folded in; either sign), pmax / pmin
    ``[num_pages, DK]`` bf16 or fp32 with equal strides (e.g. ``PagedCache.pmax`` / ``.pmin``), block_table
    ``[>= B, max_pages]`` int32, seq_lens ``[>= B]`` int32, limits ``[T]`` int32 (at most the sequence's
    length), page_size ``P``; cu_seqlens_q ``[B + 1]`` int32 (default: one sequence); num_cols
    defaults to ``ceil(max(limits) / P)``; max_q and check_values as in
    :func:`~dsa_triton.indexer_logits`. ``config``: the ``indexer_block_path`` config.

    On the GPU the summaries enter bf16 tensor-core dots; dequantized FP8 keys are exact in bf16, so
    the bound stays a bound up to fp32 rounding of the sums.
    """
    key = plan = None
    if not check_values and num_cols is not None and (cu_seqlens_q is None or max_q is not None):  # no device value
        key, plan = _BOUND_PLANS.find((q, weights, pmax, pmin, block_table, seq_lens, limits, cu_seqlens_q),
                                      (num_cols, max_q, page_size), config)
    if plan is None:
        rows = check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values)
        check_summaries(rows, pmax, pmin)
        P = _check_page_size(page_size)
        check_block_table(rows, block_table, seq_lens, limits, pmax.shape[0], P)
        rows.finish(limits, need_max_limit=num_cols is None)
        n_pages = check_size("num_cols", num_cols, cdiv(rows.max_limit, P))
        config = _path_config(config, rows, block_table, P)
        plan = _BOUND_PLANS.put(key, (_bound_launch(rows, q, weights, pmax, block_table, P, n_pages, config),
                                      made_cu(rows, cu_seqlens_q)))
    return _bounds(plan[0], call_cu(plan[1], cu_seqlens_q), q, weights, pmax, pmin, block_table, limits)


def selected_page_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    limits: torch.Tensor,
    pages: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_q: int | None = None,
    check_values: bool = True,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level logits inside selected pages: ``(logits [T, n_sel * P] fp32, positions [T, n_sel * P]
    int32)``; column ``c`` holds logical position ``pages[t, c // P] * P + c % P`` (-1 and ``-inf`` where
    the page is -1 or the position is at or past ``limits[t]``).

    k ``[num_pages, P, DK]`` e4m3, k_scale ``[num_pages, P]`` fp32, pages ``[T, n_sel]`` int32 logical
    page indices (-1 = none, e.g. from :func:`select_pages`); the rest as in :func:`block_scores`.
    """
    key = plan = None
    if not check_values and (cu_seqlens_q is None or max_q is not None):  # no device value
        key, plan = _SELECTED_PLANS.find((q, weights, k, k_scale, block_table, seq_lens, limits, pages, cu_seqlens_q),
                                         (max_q,), config)
    if plan is None:
        rows = check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values)
        P = check_paged_keys(rows, k, k_scale, block_table, seq_lens, limits)
        check_pages(rows, pages, seq_lens, P)
        rows.finish(limits, need_max_limit=False)
        config = _path_config(config, rows, block_table, P)
        plan = _SELECTED_PLANS.put(key, (_selected_launch(rows, q, weights, k, block_table, pages.shape[1], config),
                                         made_cu(rows, cu_seqlens_q)))
    return _selected(plan[0], call_cu(plan[1], cu_seqlens_q), q, weights, k, k_scale, block_table, limits, pages)


def block_indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    pmax: torch.Tensor,
    pmin: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    limits: torch.Tensor,
    n_select: int,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_len: int | None = None,
    max_q: int | None = None,
    check_values: bool = True,
    config: dict | None = None,
    return_bounds: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The block-level path: page bounds, the ``n_select`` best pages per row, token logits inside them.

    Returns ``(logits [T, n_select * P] fp32, positions [T, n_select * P] int32)`` as
    :func:`selected_page_logits`, and the bounds ``[T, ceil(max_len / P)]`` third with
    ``return_bounds``. ``max_len``: at least ``max(limits)`` (sizes the bound matrix; default read off
    ``limits``). Everything is checked once, up front (one device-to-host transfer); with
    ``check_values=False``, ``max_len`` and ``max_q`` given, none (CUDA-graph safe). Three launches.
    """
    check_positive("n_select", n_select)
    if max_len is not None:
        check_positive("max_len", max_len)
    key = plan = None
    if not check_values and max_len is not None and (cu_seqlens_q is None or max_q is not None) and (
            isinstance(k, torch.Tensor) and k.dim() == 3 and k.shape[1] > 0):  # no device value: cache the plan
        pages_of_len = cdiv(max_len, k.shape[1])  # all the path takes from max_len
        key, plan = _PLANS.find((q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits, cu_seqlens_q),
                                (max_q, pages_of_len, n_select), config)
    if plan is None:
        plan = _PLANS.put(key, _checked_path_plan(q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits,
                                                  n_select, cu_seqlens_q, max_len, max_q, check_values, config))
    bound_launch, select_launch, selected_launch, cu = plan
    cu = call_cu(cu, cu_seqlens_q)
    bounds = _bounds(bound_launch, cu, q, weights, pmax, pmin, block_table, limits)
    pages = select_launch(bounds)
    logits, positions = _selected(selected_launch, cu, q, weights, k, k_scale, block_table, limits, pages)
    return (logits, positions, bounds) if return_bounds else (logits, positions)


def _checked_path_plan(q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits, n_select, cu_seqlens_q,
                       max_len, max_q, check_values, config) -> tuple:
    """Every check of :func:`block_indexer_logits` (the value checks in one transfer), then its three
    launches and the ``cu`` it made when ``cu_seqlens_q`` is None."""
    rows = check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values)
    P = check_paged_keys(rows, k, k_scale, block_table, seq_lens, limits)
    check_summaries(rows, pmax, pmin)
    if pmax.shape[0] != k.shape[0]:
        raise ValueError(f"pmax: {pmax.shape[0]} pages, but k has {k.shape[0]}")
    if max_len is not None:
        rows.checks.fail_if(lambda: limits > max_len, "max_len: below a row's limit")
    rows.finish(limits, need_max_limit=max_len is None)
    n_pages = cdiv(rows.max_limit if max_len is None else max_len, P)
    config = _path_config(config, rows, block_table, P)
    return (_bound_launch(rows, q, weights, pmax, block_table, P, n_pages, config),
            SelectLaunch(rows.T, n_pages, n_select, n_pages, rows.device),
            _selected_launch(rows, q, weights, k, block_table, n_select, config), made_cu(rows, cu_seqlens_q))


# -- registry entry: the block-level path, timed against the token-level path ---------------------

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
    logits, positions, bounds = block_indexer_logits(
        *(inputs[n] for n in ("q", "weights", "k", "k_scale", "pmax", "pmin", "block_table", "seq_lens", "limits",
                              "n_select")),
        cu_seqlens_q=inputs["cu_seqlens_q"], max_len=inputs["max_len"], max_q=inputs["max_q"], check_values=False,
        config=config, return_bounds=True)
    return bounds, logits, positions


def _token_level(inputs: dict) -> torch.Tensor:
    return indexer_logits(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"], inputs["limits"],
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
    chosen = torch.zeros_like(ref_bounds, dtype=torch.bool)
    chosen.scatter_(1, (pages // P).clamp_min(0).long(), pages >= 0)
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
    # bounds: 64-page bf16 tiles, double-buffered (sm_90 compile: 108 registers, 98 KB shared, 2 CTAs per SM)
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
    source_modules=(block_scores_reference, indexer, page_select, sys.modules[__name__]),  # its kernels' modules too
))
