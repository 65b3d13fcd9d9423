"""Triton kernel of the DSA indexer logits: ``score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) * k_scale[s]``.

One kernel, :func:`logits_kernel`, serves three jobs (a constexpr ``MODE``):

- ``DENSE``: token-level logits ``[T, L]`` over the paged FP8 K cache or contiguous FP8 keys. Rows are
  grouped by sequence; a program holds ``BLOCK_M`` rows x ``H`` heads of q (the stationary operand)
  and streams ``CHUNK`` keys of its sequence in tiles of ``BLOCK_N``: per tile one fp8 ``tl.dot``
  ``k[BLOCK_N, DK] x q^T[DK, BLOCK_M * H]``, relu, a weighted sum over the heads (within a thread's
  registers: heads are the dot's N axis), times the key scale. Decode (1-4 rows per sequence) puts all
  rows of a sequence in one program, so the K cache is read once for all of them; long sequences are
  split into chunks across programs (no combine step: output elements are independent).
- ``SELECTED``: the same logits, but only inside chosen pages: column ``c`` of row ``t`` is position
  ``pages[t, c // P] * P + c % P`` (used by :mod:`.block_indexer_logits`).
- ``BOUND``: an upper bound of each page's best score from the page summaries (``pmax``, ``pmin``):
  ``ub_h = q+ . pmax + q- . pmin >= max_k q_h . k``, ``lb_h = q+ . pmin + q- . pmax <= min_k q_h . k``,
  bound = ``sum_h max(w_h, 0) relu(ub_h) + min(w_h, 0) relu(lb_h)`` (used by :mod:`.block_indexer_logits`).
  One accumulator per head: ``w_h >= 0`` needs only ``ub_h``, ``w_h < 0`` only ``lb_h``, so q's sign parts
  are swapped per head and the tile is two chained dots (``pmax``, ``pmin``), then the same relu head-sum.

The chunk's pages are loaded before the tile loop and gathered per tile, so no key load depends on
another load in the loop and Triton pipelines them ``num_stages`` deep. Everything outside ``[0, limit[t])``
is ``-inf``. Every size (heads, head dim, page size) is a parameter. A NaN in q, a weight, a key, a key scale or a
summary makes the scores it enters NaN (relu keeps NaN), never a finite number.
"""
from __future__ import annotations

import triton
import triton.language as tl

DENSE, SELECTED, BOUND = 0, 1, 2  # the kernel's MODE
NAN = tl.constexpr(tl.PropagateNan.ALL)  # relu and sign splits keep NaN (the GPU's plain max returns the other operand)


@triton.jit
def _tile_keys(n0, c0, c_active, phys, lpages, key_start, max_limit,
               MODE: tl.constexpr, PAGED: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns ``n0 .. n0 + BLOCK_N`` of the chunk starting at ``c0``: ``(cols, col_ok, logical
    positions, physical key rows)``; ``phys`` / ``lpages`` hold the chunk's physical / logical pages."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < c_active
    if MODE == 2:  # BOUND: a column is a page
        pos = cols * P
        krow = tl.gather(phys, tl.minimum(cols - c0, phys.shape[0] - 1), 0).to(tl.int64)
    elif PAGED:
        slot = tl.minimum(cols // P - c0 // P, phys.shape[0] - 1)
        if MODE == 1:  # SELECTED
            lpage = tl.gather(lpages, slot, 0)
            pos = lpage * P + cols % P
            col_ok = col_ok & (lpage >= 0) & (pos < max_limit)
        else:
            pos = cols
        krow = tl.gather(phys, slot, 0).to(tl.int64) * P + cols % P
    else:
        pos = cols
        krow = key_start + pos
    return cols, col_ok, pos, krow


@triton.jit
def logits_kernel(
    q_ptr, w_ptr, k_ptr, k2_ptr, ks_ptr, out_ptr, pos_ptr,
    limit_ptr, cu_ptr, table_ptr, kstart_ptr, pages_ptr,
    H, n_cols,
    stride_qt, stride_qh, stride_wt, stride_k, stride_table, stride_out, stride_pages,
    MODE: tl.constexpr, PAGED: tl.constexpr, P: tl.constexpr,
    DK: tl.constexpr, HP: tl.constexpr, DKP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, NPG: tl.constexpr,
    BOUND_DTYPE: tl.constexpr,
):
    """Program (sequence, row block, column chunk). Sequence g owns query rows cu[g]..cu[g+1]."""
    g = tl.program_id(0)
    row0 = tl.load(cu_ptr + g)
    row1 = tl.load(cu_ptr + g + 1)
    m_start = row0 + tl.program_id(1) * BLOCK_M
    if m_start < row1:
        seq = g.to(tl.int64)
        rows = m_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row1
        limits = tl.load(limit_ptr + rows, mask=row_ok, other=0)

        # q rows r = m * HP + h (heads padded to HP with zero q and zero weight)
        offs_r = tl.arange(0, BLOCK_M * HP)
        q_row = m_start + offs_r // HP
        head = offs_r % HP
        r_ok = (q_row < row1) & (head < H)
        offs_d = tl.arange(0, DKP)
        d_ok = offs_d < DK
        q = tl.load(q_ptr + q_row[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + q_row.to(tl.int64) * stride_wt + head, mask=r_ok, other=0.0)
        if MODE == 2:  # BOUND: q split by sign (exact in bf16), the parts swapped where the weight is < 0
            qf = q.to(tl.float32)
            q_pos, q_neg = tl.maximum(qf, 0.0, propagate_nan=NAN), tl.minimum(qf, 0.0, propagate_nan=NAN)
            up = (w >= 0.0)[:, None]
            q_max = tl.trans(tl.where(up, q_pos, q_neg).to(BOUND_DTYPE))  # multiplies pmax
            q_min = tl.trans(tl.where(up, q_neg, q_pos).to(BOUND_DTYPE))  # multiplies pmin
        else:
            q_t = tl.trans(q)

        # columns this program computes; past the rows' largest limit (DENSE, BOUND) only -inf is stored
        c0 = tl.program_id(2) * CHUNK
        c_end = tl.minimum(c0 + CHUNK, n_cols)
        if MODE == 0:
            c_active = tl.minimum(c_end, tl.max(limits))
        elif MODE == 2:
            c_active = tl.minimum(c_end, tl.cdiv(tl.max(limits), P))
        else:
            c_active = c_end
        out_rows = out_ptr + rows.to(tl.int64) * stride_out
        # the chunk's NPG physical pages (BOUND: one per column), loaded before the loop: the loop's key
        # loads then depend on no load inside the loop, and Triton pipelines them num_stages deep
        slots = tl.arange(0, NPG)
        lpages = slots  # logical pages (SELECTED)
        key_start = 0  # first key row (contiguous keys)
        if MODE == 2:
            phys = tl.load(table_ptr + seq * stride_table + c0 + slots, mask=c0 + slots < c_active, other=0)
        elif MODE == 1:
            lpages = tl.load(pages_ptr + m_start.to(tl.int64) * stride_pages + c0 // P + slots,
                             mask=(c0 // P + slots) * P < c_end, other=-1)
            phys = tl.load(table_ptr + seq * stride_table + lpages, mask=lpages >= 0, other=0)
        elif PAGED:
            phys = tl.load(table_ptr + seq * stride_table + c0 // P + slots, mask=(c0 // P + slots) * P < c_active,
                           other=0)
        else:
            phys = slots
            key_start = tl.load(kstart_ptr + seq).to(tl.int64)
        max_limit = tl.max(limits)
        if MODE != 2:  # key scales, one tile ahead (the pipeliner only prefetches the dot's operands)
            _, next_ok, _, next_krow = _tile_keys(c0, c0, c_active, phys, lpages, key_start, max_limit,
                                                  MODE, PAGED, P, BLOCK_N)
            next_scale = tl.load(ks_ptr + next_krow, mask=next_ok, other=0.0)
        for n0 in range(c0, c_active, BLOCK_N):
            cols, col_ok, pos, krow = _tile_keys(n0, c0, c_active, phys, lpages, key_start, max_limit,
                                                 MODE, PAGED, P, BLOCK_N)
            k_mask = col_ok[:, None] & d_ok[None, :]
            k_off = krow[:, None] * stride_k + offs_d[None, :]
            if MODE == 2:
                k_max = tl.load(k_ptr + k_off, mask=k_mask, other=0.0).to(BOUND_DTYPE)
                k_min = tl.load(k2_ptr + k_off, mask=k_mask, other=0.0).to(BOUND_DTYPE)
                # w >= 0: ub = q+ . pmax + q- . pmin; w < 0: lb = q- . pmax + q+ . pmin (exact products)
                s = tl.maximum(tl.dot(k_min, q_min, tl.dot(k_max, q_max)), 0.0, propagate_nan=NAN) * w[None, :]
            else:
                k = tl.load(k_ptr + k_off, mask=k_mask, other=0.0)
                k_scale = next_scale
                _, next_ok, _, next_krow = _tile_keys(n0 + BLOCK_N, c0, c_active, phys, lpages, key_start,
                                                      max_limit, MODE, PAGED, P, BLOCK_N)
                next_scale = tl.load(ks_ptr + next_krow, mask=next_ok, other=0.0)
                s = tl.maximum(tl.dot(k, q_t), 0.0, propagate_nan=NAN) * w[None, :]  # [BLOCK_N, BLOCK_M * HP]
            if BLOCK_M == 1:  # heads are the dot's N axis: the sum stays within a thread and its quad
                s = tl.sum(s, axis=1)[:, None]
            else:
                s = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, HP)), axis=2)  # [BLOCK_N, BLOCK_M]
            if MODE != 2:
                s = s * k_scale[:, None]
            valid = col_ok[:, None] & (pos[:, None] < limits[None, :])
            s = tl.where(valid, s, float("-inf"))
            tl.store(out_rows[None, :] + cols[:, None], s, mask=row_ok[None, :] & (cols < c_end)[:, None])
            if MODE == 1:
                tl.store(pos_ptr + m_start.to(tl.int64) * stride_out + cols, tl.where(col_ok, pos, -1), mask=cols < c_end)
        fill_start = c0 + tl.cdiv(tl.maximum(c_active - c0, 0), BLOCK_N) * BLOCK_N
        for n0 in range(fill_start, c_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_rows[None, :] + cols[:, None], tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32),
                     mask=row_ok[None, :] & (cols < c_end)[:, None])
