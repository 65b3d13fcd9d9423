"""Pure-PyTorch top-k oracle and the agreement check for :func:`dsa_triton.topk_indices`.

Ordering of scores is the order of their *sort keys*: fp32 bit patterns mapped to int32 so that integer
order equals float order (-inf lowest, -0.0 just below +0.0); NaN is mapped to the key of -inf. Among equal keys
the lower position ranks first, so a row's top k is one set of positions, whatever its batch.
Positions at or beyond a row's length get ``INVALID_KEY``, below every real key, and are never selected.
"""
from __future__ import annotations

import torch

INVALID_KEY = -(2**31)  # below the key of -inf
NEG_INF_KEY = -0x7F800000 - 1  # sort key of -inf (and of NaN)
REFERENCE_BYTES = 1 << 30  # int64 position keys of :func:`topk_indices_torch`, rows at a time


def sort_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., L]`` -> int32 keys with the same order as the floats; NaN ranks as -inf."""
    bits = scores.contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.where(torch.isnan(scores), torch.full_like(keys, NEG_INF_KEY), keys)


def position_keys(keys: torch.Tensor) -> torch.Tensor:
    """int32 sort keys ``[..., L]`` -> int64 keys of the same order in which, among equal keys, the lower position
    ranks first: every key of a row distinct, so a top-k of them is one set of positions (``torch.topk`` breaks
    ties its own way)."""
    positions = torch.arange(keys.shape[-1], device=keys.device)
    return (keys.long() << 32) | (2**31 - 1 - positions)


def valid_lengths(scores: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Per-row count of selectable positions, ``[T]`` int64 (lengths clamped to ``[0, L]``)."""
    T, L = scores.shape
    if lengths is None:
        return torch.full((T,), L, dtype=torch.int64, device=scores.device)
    return lengths.to(torch.int64).clamp(0, L)


def masked_keys(scores: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Sort keys with ``INVALID_KEY`` at positions ``s >= lengths[t]``: ``[T, L]`` int32."""
    n = valid_lengths(scores, lengths)
    pos = torch.arange(scores.shape[1], device=scores.device)
    return torch.where(pos[None, :] < n[:, None], sort_keys(scores), torch.full_like(scores, INVALID_KEY, dtype=torch.int32))


def row_sequences(T: int, row_to_seq: torch.Tensor | None, device) -> torch.Tensor:
    """Sequence of each row, ``[T]`` int64: ``row_to_seq`` or the identity."""
    return torch.arange(T, device=device) if row_to_seq is None else row_to_seq.to(torch.int64)


def to_physical(idx: torch.Tensor, block_table: torch.Tensor, page_size: int, row_to_seq: torch.Tensor | None) -> torch.Tensor:
    """Logical positions ``idx[T, k]`` (-1 kept) -> slots ``block_table[seq, i // P] * P + i % P``."""
    seq = row_sequences(idx.shape[0], row_to_seq, idx.device)
    safe = idx.clamp(min=0).to(torch.int64)
    pages = block_table[seq[:, None], safe // page_size].to(torch.int64)
    return torch.where(idx >= 0, pages * page_size + safe % page_size, -1).to(torch.int32)


def topk_indices_torch(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    block_table: torch.Tensor | None = None,
    page_size: int | None = None,
    row_to_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for :func:`dsa_triton.topk_indices`: ``idx[T, k]`` int32, descending by score, -1 padded.

    Same semantics as the kernel (only ``s < lengths[t]`` is selectable, NaN ranks as -inf, among equal keys the
    lower position first: :func:`position_keys`; optional translation to physical slots); the kernel's order within
    a row is unspecified, this one is sorted. Rows are taken :data:`REFERENCE_BYTES` of int64 keys at a time.
    """
    T, L = scores.shape
    keys = masked_keys(scores, lengths)
    idx = torch.full((T, k), -1, dtype=torch.int32, device=scores.device)
    step = max(1, REFERENCE_BYTES // max(1, 8 * L))
    for r0 in range(0, T, step):
        top = torch.topk(position_keys(keys[r0:r0 + step]), min(k, L), dim=1)
        idx[r0:r0 + step, :min(k, L)] = torch.where((top.values >> 32) > INVALID_KEY, top.indices, -1).to(torch.int32)
    if block_table is not None:
        idx = to_physical(idx, block_table, page_size, row_to_seq)
    return idx


def pages_in_use(block_table: torch.Tensor, seq: torch.Tensor, row_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B, max_pages]`` bool: page j of sequence b is in use when a row t of b (``seq[t] == b``, int64) has
    ``row_len[t] > j * page_size``."""
    B, max_pages = block_table.shape
    pages = torch.zeros(B, dtype=torch.int64, device=block_table.device)
    pages.scatter_reduce_(0, seq, (row_len + page_size - 1) // page_size, reduce="amax")
    return torch.arange(max_pages, device=block_table.device)[None, :] < pages[:, None]


def to_logical(idx: torch.Tensor, block_table: torch.Tensor, page_size: int, row_to_seq: torch.Tensor | None,
               lengths: torch.Tensor) -> torch.Tensor:
    """Invert :func:`to_physical` over each sequence's pages in use; a slot outside them maps to -2."""
    B = block_table.shape[0]
    seq = row_sequences(idx.shape[0], row_to_seq, idx.device)
    used = pages_in_use(block_table, seq, lengths, page_size)
    table = block_table.to(torch.int64)
    n_phys = int(table[used].max().item()) + 1 if bool(used.any()) else 1
    inverse = torch.full((B, n_phys), -1, dtype=torch.int64, device=idx.device)
    rows, cols = used.nonzero(as_tuple=True)
    inverse[rows, table[rows, cols]] = cols
    slot = idx.to(torch.int64)
    page = slot.div(page_size, rounding_mode="floor")
    in_range = (slot >= 0) & (page < n_phys)
    logical_page = inverse[seq[:, None], page.clamp(0, n_phys - 1)]
    logical = logical_page * page_size + slot % page_size
    logical = torch.where(in_range & (logical_page >= 0), logical, -2)
    return torch.where(idx == -1, -1, logical)


def check_topk(
    idx: torch.Tensor,
    ref_idx: torch.Tensor,
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    *,
    block_table: torch.Tensor | None = None,
    page_size: int | None = None,
    row_to_seq: torch.Tensor | None = None,
) -> str | None:
    """None if ``idx`` selects the same positions as ``ref_idx`` (in any order within a row), else what is wrong.

    Checks: shape and dtype; the first ``min(k, n_t)`` entries of row t are indices and the rest -1;
    every index is a selectable position of its row (after inverting the block table) and none repeats;
    the sorted sort keys of the selection equal those of the reference's (the scores are the top k), then the
    positions themselves (ties went to the lowest positions).
    """
    T, L = scores.shape
    if idx.shape != (T, k) or idx.dtype != torch.int32:
        return f"idx: expected int32 {(T, k)}, got {idx.dtype} {tuple(idx.shape)}"
    n = valid_lengths(scores, lengths)
    filled = torch.arange(k, device=idx.device)[None, :] < n.clamp(max=k)[:, None]
    keys = sort_keys(scores)

    def selected(sel: torch.Tensor, who: str) -> tuple[torch.Tensor, torch.Tensor] | str:
        """The selection's sort keys (descending) and logical positions (ascending), or what is wrong."""
        wrong = (sel == -1) == filled
        if bool(wrong.any()):
            t = int(wrong.any(dim=1).nonzero()[0])
            return f"{who} row {t}: expected {int(filled[t].sum())} indices then -1, got {sel[t].tolist()[:12]}..."
        logical = sel.to(torch.int64)
        if block_table is not None:
            logical = to_logical(sel, block_table, page_size, row_to_seq, n)
        outside = filled & ((logical < 0) | (logical >= n[:, None]))
        if bool(outside.any()):
            t, j = (int(v) for v in outside.nonzero()[0])
            return f"{who} row {t}: index {int(sel[t, j])} is not a selectable position (logical {int(logical[t, j])}, length {int(n[t])})"
        ordered = torch.where(filled, logical, L + torch.arange(k, device=sel.device)).sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(repeated.any()):
            return f"{who} row {int(repeated.nonzero()[0])}: an index is selected twice"
        picked = keys.gather(1, logical.clamp(0, max(L - 1, 0))) if L else torch.zeros_like(logical, dtype=torch.int32)
        return torch.where(filled, picked, INVALID_KEY).sort(dim=1, descending=True).values, ordered

    want = selected(ref_idx, "reference")
    if isinstance(want, str):
        return want
    got = selected(idx, "idx")
    if isinstance(got, str):
        return got
    for what, g, w in (("scores differ from the exact top-{k}", got[0], want[0]),
                       ("positions differ from the top-{k}'s (ties: the lowest positions)", got[1], want[1])):
        if not torch.equal(g, w):
            t = int((g != w).any(dim=1).nonzero()[0])
            rank = int((g[t] != w[t]).nonzero()[0])
            return f"idx row {t}: the selected {what.format(k=k)} (first at rank {rank})"
    return None


def _key_to_float(key: int) -> float:
    """Inverse of the sort-key map for one int32 key (the map is its own inverse)."""
    k = torch.tensor([key], dtype=torch.int32)
    return float((k ^ ((k >> 31) & 0x7FFFFFFF)).view(torch.float32))


def _key(x: float) -> int:
    return int(sort_keys(torch.tensor([x], dtype=torch.float32))[0])


def _wrap32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def emulate_bound(row: torch.Tensor, k: int, config: dict, n: int | None = None, L: int | None = None) -> dict:
    """Passes 1-2 of :func:`dsa_triton.topk_indices` on one row, emulated in PyTorch with the kernels' integer and
    fp32 math (see :mod:`.topk_indices_kernels`): the bin window, ``tau``, the candidate count and the route of pass 3.

    ``row``: fp32 scores, the first ``n`` selectable (default all); ``L``: the scores' width (default
    ``row.numel()``, only for ``cap``); ``config``: the op's launch config. Returns a dict: ``lo``, ``hi`` (the
    window's sample values), ``key_lo`` and ``shift`` (key bins) or ``step`` (> 0: value bins from ``lo``), ``tau``,
    ``count``, ``cap``, ``route`` (``"all"`` for n <= k, ``"short"``, ``"buffer"`` or ``"row"``: pass 3 over the whole
    row) and ``kth`` (the k-th largest score, for comparison). The count equals the kernels' except where a group
    holds a NaN (its maximum here ignores the NaN, as on the GPU; the interpreter's is NaN) or the GPU contracts
    ``tau``'s multiply-add (value bins: one rounding).
    """
    row = row.detach().float().cpu().reshape(-1)
    n = row.numel() if n is None else n
    L = row.numel() if L is None else L
    x = row[:n]
    NB = 1 << config["HIST_BITS"]
    GROUP, TILE = config["GROUP"], config["TILE"]
    cap = min(config["CAP_K"] * k, L)
    group_min = 2 * k * GROUP
    route_min = min(config["ROUTE_MIN"] * k, group_min)
    out = {"cap": cap, "count": None, "tau": None, "lo": None, "hi": None, "key_lo": None, "shift": None, "step": None,
           "kth": float(x.topk(min(k, n)).values[-1]) if n else None}
    if n <= k:
        return {**out, "route": "all"}
    if n < route_min:
        return {**out, "route": "short"}
    every = config["ROUTE_MIN"] * k < group_min and n < group_min
    # the window, from a fixed sample: 32 pieces of 16 scores
    offs = torch.arange(32)[:, None] * (n // 32) + torch.arange(16)[None, :]
    s = torch.where(offs < n, row[offs.clamp(max=max(n - 1, 0))], float("-inf"))
    piece_max = torch.where(s.abs() < float("inf"), s, float("-inf")).amax(1)
    ascending = torch.where(piece_max > float("-inf"), piece_max, float("inf")).sort().values
    lo = float(ascending[2]) + 0.0  # (a sum in the kernel: -0.0 becomes +0.0)
    if every:
        at = (torch.arange(128) // 4) * (n // 32) + torch.arange(128) % 4
        v = torch.where(at < n, row[at.clamp(max=max(n - 1, 0))], float("-inf"))
        v = torch.where(v.abs() < float("inf"), v, float("-inf"))
        finite = int((v > float("-inf")).sum())
        rank = min(2 * k * 128 // max(n, 1), finite - 1)
        if finite >= 3:
            lo = float(v.sort(descending=True).values[rank]) + 0.0
    hi = float(piece_max.max())
    found = lo <= hi
    key_lo = _key(lo)
    span = 2 * (_key(hi) - key_lo)
    shift = sum(1 for j in range(64) if (span >> j) >= NB - 2)
    if not found:
        key_lo, shift = -(2**31), 32 - config["HIST_BITS"]
    width = float(torch.tensor(hi, dtype=torch.float32) - torch.tensor(lo, dtype=torch.float32))
    value = found and not every and lo <= 0.0 < hi and 2.0**-100 < width < 2.0**120
    step = width / (1 << (config["HIST_BITS"] - 1)) if value else 0.0
    # pass 1's histogram: of every score, or of the column maxima of GROUP x TILE/GROUP tiles at multiples of TILE
    xk = torch.where(torch.isnan(x), float("-inf"), x)
    if every:
        counted = xk
    else:
        cols = TILE // GROUP
        full = n // TILE * TILE
        maxima = [xk[:full].view(-1, GROUP, cols).amax(1).reshape(-1)]
        if full < n:
            tail = torch.full((TILE,), float("-inf"))
            tail[:n - full] = xk[full:]
            maxima.append(tail.view(GROUP, cols).amax(0)[:min(cols, n - full)])
        counted = torch.cat(maxima)
    if value:  # the kernel's float math (fp32 throughout)
        lo_t, step_t = torch.tensor(lo, dtype=torch.float32), torch.tensor(step, dtype=torch.float32)
        top = lo_t + (NB - 1) * step_t
        clamped = torch.where(counted >= lo_t, torch.where(counted < top, counted, top), lo_t)
        f = ((clamped - lo_t) * (1.0 / step_t)).to(torch.int32).clamp(max=NB - 2)
        bins = torch.where(counted >= lo_t, f.long() + 1, 0)
    else:
        d = sort_keys(counted).long() - key_lo
        bins = torch.where(d < 0, 0, (d >> shift).clamp(max=NB - 2) + 1)
    hist = torch.bincount(bins, minlength=NB)
    at_or_above = hist.flip(0).cumsum(0).flip(0)
    dk = int((at_or_above >= k).sum()) - 1
    if dk < 0:
        tau = float("nan")
    elif dk == 0:
        tau = float("-inf")
    elif value:
        tau = float(lo_t + (torch.tensor(dk - 1, dtype=torch.float32) - 0.0625) * step_t)
    else:
        tau = _key_to_float(_wrap32(key_lo + ((dk - 1) << shift)))
    count = int((x >= tau).sum())
    route = "buffer" if k <= count <= cap and tau > float("-inf") else "row"  # (tau -inf: skipped NaN tie with it)
    return {**out, "lo": lo, "hi": hi, "key_lo": key_lo, "shift": shift, "step": step, "tau": tau, "count": count,
            "route": route}
