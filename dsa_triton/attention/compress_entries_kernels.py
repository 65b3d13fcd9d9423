"""Triton kernel of DeepSeek-V4's compressors (:func:`dsa_triton.compress_entries`; the math:
:mod:`.compress_entries_reference`).

One program per (sequence, window closing in the step): it walks the window's ``C x M`` slots in tiles of
``BLOCK_S`` slots x the whole row (``D`` columns) three times (the gates' maximum, the exponentials' sum, then the
weights times the values, each product rounded to the activation dtype as transformers' product is, summed in fp32),
rounds the pooled row to the activation dtype, norms it in fp32 and rotates its last ``2 R`` dims (interleaved
pairs) by row ``w`` of the tables, and stores it at the entry's slot. A slot's token is a row of the step's inputs
when it is new in this step, else read from the window stream through its block table; a token before position 0
(window 0's overlap) is an empty slot (weight 0). Programs of sequences closing fewer windows return at once.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gate_tile(s0, w, start, row0, seq, gate_ptr, gw_ptr, wtable_ptr, ape_ptr, stride_t, stride_w, stride_wt, cols,
               col_ok, D: tl.constexpr, M: tl.constexpr, C: tl.constexpr, PW: tl.constexpr,
               BLOCK_S: tl.constexpr):
    """Slots ``s0 .. s0 + BLOCK_S`` of window ``w``: their gates plus ``ape``, ``[BLOCK_S, BLOCK_D]`` fp32 (-inf at
    empty slots and padded columns); their elements' offsets in the step's inputs and in the window stream, which
    slots are new in the step, and the mask of real slots and columns."""
    i = s0 + tl.arange(0, BLOCK_S)
    pos = (w - (C - 1)) * M + i  # slot i's token: the previous window's Ca first (C = 2), then this window's
    ok = (i < C * M) & (pos >= 0)
    new = pos >= start
    page = tl.load(wtable_ptr + seq * stride_wt + pos // PW, mask=ok & (pos < start), other=0)
    col = (i // M)[:, None] * D + cols[None, :]  # Ca columns [0, D), Cb columns [D, 2D)
    new_off = (row0 + pos - start).to(tl.int64)[:, None] * stride_t + col
    old_off = (page.to(tl.int64) * PW + pos % PW)[:, None] * stride_w + col
    mask = ok[:, None] & col_ok[None, :]
    is_new = new[:, None]
    g_new = tl.load(gate_ptr + new_off, mask=mask & is_new, other=0.0)
    g_old = tl.load(gw_ptr + old_off, mask=mask & ~is_new, other=0.0)
    ape = tl.load(ape_ptr + (i % M)[:, None] * (C * D) + col, mask=mask, other=0.0)
    g = tl.where(is_new, g_new, g_old).to(tl.float32) + ape
    return tl.where(mask, g, float("-inf")), new_off, old_off, is_new, mask


@triton.jit
def compress_kernel(kv_ptr, gate_ptr, kvw_ptr, gw_ptr, wtable_ptr, out_ptr, otable_ptr, cu_ptr, lens_ptr, ape_ptr,
                    norm_ptr, cos_ptr, sin_ptr, eps, stride_t, stride_w, stride_wt, stride_ot, stride_out,
                    stride_cos, D: tl.constexpr, R: tl.constexpr, M: tl.constexpr, C: tl.constexpr,
                    PW: tl.constexpr, PC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (sequence b, j-th window closing in the step). ``R``: rope pairs; ``D - 2R`` leading dims kept."""
    seq = tl.program_id(0).to(tl.int64)
    row0 = tl.load(cu_ptr + seq)
    end = tl.load(lens_ptr + seq)
    start = end - (tl.load(cu_ptr + seq + 1) - row0)
    w = start // M + tl.program_id(1)
    if w < end // M:
        dtype = out_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        top = tl.full((BLOCK_D,), float("-inf"), tl.float32)
        for s0 in range(0, C * M, BLOCK_S):
            g, _, _, _, _ = _gate_tile(s0, w, start, row0, seq, gate_ptr, gw_ptr, wtable_ptr, ape_ptr, stride_t,
                                       stride_w, stride_wt, cols, col_ok, D, M, C, PW, BLOCK_S)
            top = tl.maximum(top, tl.max(g, axis=0))
        top = tl.where(top == float("-inf"), 0.0, top)  # (padded columns: every slot -inf)
        total = tl.zeros((BLOCK_D,), tl.float32)
        for s0 in range(0, C * M, BLOCK_S):
            g, _, _, _, _ = _gate_tile(s0, w, start, row0, seq, gate_ptr, gw_ptr, wtable_ptr, ape_ptr, stride_t,
                                       stride_w, stride_wt, cols, col_ok, D, M, C, PW, BLOCK_S)
            total += tl.sum(tl.exp(g - top[None, :]), axis=0)
        total = tl.where(total == 0.0, 1.0, total)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for s0 in range(0, C * M, BLOCK_S):
            g, new_off, old_off, is_new, mask = _gate_tile(s0, w, start, row0, seq, gate_ptr, gw_ptr, wtable_ptr,
                                                           ape_ptr, stride_t, stride_w, stride_wt, cols, col_ok, D,
                                                           M, C, PW, BLOCK_S)
            p = (tl.exp(g - top[None, :]) / total[None, :]).to(dtype).to(tl.float32)
            v_new = tl.load(kv_ptr + new_off, mask=mask & is_new, other=0.0)
            v_old = tl.load(kvw_ptr + old_off, mask=mask & ~is_new, other=0.0)
            v = tl.where(is_new, v_new, v_old).to(tl.float32)
            acc += tl.sum((p * v).to(dtype).to(tl.float32), axis=0)
        x = tl.where(col_ok, acc.to(dtype).to(tl.float32), 0.0)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = ((x * scale) * tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)).to(dtype)
        even, odd = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_D // 2, 2)))
        pair = tl.arange(0, BLOCK_D // 2) - (D // 2 - R)  # rope pair index (< 0: a kept dim)
        rope = (pair >= 0) & (pair < R)
        w64 = w.to(tl.int64)
        c = tl.load(cos_ptr + w64 * stride_cos + pair, mask=rope, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + w64 * stride_cos + pair, mask=rope, other=0.0).to(tl.float32)
        even, odd = tl.where(rope, even * c - odd * s, even), tl.where(rope, odd * c + even * s, odd)
        y = tl.reshape(tl.join(even, odd), (BLOCK_D,))
        page = tl.load(otable_ptr + seq * stride_ot + w // PC).to(tl.int64)
        tl.store(out_ptr + (page * PC + w % PC) * stride_out + cols, y.to(dtype), mask=col_ok)
