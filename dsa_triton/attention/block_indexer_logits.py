"""Block-level (two-level) indexer scoring over the paged FP8 K cache.

1. :func:`block_scores`: an upper bound of every page's best score from the page summaries
   (``pmax``/``pmin``), ``[T, n_pages]`` fp32 (the ``BOUND`` mode of the indexer kernel);
2. :func:`~.select_pages.select_pages`: the ``n_select`` pages with the highest bounds per row (one
   Triton program per row), in ascending page order, -1 padded;
3. :func:`selected_page_logits`: token-level logits only inside the selected pages (the ``SELECTED``
   mode of the indexer kernel), ``[T, n_select * P]`` plus their logical positions.

:func:`block_indexer_logits` runs all three. Memory is ``O(T * (n_pages + n_select * P))``, never a
dense ``[T, L]``; with every page selected the logits equal :func:`~.indexer_logits.indexer_logits`.
Launch configs come from the tuning database through the registry (:data:`LAUNCH`) unless ``config`` is given:
the bound launch's ``bound_BLOCK_M``, ``bound_BLOCK_N`` (pages per tile), ``bound_CHUNK``, ``bound_warps``,
``bound_stages``, the selected-page launch's ``BLOCK_N``, ``CHUNK``, ``num_warps``, ``num_stages`` (one query row
per program), and ``path``: which indexer path serves the shape, the block path or the token-level one
(:func:`~.indexer_logits.indexer_logits` over the whole context), tuned per shape like ``moe_forward``'s path and
answered by :func:`indexer_path`. The block kernels themselves do not read ``path``.
"""
from __future__ import annotations

import torch

from ..checks import INT32_MAX, check_int32, check_out
from ..library import dsa_op, op_config, out_cols
from ..plans import PlanCache
from ..hostmath import cdiv
from .cache import PAGE_SIZES

from ..registry import LaunchSpace
from .indexer_logits import LogitsLaunch, call_cu, logits_shape, made_cu, tile_error
from .indexer_checks import (QueryRows, check_block_table, check_pages, check_paged_keys, check_queries,
                             check_summaries, check_size)
from .indexer_logits_kernels import BOUND, SELECTED
from .select_pages import SelectLaunch


PATHS = ("token", "block")


def _default(phase: str, shape) -> dict:
    """Bounds: 64-page bf16 tiles, double-buffered, small enough for two programs per SM; the token path until a
    study finds the block path faster for the shape."""
    return {"bound_BLOCK_M": 1, "bound_BLOCK_N": 64, "bound_CHUNK": 512, "bound_warps": 4, "bound_stages": 2,
            "BLOCK_N": 64, "CHUNK": 512, "num_warps": 4, "num_stages": 3, "path": "token"}


def _constraint(config: dict, shape) -> str | None:
    if config["CHUNK"] % config["BLOCK_N"] or config["bound_CHUNK"] % config["bound_BLOCK_N"]:
        return "a CHUNK must be a multiple of its BLOCK_N"
    bound = tile_error(config["bound_BLOCK_N"], config["bound_BLOCK_M"], shape["H"], shape["DK"],
                       config["bound_warps"], config["bound_stages"], key_bytes=2, key_operands=2)  # bf16 pmax, pmin
    if bound:
        return f"bounds: {bound}"
    return tile_error(config["BLOCK_N"], 1, shape["H"], shape["DK"], config["num_warps"], config["num_stages"])


LAUNCH = LaunchSpace(
    name="block_indexer_logits",
    phases=("decode",),
    space={"bound_BLOCK_M": (1, 2, 4), "bound_BLOCK_N": (16, 32, 64, 128),
           "bound_CHUNK": (128, 256, 512, 1024, 2048, 4096), "bound_warps": (4, 8), "bound_stages": (1, 2, 3, 4),
           "BLOCK_N": (32, 64, 128, 256), "CHUNK": (256, 512, 1024, 2048, 4096), "num_warps": (4, 8),
           "num_stages": (1, 2, 3, 4), "path": PATHS},
    default=_default,
    fixed_dims=("P", "H", "DK"),
    bucketed_dims=("B", "Q", "L"),
    constraint=_constraint,
)


def indexer_path(phase: str, batch: int, max_q: int, max_len: int, page_size: int, heads: int, head_dim: int,
                 device: torch.device | str | None = None) -> str:
    """Which indexer path serves this shape, ``"token"`` or ``"block"``: the ``path`` of its launch config (the
    tuning database's record for the shape, exact, same bucket or nearest; else the token path). Host work only,
    cached per shape. ``batch`` sequences of at most ``max_q`` query rows over ``max_len`` keys of ``page_size``
    pages; ``heads`` x ``head_dim`` indexer queries."""
    if phase not in LAUNCH.phases:
        return "token"
    shape = {"B": batch, "Q": max_q, "L": max_len, "P": page_size, "H": heads, "DK": head_dim}
    return LAUNCH.launch_config(phase, shape, device)["path"]


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
        return LAUNCH.launch_config("decode", shape, rows.device)
    return LAUNCH.validate(config, shape)


def _bound_launch(rows: QueryRows, q, weights, pmax, block_table, P: int, n_pages: int, config: dict) -> LogitsLaunch:
    strides = (q.stride(0), q.stride(1), weights.stride(0), pmax.stride(0), block_table.stride(0), n_pages, 0)
    return LogitsLaunch(BOUND, rows.T, rows.H, rows.DK, rows.B, rows.max_q, n_pages, strides, _bound_config(config),
                        P, paged=True)


def _selected_launch(rows: QueryRows, q, weights, k, block_table, n_select: int, config: dict,
                     width: int | None = None) -> LogitsLaunch:
    """The launch over the columns of ``n_select`` pages a row, into rows of ``width`` columns (default
    ``n_select * P``; :func:`_selected` fills the columns past the launch's)."""
    P = k.shape[1]
    width = n_select * P if width is None else width
    strides = (q.stride(0), q.stride(1), weights.stride(0), k.stride(1), block_table.stride(0), width, n_select)
    launch = LogitsLaunch(SELECTED, rows.T, rows.H, rows.DK, rows.B, rows.max_q, n_select * P, strides,
                          _selected_config(config), P, paged=True)
    launch.width = width
    return launch


def _bounds(launch: LogitsLaunch, cu, q, weights, pmax, pmin, block_table, limits, out=None) -> torch.Tensor:
    if out is None:
        out = torch.empty(launch.shape, dtype=torch.float32, device=q.device)
    return launch(q, weights, pmax, pmin, cu, out, cu, limits, cu, block_table, cu, cu)


def _selected(launch: LogitsLaunch, cu, q, weights, k, k_scale, block_table, limits, pages):
    T, cols = launch.shape
    out = torch.empty((T, launch.width), dtype=torch.float32, device=q.device)
    positions = torch.empty((T, launch.width), dtype=torch.int32, device=q.device)
    launch(q, weights, k, k, k_scale, out, positions, limits, cu, block_table, cu, pages)
    if launch.width > cols:  # columns of pages past those that exist: none selected
        out[:, cols:].fill_(float("-inf"))
        positions[:, cols:].fill_(-1)
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upper bounds ``[T, num_cols]`` fp32 of each logical page's best indexer score, ``-inf`` for pages
    at or past ``limits[t]``.

    q ``[T, H, DK]`` e4m3, weights ``[T, H]`` fp32 (scales folded in; either sign), pmax / pmin
    ``[num_pages, DK]`` bf16 or fp32 with equal strides (e.g. ``PagedCache.pmax`` / ``.pmin``), block_table
    ``[>= B, max_pages]`` int32, seq_lens ``[>= B]`` int32, limits ``[T]`` int32 (at most the sequence's
    length), page_size ``P``; cu_seqlens_q ``[B + 1]`` int32 (default: one sequence); num_cols
    defaults to ``ceil(max(limits) / P)``; max_q and check_values as in
    :func:`~dsa_triton.indexer_logits`. ``config``: the ``block_indexer_logits`` config. ``out``: optional
    ``[T, num_cols]`` fp32 contiguous tensor to write (and return).

    The value checks (``check_values=True``; else the caller's promise), as in :func:`~dsa_triton.indexer_logits`:
    no NaN byte in ``q``, ``cu_seqlens_q`` rises from 0 to ``T``, at most ``max_q`` rows a sequence, ``limits >= 0``
    and at most the sequence's ``seq_lens``, ``seq_lens[b]`` in ``[0, max_pages * page_size]``, every block-table
    entry of a used page in ``[0, num_pages)``. A broken promise makes the kernel read outside the block table or the
    summaries (a NaN in ``q``: NaN bounds).

    On the GPU the summaries enter bf16 tensor-core dots; dequantized FP8 keys are exact in bf16, so
    the bound stays a bound up to fp32 rounding of the sums. A NaN in ``q``, a weight or a page's summaries (a page
    holding a key appended with a NaN or an inf) makes the page's bound NaN, never a finite number;
    :func:`~dsa_triton.select_pages` never takes such a page.
    """
    key = plan = None
    if not check_values and num_cols is not None and (cu_seqlens_q is None or max_q is not None):  # no device value
        key, plan = _BOUND_PLANS.find((q, weights, pmax, pmin, block_table, seq_lens, limits, cu_seqlens_q, out),
                                      (num_cols, max_q, page_size), config)
    if plan is None:
        rows = check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values)
        check_summaries(rows, pmax, pmin)
        P = _check_page_size(page_size)
        check_block_table(rows, block_table, seq_lens, limits, pmax.shape[0], P)
        rows.finish(limits, need_max_limit=num_cols is None)
        n_pages = check_size("num_cols", num_cols, cdiv(rows.max_limit, P))
        config = _path_config(config, rows, block_table, P)
        launch = _bound_launch(rows, q, weights, pmax, block_table, P, n_pages, config)
        if out is not None:
            check_out(out, launch.shape, torch.float32, rows.device)
        plan = _BOUND_PLANS.put(key, (launch, made_cu(rows, cu_seqlens_q)))
    return _bounds(plan[0], call_cu(plan[1], cu_seqlens_q), q, weights, pmax, pmin, block_table, limits, out)


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
    page indices (-1 = none, e.g. from :func:`~dsa_triton.select_pages`); the rest as in :func:`block_scores`.
    The value checks add, for ``pages``: every entry is -1 or a page below its row's sequence length (a broken
    promise reads outside the block table). Non-finite values as in :func:`~dsa_triton.indexer_logits`.
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
    ``return_bounds``. ``max_len``: at least ``max(limits)``, at most 2^31 - 1 (sizes the bound matrix; default
    read off ``limits``). ``n_select``: 1 to ``(2^31 - 1) // P`` (the columns are int32); at most
    ``ceil(max_len / P)`` pages exist to select: the launches cover those, and the columns past them are -inf / -1,
    one fill each, so the work does not grow with ``n_select`` beyond the pages. Everything is checked once, up
    front (one device-to-host transfer); with ``check_values=False``, ``max_len`` and ``max_q`` given, none
    (CUDA-graph safe). Three launches.
    The value checks are those of :func:`block_scores` and ``max_len >= max(limits)``; a ``max_len`` below a
    limit (checks off) reads nothing outside, but pages past ``max_len`` are never scored. A key appended with a
    NaN or an inf is never returned: its page's bound is NaN, and NaN bounds are never selected.
    """
    check_int32("n_select", n_select)
    if max_len is not None:
        check_int32("max_len", max_len)
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
    check_int32("n_select", n_select, 1, INT32_MAX // P)  # the logits' columns are int32 (e.g. for the top-k)
    check_summaries(rows, pmax, pmin)
    if pmax.shape[0] != k.shape[0]:
        raise ValueError(f"pmax: {pmax.shape[0]} pages, but k has {k.shape[0]}")
    if max_len is not None:
        rows.checks.fail_if(lambda: limits > max_len, "max_len: below a row's limit")
    rows.finish(limits, need_max_limit=max_len is None)
    n_pages = cdiv(rows.max_limit if max_len is None else max_len, P)
    config = _path_config(config, rows, block_table, P)
    selectable = min(n_select, n_pages)  # pages that can be selected: the launches' width
    return (_bound_launch(rows, q, weights, pmax, block_table, P, n_pages, config),
            SelectLaunch(rows.T, n_pages, selectable, n_pages, rows.device),
            _selected_launch(rows, q, weights, k, block_table, selectable, config, n_select * P),
            made_cu(rows, cu_seqlens_q))


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("block_scores")
def block_scores_op(q: torch.Tensor, weights: torch.Tensor, pmax: torch.Tensor, pmin: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, limits: torch.Tensor, page_size: int,
                    num_cols: int, cu_seqlens_q: torch.Tensor | None = None, max_q: int | None = None,
                    check_values: bool = True, config: str | None = None) -> torch.Tensor:
    """:func:`dt.block_scores`: page upper bounds ``[T, num_cols]`` fp32; ``num_cols`` (pages) is required."""
    return block_scores(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, cu_seqlens_q=cu_seqlens_q,
                        num_cols=num_cols, max_q=max_q, check_values=check_values, config=op_config(config))


@block_scores_op.register_fake
def _(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, num_cols, *args, **kwargs):
    return q.new_empty((q.shape[0], num_cols), dtype=torch.float32)


@dsa_op("block_scores_out", mutates_args=("out",))
def block_scores_out(q: torch.Tensor, weights: torch.Tensor, pmax: torch.Tensor, pmin: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, limits: torch.Tensor, page_size: int,
                     out: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None, max_q: int | None = None,
                     check_values: bool = True, config: str | None = None) -> None:
    """:func:`dt.block_scores` into ``out[T, num_cols]`` fp32 (contiguous; ``num_cols`` pages is its width)."""
    block_scores(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, cu_seqlens_q=cu_seqlens_q,
                 num_cols=out_cols(out), max_q=max_q, check_values=check_values, config=op_config(config), out=out)


@block_scores_out.register_fake
def _(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, out, *args, **kwargs):
    return None


@dsa_op("block_indexer_logits")
def block_indexer_logits_op(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                            pmax: torch.Tensor, pmin: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                            limits: torch.Tensor, n_select: int, max_len: int, cu_seqlens_q: torch.Tensor | None = None,
                            max_q: int | None = None, check_values: bool = True,
                            config: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dt.block_indexer_logits` with its bounds: ``(logits [T, n_select * P] fp32, positions
    [T, n_select * P] int32, bounds [T, ceil(max_len / P)] fp32)``; ``max_len`` (at least ``max(limits)``) is
    required."""
    return block_indexer_logits(q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits, n_select,
                                cu_seqlens_q=cu_seqlens_q, max_len=max_len, max_q=max_q, check_values=check_values,
                                config=op_config(config), return_bounds=True)


@block_indexer_logits_op.register_fake
def _(q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits, n_select, max_len, *args, **kwargs):
    T, P = q.shape[0], k.shape[1]
    logits = q.new_empty((T, n_select * P), dtype=torch.float32)
    return logits, q.new_empty((T, n_select * P), dtype=torch.int32), q.new_empty((T, cdiv(max_len, P)),
                                                                                  dtype=torch.float32)
