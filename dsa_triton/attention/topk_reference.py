"""Pure-PyTorch top-k oracle and the agreement check for :func:`dsa_triton.topk_indices`.

Ordering of scores is the order of their *sort keys*: fp32 bit patterns mapped to int32 so that integer
order equals float order (-inf lowest, -0.0 just below +0.0); NaN is mapped to the key of -inf.
Positions at or beyond a row's length get ``INVALID_KEY``, below every real key, and are never selected.
"""
from __future__ import annotations

import torch

INVALID_KEY = -(2**31)  # below the key of -inf
NEG_INF_KEY = -0x7F800000 - 1  # sort key of -inf (and of NaN)


def sort_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., L]`` -> int32 keys with the same order as the floats; NaN ranks as -inf."""
    bits = scores.contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.where(torch.isnan(scores), torch.full_like(keys, NEG_INF_KEY), keys)


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

    Same semantics as the kernel (only ``s < lengths[t]`` is selectable, NaN ranks as -inf, optional
    translation to physical slots); the kernel's order within a row is unspecified, this one is sorted.
    """
    T, L = scores.shape
    keys = masked_keys(scores, lengths)
    top = torch.topk(keys, min(k, L), dim=1)
    idx = torch.where(top.values > INVALID_KEY, top.indices, -1).to(torch.int32)
    idx = torch.cat([idx, idx.new_full((T, k - idx.shape[1]), -1)], dim=1)
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
    """None if ``idx`` selects the same multiset of scores as ``ref_idx`` (ties free), else what is wrong.

    Checks: shape and dtype; the first ``min(k, n_t)`` entries of row t are indices and the rest -1;
    every index is a selectable position of its row (after inverting the block table) and none repeats;
    the sorted sort keys of the selection equal those of the reference's.
    """
    T, L = scores.shape
    if idx.shape != (T, k) or idx.dtype != torch.int32:
        return f"idx: expected int32 {(T, k)}, got {idx.dtype} {tuple(idx.shape)}"
    n = valid_lengths(scores, lengths)
    filled = torch.arange(k, device=idx.device)[None, :] < n.clamp(max=k)[:, None]
    keys = sort_keys(scores)

    def selected_keys(sel: torch.Tensor, who: str) -> torch.Tensor | str:
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
        return torch.where(filled, picked, INVALID_KEY).sort(dim=1, descending=True).values

    want = selected_keys(ref_idx, "reference")
    if isinstance(want, str):
        return want
    got = selected_keys(idx, "idx")
    if isinstance(got, str):
        return got
    if not torch.equal(got, want):
        t = int((got != want).any(dim=1).nonzero()[0])
        rank = int((got[t] != want[t]).nonzero()[0])
        return f"idx row {t}: the selected scores differ from the exact top-{k} (first at rank {rank})"
    return None
