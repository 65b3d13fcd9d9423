"""The Triton kernel of :func:`.sort_and_align.sort_and_align`: one program sorts the routed slots by expert and
lays them out block-aligned (the three steps are in :mod:`.sort_and_align`'s docstring).
"""
from __future__ import annotations

import triton
import triton.language as tl

_ABOVE_ALL = tl.constexpr(2 ** 31 - 1)  # sort key of the lanes past M


@triton.jit
def _lower_bound(sorted_ptr, n, value, STEPS: tl.constexpr):
    """Per element of ``value``: the first index ``i < n`` with ``sorted[i] >= value`` (``n`` if none) in the
    ascending int32 array at ``sorted_ptr``. ``STEPS`` >= bit length of ``n``."""
    lo = tl.zeros_like(value)
    hi = lo + n
    for _ in tl.static_range(STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = open_ & (tl.load(sorted_ptr + mid, mask=open_, other=0) < value)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    return lo


@triton.jit
def _permute_kernel(ids_ptr, weights_ptr, offsets_ptr, slot_ptr, token_ptr, expert_ptr, slot_row_ptr, weight_ptr,
                    padded_ptr, shift_ptr, M, top_k, E, block_m, P, stride_it, stride_ik, stride_wt, stride_wk,
                    WEIGHTS: tl.constexpr, ALIGN: tl.constexpr, M_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                    PAD_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """The :class:`.permute.ExpertSort` rows of ``M`` slots (``ids[t, j]`` is slot ``t * top_k + j``) and,
    when ``ALIGN``, ``padded [2, P]`` (rows | experts) with ``shift [E]`` as scratch. ``WEIGHTS``: 0 none
    written (a view of the weights), 1 ones, 2 the routing weights as fp32 (slot order)."""
    s = tl.arange(0, M_BLOCK)
    real = s < M
    token = s // top_k
    expert = tl.load(ids_ptr + token * stride_it + (s - token * top_k) * stride_ik, mask=real, other=0)
    expert = tl.where((expert >= 0) & (expert < E), expert, E).to(tl.int32)  # bad ids (unchecked) sort last
    key = tl.sort(tl.where(real, expert * M + s, _ABOVE_ALL))
    row_slot = key % M
    row_expert = key // M
    tl.store(slot_ptr + s, row_slot, mask=real)
    tl.store(token_ptr + s, row_slot // top_k, mask=real)
    tl.store(expert_ptr + s, row_expert, mask=real)
    tl.store(slot_row_ptr + row_slot, s, mask=real)
    if WEIGHTS == 1:
        tl.store(weight_ptr + s, tl.full([M_BLOCK], 1.0, tl.float32), mask=real)
    if WEIGHTS == 2:
        w = tl.load(weights_ptr + token * stride_wt + (s - token * top_k) * stride_wk, mask=real, other=0.0)
        tl.store(weight_ptr + s, w.to(tl.float32), mask=real)
    tl.debug_barrier()  # the sorted experts are in memory for the binary searches

    e = tl.arange(0, E_BLOCK)
    first = _lower_bound(expert_ptr, M, e, STEPS)
    end = _lower_bound(expert_ptr, M, e + 1, STEPS)
    tl.store(offsets_ptr + e, first, mask=e < E)
    tl.store(offsets_ptr + e + 1, end, mask=e == E - 1)
    if ALIGN:
        padded_expert_ptr = padded_ptr + P
        count = tl.where(e < E, end - first, 0)
        padding = (block_m - count % block_m) % block_m
        shift = tl.cumsum(padding, 0) - padding
        tl.store(shift_ptr + e, shift, mask=e < E)  # scratch
        tl.debug_barrier()  # the shifts are in memory for the gather by expert
        position = s + tl.load(shift_ptr + tl.minimum(row_expert, E - 1), mask=real, other=0)
        row_ok = real & (position < P)
        tl.store(padded_ptr + position, s, mask=row_ok)
        tl.store(padded_expert_ptr + position, row_expert, mask=row_ok)
        j = tl.arange(0, PAD_BLOCK)[None, :]
        pad_position = (first + shift + count)[:, None] + j
        pad_ok = (j < padding[:, None]) & (pad_position < P)
        tl.store(padded_ptr + pad_position, -1, mask=pad_ok)
        tl.store(padded_expert_ptr + pad_position, -1, mask=pad_ok)
        used = M + tl.sum(padding, 0)  # padded positions of the used blocks; the tail past them is -1
        for start in range(M // TAIL_BLOCK * TAIL_BLOCK, P, TAIL_BLOCK):
            p = start + tl.arange(0, TAIL_BLOCK)
            tail = (p >= used) & (p < P)
            tl.store(padded_ptr + p, -1, mask=tail)
            tl.store(padded_expert_ptr + p, -1, mask=tail)
