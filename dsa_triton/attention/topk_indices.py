"""Exact per-row top-k over fp32 scores: :func:`topk_indices`, the host side.

Argument checks (ValueError naming the argument, before any launch), the plan a call's metadata fixes (the
three kernels' grids and constexprs, the workspace sizes; cached per metadata and config) and the launches.
The kernels and the algorithm (three passes of a radix select, routes by row length) are in
:mod:`.topk_indices_kernels`. Launch parameters (:data:`LAUNCH`): pass 1 (``SPLIT`` programs a row, ``TILE`` scores
a step, ``WARPS``, ``GROUP`` scores a group maximum, ``HIST_BITS``), the route threshold ``ROUTE_MIN``, pass 2
(``COLLECT_TILE``, ``COLLECT_WARPS``, ``CAP_K`` candidates a row in multiples of k) and pass 3 (``SEL_BITS``,
``SEL_TILE``, ``SEL_WARPS``).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..checks import check_int32, check_kernel_device, check_positive, check_tensor
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..hostmath import cdiv
from ..launch import launch_with
from ..registry import LaunchSpace
from ..runtime import interpreting
from .topk_indices_kernels import INFO_COUNT, INFO_WORDS, topk_bound_kernel, topk_collect_kernel, topk_select_kernel

from .topk_indices_reference import pages_in_use

MAX_K = 4096
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
    programs of 4 warps (several per SM hide the latency of short sweeps). Chosen from a sweep of CUDA-graph times
    on an H200 (results/journal/attention.md)."""
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


LAUNCH = LaunchSpace(name="topk_indices", phases=(PHASE,), space=SPACE, default=_default, fixed_dims=("k",),
                     bucketed_dims=("T", "L"), constraint=_constraint)


def _workspace(T: int, split: int, NB: int, cap: int, device: torch.device):
    """``(work, info_off, cand_off)``: one int32 buffer holding the partial histograms, ``info`` from word
    ``info_off`` and the int64 candidates from word ``cand_off`` (even: 8-byte aligned)."""
    info_off = T * split * NB
    cand_off = info_off + T * INFO_WORDS.value
    return torch.empty(cand_off + 2 * T * cap, dtype=torch.int32, device=device), info_off, cand_off


@contextmanager
def recorded_candidate_counts():
    """Within the block, the returned function gives the last call's pass-2 candidate count of each row (meaningful
    on two-pass rows only), read from the workspace after the call: for tests and route studies. ``read(word)``
    gives another word of each row's ``info`` (the ``INFO_*`` of :mod:`.topk_indices_kernels`: the pass-1 window)."""
    global _workspace
    seen, real = {}, _workspace

    def spy(T, split, NB, cap, device):
        work, info_off, cand_off = real(T, split, NB, cap, device)
        seen["info"] = work[info_off:cand_off].view(T, -1)
        return work, info_off, cand_off

    _workspace = spy
    try:
        yield lambda word=INFO_COUNT.value: seen["info"][:, word]
    finally:
        _workspace = real


class _Plan:
    """The host side of a call, fixed by the arguments' metadata, ``k`` and the config: the three
    kernels' grids and constexprs, and the workspace sizes."""

    def __init__(self, T: int, L: int, k: int, has_lengths: bool, has_table: bool, has_row_to_seq: bool,
                 config: dict) -> None:
        self.T, self.L, self.k = T, L, k
        self.split, self.NB = config["SPLIT"], 1 << config["HIST_BITS"]
        self.cap = min(config["CAP_K"] * k, L)  # candidates per row (also the select pass's compaction space)
        self.group_min = 2 * k * config["GROUP"]  # rows this long histogram group maxima in pass 1
        self.route_min = min(config["ROUTE_MIN"] * k, self.group_min)  # rows this long take passes 1-2
        self.two_pass = L >= self.route_min  # some row may take the two-pass route
        step = max(config["TILE"], config["COLLECT_TILE"])
        self.chunk = cdiv(cdiv(L, self.split), step) * step
        self.bound_meta = dict(HAS_LENGTHS=has_lengths, GROUP=config["GROUP"], COLS=config["TILE"] // config["GROUP"],
                               HIST_BITS=config["HIST_BITS"], SCORE_HIST=self.route_min < self.group_min,
                               BY_COUNT=interpreting(), num_warps=config["WARPS"])
        self.collect_meta = dict(HAS_LENGTHS=has_lengths, TILE=config["COLLECT_TILE"], WARPS=config["COLLECT_WARPS"],
                                 SPLIT=self.split, HIST_BITS=config["HIST_BITS"], num_warps=config["COLLECT_WARPS"])
        self.select_meta = dict(HAS_LENGTHS=has_lengths, HAS_TABLE=has_table, HAS_ROW_TO_SEQ=has_row_to_seq,
                                SEL_BITS=config["SEL_BITS"], TILE=config["SEL_TILE"],
                                PAIR=max(64, 8 * config["SEL_WARPS"]), num_warps=config["SEL_WARPS"])


def _launch(plan: _Plan, scores, lengths, block_table, page_size, row_to_seq, out) -> torch.Tensor:
    T, L, k = plan.T, plan.L, plan.k
    if T == 0:
        return out
    work, info_off, cand_off = _workspace(T, plan.split, plan.NB, plan.cap, scores.device)
    dummy = out  # stands in for absent optional tensors (never read)
    lengths_arg = dummy if lengths is None else lengths
    if plan.two_pass:
        grid = (T, plan.split)
        launch_with(topk_bound_kernel, grid, plan.bound_meta, scores, scores.stride(0), L, lengths_arg, work,
                    info_off, plan.chunk, plan.route_min, plan.group_min, k)
        launch_with(topk_collect_kernel, grid, plan.collect_meta, scores, scores.stride(0), L, lengths_arg, work,
                    info_off, cand_off, k, plan.chunk, plan.route_min, plan.cap)
    launch_with(
        topk_select_kernel, (T,), plan.select_meta,
        scores, scores.stride(0), L, lengths_arg, work, info_off, cand_off, out, k, plan.route_min, plan.cap,
        dummy if block_table is None else block_table, 0 if block_table is None else block_table.stride(0),
        dummy if row_to_seq is None else row_to_seq, page_size or 1)
    return out


def _check_arguments(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, out):
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    device = check_kernel_device("scores", scores)
    T, L = scores.shape
    check_positive("k", k)
    if k > MAX_K:
        raise ValueError(f"k: at most {MAX_K} is supported, got {k}")
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(T, k), device=device)
        if not out.is_contiguous():
            raise ValueError(f"out: must be contiguous, got strides {out.stride()}")
    if lengths is not None:
        check_tensor("lengths", lengths, dtype=torch.int32, shape=(T,), device=device)
    if block_table is None:
        for name, value in (("page_size", page_size), ("row_to_seq", row_to_seq), ("num_pages", num_pages)):
            if value is not None:
                raise ValueError(f"{name}: only meaningful with block_table, which is None")
        return
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    check_int32("page_size", page_size)  # slots are int32
    if num_pages is not None:
        check_int32("num_pages", num_pages)
    B, max_pages = block_table.shape
    if max_pages * page_size < L:
        raise ValueError(f"block_table: {max_pages} pages of page_size {page_size} cover {max_pages * page_size} "
                         f"positions, fewer than the {L} columns of scores")
    if row_to_seq is None:
        if B < T:
            raise ValueError(f"block_table: {B} sequences for {T} rows; pass row_to_seq to map rows to sequences")
    else:
        check_tensor("row_to_seq", row_to_seq, dtype=torch.int32, shape=(T,), device=device)


def _check_values(T, L, lengths, block_table, page_size, row_to_seq, num_pages):
    """Range checks on the index tensors, with a single device-to-host copy."""
    names, flags = [], []
    if lengths is not None:
        names.append(f"lengths: every entry must lie in [0, {L}]")
        flags.append(((lengths < 0) | (lengths > L)).any())
    if block_table is not None:
        B = block_table.shape[0]
        dev = block_table.device
        seq = torch.arange(T, device=dev)
        if row_to_seq is not None:
            names.append(f"row_to_seq: every entry must lie in [0, {B})")
            flags.append(((row_to_seq < 0) | (row_to_seq >= B)).any())
            seq = row_to_seq.long().clamp(0, B - 1)
        row_len = torch.full((T,), L, device=dev) if lengths is None else lengths.long().clamp(0, L)
        in_use = pages_in_use(block_table, seq, row_len, page_size)
        limit = min(num_pages or 2**31, 2**31 // page_size)
        names.append(f"block_table: entries of the pages in use must lie in [0, {limit})")
        flags.append((in_use & ((block_table < 0) | (block_table.long() >= limit))).any())  # 2**31: not int32
    for name, bad in zip(names, torch.stack(flags).tolist() if flags else []):
        if bad:
            raise ValueError(name)


def topk_indices(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    block_table: torch.Tensor | None = None,
    page_size: int | None = None,
    row_to_seq: torch.Tensor | None = None,
    num_pages: int | None = None,
    check_values: bool = True,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact top-k positions of each row: ``idx[T, k]`` int32.

    Args:
        scores: ``[T, L]`` fp32, last dimension contiguous (any row stride). ``L`` up to 2^20 and beyond.
        k: 1..4096 (``k > L`` is fine).
        lengths: optional ``[T]`` int32; row t only considers ``s < lengths[t]`` (default: all L).
            Scores at or beyond a row's length are never read, so they may hold anything (NaN).
        block_table: optional ``[B, max_pages]`` int32 with ``max_pages * page_size >= L``: returns
            physical slots ``block_table[seq, i // page_size] * page_size + i % page_size``.
        page_size: page size of ``block_table`` (1 to 2^31 - 1; required with it).
        row_to_seq: optional ``[T]`` int32, the sequence (row of ``block_table``) of each row;
            default row t -> sequence t (then ``B >= T``).
        num_pages: optional size of the paged cache (1 to 2^31 - 1): block-table entries in use must be below it.
        check_values: range-check ``lengths``, ``row_to_seq`` and the block-table entries in use
            (one device-to-host copy) and raise a ValueError naming the argument before launch.
            Skipped inside CUDA-graph capture; pass False in hot loops when the inputs are known good.
            Off, the caller promises ``lengths`` in ``[0, L]``, ``row_to_seq`` in ``[0, B)`` and the
            block-table entries in use in ``[0, num_pages)``: lengths are clamped to ``[0, L]`` either
            way, but a ``row_to_seq`` entry outside ``[0, B)`` makes the kernel read outside
            ``block_table``, and a bad table entry gives slots outside the cache.
        config: launch parameters (default: the tuning database's, else the registered default).
        out: optional ``[T, k]`` int32 contiguous tensor to write (and return).

    Returns:
        ``idx[T, k]`` int32. Row t holds ``min(k, lengths[t])`` indices first, in no particular order
        (it may differ between runs), then -1. Exact: the top k by (score descending, position ascending),
        scores ordered as fp32 sort keys (-0.0 below +0.0): among scores equal to the k-th largest the lowest
        positions are taken, so a row's set of positions never depends on its batch, the launch config or the
        route the kernels take.

    Non-finite scores (inside a row's length; not rejected, with value checks on or off): ``+inf`` is
    the highest score and ``-inf`` a valid, lowest one (taken only when fewer than k larger ones exist).
    NaN, of either sign and any payload, ranks as ``-inf``: a NaN is never taken over a score that is
    not ``-inf`` or NaN, and NaN and ``-inf`` are equal (the lowest positions first).
    """
    key, plan = _PLANS.find((scores, lengths, block_table, row_to_seq, out), (k, page_size, num_pages), config)
    if plan is None:
        plan = _PLANS.put(key, _checked_plan(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, out,
                                             config))
    T, L = plan.T, plan.L
    if check_values and T > 0 and not (scores.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_values(T, L, lengths, block_table, page_size, row_to_seq, num_pages)
    if out is None:
        out = torch.empty(T, k, dtype=torch.int32, device=scores.device)
    return _launch(plan, scores, lengths, block_table, page_size, row_to_seq, out)


_PLANS = PlanCache()


def _checked_plan(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, out, config) -> _Plan:
    _check_arguments(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, out)
    T, L = scores.shape
    shape = {"T": T, "L": L, "k": k}
    if config is None:
        config = LAUNCH.launch_config(PHASE, shape, scores.device)
    else:
        LAUNCH.validate(config, shape)
    return _Plan(T, L, k, lengths is not None, block_table is not None, row_to_seq is not None, config)


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

def _topk(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, check_values, config, out):
    return topk_indices(scores, k, lengths, block_table=block_table, page_size=page_size, row_to_seq=row_to_seq,
                        num_pages=num_pages, check_values=check_values, config=op_config(config), out=out)


@dsa_op("topk_indices")
def topk_indices_op(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                    block_table: torch.Tensor | None = None, page_size: int | None = None,
                    row_to_seq: torch.Tensor | None = None, num_pages: int | None = None, check_values: bool = True,
                    config: str | None = None) -> torch.Tensor:
    """:func:`dt.topk_indices`: ``[T, k]`` int32 positions (physical slots with ``block_table``), -1 padded."""
    return _topk(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, check_values, config, None)


@topk_indices_op.register_fake
def _(scores, k, *args, **kwargs):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


@dsa_op("topk_indices_out", mutates_args=("out",))
def topk_indices_out(scores: torch.Tensor, k: int, out: torch.Tensor, lengths: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, page_size: int | None = None,
                     row_to_seq: torch.Tensor | None = None, num_pages: int | None = None, check_values: bool = True,
                     config: str | None = None) -> None:
    """:func:`dt.topk_indices` into ``out[T, k]`` int32 (contiguous)."""
    _topk(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, check_values, config, out)


@topk_indices_out.register_fake
def _(scores, k, out, *args, **kwargs):
    return None
