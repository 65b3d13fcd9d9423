"""Triton kernels of sparse paged attention (decode and prefill share them) and their launcher.

One program owns ``BLOCK_H`` query rows of one index row (the heads, times the query tokens that share the
index set) and one split of the ``k`` selected tokens. Per tile of ``BLOCK_N`` tokens it gathers the cache
rows by physical slot (logical positions go through ``_logical_to_slots`` first), scores them against every
query row at once (``tl.dot(q[BLOCK_H, D], k[D, BLOCK_N])``, the head dim taken as a ``D_V`` part plus a
``D_R`` = D - D_V rope part: 512 + 64 for DSA), and accumulates ``p @ v`` with ``v`` = the ``D_V`` part of the
same tile (MQA: one load serves every head). Online softmax in base 2; invalid slots (negative, or outside the
cache) are masked and never read. With ``num_splits > 1`` each split writes a normalised fp32 partial and its
lse, and ``_combine_splits`` merges them, weighted by ``exp(lse_split - lse)``.

FP8 latent cache (``KV_FP8``; layout in :mod:`.formats`): a gathered row is one contiguous read of its
bytes (656 for DSA): the ``D_V`` e4m3 latent bytes as a ``[BLOCK_N, groups, 128]`` tile, times the fp32 scale of
each 128-value group, converted to q's dtype (exact in bf16: the append op's scales are powers of two), and the
``D_R`` bf16 rope values; then the same two dots as rows in q's dtype.

DeepSeek-V4 (``D_R`` = 0: the values are all ``D_V`` = D dims, rope last): MODEL1 FP8 cache (``MODEL1_NOPE`` > 0,
the quantized values a row; :mod:`.formats`): a token's e4m3 and bf16 bytes at its page's base plus ``t * 576``, its
ue8m0 scales after the page's data, read as one ``[BLOCK_N, D_V / 64, 64]`` tile. A second index set over a second
cache (``HAS_EXTRA``) continues the same online softmax: the tiles of the first set's ``k`` (padded to ``BLOCK_N``),
then those of the second set's ``k2``, one token space that the splits divide, walked by one loop (a loop a set
needs more registers than sm_90 has at 64 x 64 tiles). ``HAS_LEN`` (``HAS_LEN2``): only the
first ``topk_length[r // len_div]`` (``extra_topk_length[r // len2_div]``) indices of row ``r`` count, and the loops
stop there. ``HAS_SINK``: the output (not the lse) is multiplied by ``1 / (1 + exp(sink[h] - lse))`` where the
softmax ends (the single split's program, or the combine).

Hopper notes (Triton 3.6, sm_90a; the measurements are in results/journal/attention.md, the forms tried in
docs/design/sparse_attention.md): a 64 rows x 512 fp32 accumulator is what 8 warps can hold (255 registers, no
spills with BLOCK_N=64, 2 stages, 221 KB shared memory: q and two gathered tiles), so one program runs per SM and 128
heads take two programs per tile (the second gather hits L2). Both dots use wgmma; Triton gives a score dot that
feeds another dot all warps along M, so with 64 rows the two warpgroups compute the same score tile, both reading q
and the tile from shared memory: per 64-token tile about 300 KB of shared-memory reads by our count (not profiled)
for the scores against 64 KB for the value dot, over an SM's 128 bytes a clock. The pipeliner issues the next tile's
gather at the end of the loop body (after a synchronous load of its indices), so the gather overlaps only the value
dot. The row gathers are 16-byte cp.async.

Where a Gluon kernel applies (sm_90, DSA dims, bf16 q: :func:`.sparse_attention_seesaw.gluon_applies`) the op
launches the seesaw kernel of :mod:`.sparse_attention_seesaw` in this one's place (:class:`AttentionLaunch`'s
``gluon_kernel``): the same arguments and outputs, one Gluon kernel for both caches.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..hostmath import cdiv, next_pow2
from ..launch import launch_with
from ..runtime import interpreting
from .formats import LATENT_GROUP
from .sparse_attention_seesaw import _sparse_attention_fwd_seesaw, seesaw_meta

LOG2E = 1.4426950408889634
COMBINE_ELEMENTS = 4096  # fp32 partials one combine program loads at once (32 registers a thread at 4 warps)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tile_mask(rows_ok, offs, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """``rows_ok[:, None] & (offs < LIMIT)``; without the column test when the block is exact (keeps 16-byte loads)."""
    if LIMIT == BLOCK:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (offs < LIMIT)[None, :]


@triton.jit
def _logical_to_slots(idx_ptr, bt_ptr, slot_ptr, k_len, max_pages, num_pages, bt_div, s_ir, s_btr,
                      PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """``slots[r, j] = block_table[r // bt_div, i // P] * P + i % P`` for ``i = idx[r, j]``; -1 where ``i`` is
    negative, past the block table, or maps to a page outside ``[0, num_pages)``. Grid (rows, cdiv(k, BLOCK))."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_k = offs < k_len
    idx = tl.load(idx_ptr + r * s_ir + offs, mask=in_k, other=-1)
    page = idx // PAGE_SIZE
    ok = (idx >= 0) & (page < max_pages)
    phys = tl.load(bt_ptr + (r // bt_div) * s_btr + page, mask=ok, other=-1)
    ok = ok & (phys >= 0) & (phys < num_pages)
    tl.store(slot_ptr + r * k_len + offs, tl.where(ok, phys * PAGE_SIZE + idx % PAGE_SIZE, -1), mask=in_k)


@triton.jit
def _fp8_latent_tile(rows, ok, D_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
                     GROUP: tl.constexpr):
    """The latent part ``[BLOCK_N, BLOCK_DV]`` fp32 of FP8 latent cache rows (byte pointers ``rows``; 0 where
    ``ok`` is off or past ``D_V``): each e4m3 byte times its group's fp32 scale. The tile is loaded as
    ``[BLOCK_N, BLOCK_DV // GROUP, GROUP]``, so a scale broadcasts over its group (``GROUP`` = 128, or the whole
    block when it is narrower)."""
    NG: tl.constexpr = BLOCK_DV // GROUP
    offs_g = tl.arange(0, NG)
    cols = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if D_V == BLOCK_DV:
        mask = ok[:, None, None]
    else:
        mask = ok[:, None, None] & (cols < D_V)[None, :, :]
    x8 = tl.load(rows[:, None, None] + cols[None, :, :], mask=mask, other=0)
    scale_ptr = (rows[:, None] + D_V + 4 * offs_g[None, :]).to(tl.pointer_type(tl.float32))
    scale = tl.load(scale_ptr, mask=ok[:, None] & (offs_g * GROUP < D_V)[None, :], other=0.0)
    x = x8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    return tl.reshape(x, (BLOCK_N, BLOCK_DV))


@triton.jit
def _model1_tile(page, off, ok, NOPE: tl.constexpr, D_V: tl.constexpr, PAGE, BLOCK_N: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """``[BLOCK_N, BLOCK_DV]`` fp32 values of MODEL1 tokens ``off`` of pages ``page`` (byte pointers; 0 where ``ok``
    is off or past ``D_V``): the ``NOPE`` e4m3 values times their 64-value tile's ue8m0 scale, then the bf16 rope
    values, loaded as ``[BLOCK_N, BLOCK_DV // 64, 64]``. With exactly one 64-value rope group at the end (V4: 448 +
    64) the rope is loaded as ``[BLOCK_N, 64]`` and broadcast into the last group, the e4m3 bytes as one unmasked
    row of ``BLOCK_DV`` bytes (the last group's bytes, rope bytes, are read and dropped)."""
    DATA: tl.constexpr = 2 * D_V - NOPE  # e4m3 and bf16 bytes of a token
    TILES: tl.constexpr = NOPE // 64
    NG: tl.constexpr = BLOCK_DV // 64
    ONE_ROPE: tl.constexpr = (NOPE + 64 == D_V) and (D_V == BLOCK_DV)
    offs_g = tl.arange(0, NG)
    cols = (offs_g[:, None] * 64 + tl.arange(0, 64)[None, :])[None, :, :]
    data = page + off * DATA
    if ONE_ROPE:
        x8 = tl.load(data[:, None, None] + cols, mask=ok[:, None, None], other=0)
    else:
        x8 = tl.load(data[:, None, None] + cols, mask=ok[:, None, None] & (cols < NOPE), other=0)
    e = tl.load(page[:, None] + PAGE * DATA + off[:, None] * (TILES + 1) + offs_g[None, :],
                mask=ok[:, None] & (offs_g < TILES)[None, :], other=127).to(tl.int32)
    scale = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)  # 2^(e - 127), subnormal at 0
    scale = tl.where(e == 255, float("nan"), scale)
    x = x8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    rope = (data + NOPE).to(tl.pointer_type(tl.bfloat16))
    if ONE_ROPE:
        r = tl.load(rope[:, None] + tl.arange(0, 64)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        return tl.reshape(tl.where((offs_g < TILES)[None, :, None], x, r[:, None, :]), (BLOCK_N, BLOCK_DV))
    else:
        r = tl.load(rope[:, None, None] + (cols - NOPE), mask=ok[:, None, None] & (cols >= NOPE) & (cols < D_V),
                    other=0.0)
        return tl.reshape(tl.where(cols < NOPE, x, r.to(tl.float32)), (BLOCK_N, BLOCK_DV))


@triton.jit
def _sink_factor(lse, sink):
    """``exp(lse) / (exp(lse) + exp(sink))`` (0 for a sink of +inf, 1 for -inf), 0 for an empty row (lse -inf)."""
    empty = lse == float("-inf")
    return tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))  # (no -inf - -inf)


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """``tl.dot(a, b, acc)``; with ``DOT_FP32`` on fp32 copies of the operands."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attend_tile(acc, m_i, l_i, q_nope, q_rope, idx_row, offs_n, limit, kv_ptr, num_slots, s_kv, s_page, qk_scale,
                 D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr, GROUP: tl.constexpr,
                 ROPE_AT: tl.constexpr, MODEL1_NOPE: tl.constexpr, PAGE: tl.constexpr, second=False,
                 PAGE2: tl.constexpr = 1, TWO: tl.constexpr = False):
    """One tile of ``BLOCK_N`` index columns ``offs_n`` (those ``>= limit`` skipped) of one index row into the online
    softmax ``(acc, m_i, l_i)``: gather the rows (slots negative or ``>= num_slots`` skipped) of a cache in q's
    dtype, the FP8 latent cache or (``MODEL1_NOPE``) the MODEL1 cache of pages ``s_page`` bytes apart, score them
    (``q_rope`` unused without ``D_R``), accumulate ``p @ v``."""
    slot = tl.load(idx_row + offs_n, mask=offs_n < limit, other=-1)
    ok = (slot >= 0) & (slot < num_slots)
    safe = tl.where(ok, slot, 0).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    if MODEL1_NOPE and TWO:  # a tile of either set (``second``): the page sizes are constexprs
        k_nope = _model1_tile(kv_ptr + tl.where(second, safe // PAGE2, safe // PAGE) * s_page,
                              tl.where(second, safe % PAGE2, safe % PAGE), ok, MODEL1_NOPE, D_V,
                              tl.where(second, PAGE2, PAGE), BLOCK_N, BLOCK_DV).to(q_nope.dtype)
    elif MODEL1_NOPE:  # (0: another cache)
        k_nope = _model1_tile(kv_ptr + (safe // PAGE) * s_page, safe % PAGE, ok, MODEL1_NOPE, D_V, PAGE, BLOCK_N,
                              BLOCK_DV).to(q_nope.dtype)
    elif KV_FP8:
        k_nope = _fp8_latent_tile(kv_ptr + safe * s_kv, ok, D_V, BLOCK_N, BLOCK_DV, GROUP).to(q_nope.dtype)
    else:
        k_nope = tl.load((kv_ptr + safe * s_kv)[:, None] + offs_dv[None, :],
                         mask=_tile_mask(ok, offs_dv, D_V, BLOCK_DV), other=0.0)
    qk = _dot(q_nope, tl.trans(k_nope), None, DOT_FP32)
    if D_R > 0:
        rows = kv_ptr + safe * s_kv
        offs_dr = tl.arange(0, BLOCK_DR)
        if KV_FP8:
            rope_rows = (rows + ROPE_AT).to(tl.pointer_type(tl.bfloat16))
            k_rope = tl.load(rope_rows[:, None] + offs_dr[None, :], mask=_tile_mask(ok, offs_dr, D_R, BLOCK_DR),
                             other=0.0).to(q_nope.dtype)
        else:
            k_rope = tl.load(rows[:, None] + D_V + offs_dr[None, :], mask=_tile_mask(ok, offs_dr, D_R, BLOCK_DR),
                             other=0.0)
        qk = _dot(q_rope, tl.trans(k_rope), qk, DOT_FP32)
    qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while nothing is valid yet
    p = tl.exp2(qk - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], DOT_FP32)
    return acc, m_new, l_i


@triton.jit
def _row_length(len_ptr, r, len_div, k_len, HAS_LEN: tl.constexpr):
    """The columns of index row ``r`` that count: ``k_len``, or ``topk_length[r // len_div]`` clamped to
    ``[0, k_len]``."""
    if HAS_LEN:
        return tl.minimum(tl.maximum(tl.load(len_ptr + r // len_div), 0), k_len)
    else:
        return k_len


@triton.jit
def _sparse_attention_fwd(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    M, H, k_len, tokens_per_split, num_slots, qk_scale,
    s_qr, s_qs, s_qh, s_kv, s_ir,
    kv2_ptr, idx2_ptr, len_ptr, len2_ptr, sink_ptr,
    k2_len, k_pad, num_slots2, s_kv2, s_ir2, s_page, s_page2, len_div, len2_div,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr = False, GROUP: tl.constexpr = 128, ROPE_AT: tl.constexpr = 0,
    MODEL1_NOPE: tl.constexpr = 0, PAGE: tl.constexpr = 1, PAGE2: tl.constexpr = 1,
    HAS_EXTRA: tl.constexpr = False, HAS_LEN: tl.constexpr = False, HAS_LEN2: tl.constexpr = False,
    HAS_SINK: tl.constexpr = False,
):
    """Query row (r, m) is ``q_ptr + r*s_qr + (m // H)*s_qs + (m % H)*s_qh``; outputs are contiguous
    ``[R, M, NUM_SPLITS, D_V]`` and lse ``[R, M, NUM_SPLITS]`` (with one split: the final out and lse).
    ``DOT_FP32``: upcast the dot operands to fp32 (bf16 in the interpreter, whose bf16 ``tl.dot`` is wrong);
    the probabilities are rounded to the cache dtype first either way. A NaN score makes ``l_i`` NaN, and
    out and lse NaN with it (only ``l_i == 0`` is an empty row); so does a +inf score (``exp2(inf - inf)``); a -inf
    score adds 0. ``KV_FP8``: ``kv_ptr`` holds FP8 latent cache
    rows of ``s_kv`` bytes (rope values at byte ``ROPE_AT``), dequantized into q's dtype (the "cache dtype"
    above). The second set (``HAS_EXTRA``: ``kv2_ptr``, ``idx2_ptr`` ``[R, k2_len]``, ...) takes the token space's
    columns from ``k_pad`` on; the pointers and sizes of a feature that is off are not read (None, 0)."""
    pid = tl.program_id(0)
    num_hb = tl.cdiv(M, BLOCK_H)
    hb = pid % num_hb
    split = (pid // num_hb) % NUM_SPLITS
    r = (pid // num_hb // NUM_SPLITS).to(tl.int64)

    offs_m = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_ok = offs_m < M
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + r * s_qr + (offs_m // H) * s_qs + (offs_m % H) * s_qh
    q_nope = tl.load(q_rows[:, None] + offs_dv[None, :], mask=_tile_mask(m_ok, offs_dv, D_V, BLOCK_DV), other=0.0)
    q_rope = q_nope  # (unused without a rope part)
    if D_R > 0:
        offs_dr = tl.arange(0, BLOCK_DR)
        q_rope = tl.load(q_rows[:, None] + D_V + offs_dr[None, :], mask=_tile_mask(m_ok, offs_dr, D_R, BLOCK_DR),
                         other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    lo = split * tokens_per_split
    hi = lo + tokens_per_split
    end = tl.minimum(hi, _row_length(len_ptr, r, len_div, k_len, HAS_LEN))
    if HAS_EXTRA:  # one loop over the tiles of both sets (two loops spill on sm_90 at 64 x 64 tiles)
        lo2 = tl.maximum(lo - k_pad, 0)
        end2 = tl.minimum(hi - k_pad, _row_length(len2_ptr, r, len2_div, k2_len, HAS_LEN2))
        n1 = tl.cdiv(tl.maximum(end - lo, 0), BLOCK_N)
        n2 = tl.cdiv(tl.maximum(end2 - lo2, 0), BLOCK_N)
        for t in range(0, n1 + n2):
            second = t >= n1
            start = tl.where(second, lo2 + (t - n1) * BLOCK_N, lo + t * BLOCK_N)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_nope, q_rope,
                                         tl.where(second, idx2_ptr + r * s_ir2, idx_ptr + r * s_ir),
                                         start + tl.arange(0, BLOCK_N), tl.where(second, end2, end),
                                         tl.where(second, kv2_ptr, kv_ptr), tl.where(second, num_slots2, num_slots),
                                         tl.where(second, s_kv2, s_kv), tl.where(second, s_page2, s_page), qk_scale,
                                         D_V, D_R, BLOCK_DV, BLOCK_DR, BLOCK_N, DOT_FP32, KV_FP8, GROUP, ROPE_AT,
                                         MODEL1_NOPE, PAGE, second, PAGE2, True)
    else:
        for start in range(lo, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_nope, q_rope, idx_ptr + r * s_ir,
                                         start + tl.arange(0, BLOCK_N), end, kv_ptr, num_slots, s_kv, s_page, qk_scale,
                                         D_V, D_R, BLOCK_DV, BLOCK_DR, BLOCK_N, DOT_FP32, KV_FP8, GROUP, ROPE_AT,
                                         MODEL1_NOPE, PAGE)

    empty = l_i == 0  # not NaN: a NaN score propagates to out and lse
    l_ref = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_ref)) * _LN2)
    out = acc / l_ref[:, None]
    if HAS_SINK and NUM_SPLITS == 1:
        out = out * _sink_factor(lse, tl.load(sink_ptr + offs_m % H, mask=m_ok, other=0.0))[:, None]
    out_row = (r * M + offs_m) * NUM_SPLITS + split
    tl.store(out_ptr + out_row[:, None] * D_V + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=_tile_mask(m_ok, offs_dv, D_V, BLOCK_DV))
    tl.store(lse_ptr + out_row, lse, mask=m_ok)


@triton.jit
def _combine_splits(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, sink_ptr, H, D_V: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                    HAS_SINK: tl.constexpr = False):
    """Grid (rows, cdiv(D_V, BLOCK_C)): ``part_out[rows, NUM_SPLITS, D_V]`` fp32, ``part_lse[rows, NUM_SPLITS]``
    (natural log, -inf for an empty split) -> ``out[rows, D_V]``, ``lse[rows]``; every split of a column chunk
    is loaded at once (one memory round trip). A row with every split empty gives 0, -inf; a NaN split lse
    gives NaN. ``HAS_SINK``: out times the sink factor of head ``row % H`` (``sink_ptr[H]``; None without)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    lse_s = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    part = tl.load(part_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * D_V + offs_c[None, :],
                   mask=s_ok[:, None] & (offs_c < D_V)[None, :], other=0.0)
    m = tl.max(lse_s, 0)
    w = tl.exp(lse_s - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    total = tl.sum(w, 0)
    empty = total == 0  # not NaN
    total_ref = tl.where(empty, 1.0, total)
    acc = tl.sum(part * (w / total_ref)[:, None], 0)
    lse = tl.where(empty, float("-inf"), m + tl.log(total_ref))
    if HAS_SINK:
        acc = acc * _sink_factor(lse, tl.load(sink_ptr + row % H))
    tl.store(out_ptr + row * D_V + offs_c, acc.to(out_ptr.dtype.element_ty), mask=offs_c < D_V)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row, lse)


def head_blocks(d: int, d_v: int) -> tuple[int, int]:
    """Padded widths of the value part and the rope part of a ``d``-wide row (each at least 16, for ``tl.dot``; the
    rope part 0 when the values are the whole row)."""
    return max(16, next_pow2(d_v)), (max(16, next_pow2(d - d_v)) if d > d_v else 0)


class Extras(NamedTuple):
    """What a DeepSeek-V4 call adds to a launch's metadata (the defaults: nothing, a DeepSeek-V3.2 call)."""

    k2: int = 0  # the second index set's width (0: no second set)
    page_size2: int = 1  # its cache's page size
    lengths: bool = False  # topk_length given
    lengths2: bool = False  # extra_topk_length given
    sink: bool = False  # attn_sink given
    model1_rope: int | None = None  # the rope values of a MODEL1 FP8 cache (None: another cache)


NO_EXTRAS = Extras()


class ExtraInputs(NamedTuple):
    """The tensors of what a DeepSeek-V4 call adds (None where off) and the index-row divisors of its lengths."""

    kv: torch.Tensor | None = None  # the second cache, as :func:`sparse_attention_fwd` takes the first
    slots: torch.Tensor | None = None  # [R, k2] physical slots of it
    lengths: torch.Tensor | None = None  # int32: row r reads lengths[r // len_div]
    lengths2: torch.Tensor | None = None  # int32: row r reads lengths2[r // len2_div]
    sink: torch.Tensor | None = None  # [H] fp32
    len_div: int = 1
    len2_div: int = 1


NO_EXTRA_INPUTS = ExtraInputs()
# the kernel's arguments after the Gluon kernel's in a DeepSeek-V3.2 call (no extras, a cache of rows)
NO_EXTRA_ARGS = (None, None, None, None, None, 0, 0, 0, 0, 0, 0, 0, 1, 1)


class AttentionLaunch:
    """The keyword arguments of one sparse attention call's launches (:func:`logical_to_slots`, the attention kernel
    and the combine of its splits), worked out once: the ops keep it in their plans, whose key holds all it is made
    of (``D`` from q's shape, ``k`` from the indices', q's dtype, whether the cache is FP8, ``d_v``, the page size,
    the config, the ``extras``; the interpreter's state and :data:`COMBINE_ELEMENTS` are read here, fixed for a
    process). Without extras ``fwd_meta`` holds exactly the keys the Gluon kernel takes."""

    def __init__(self, D: int, d_v: int, k: int, page_size: int, q_dtype: torch.dtype, kv_fp8: bool,
                 config: dict, extras: Extras = NO_EXTRAS) -> None:
        self.config, self.extras = config, extras
        self.d_v, self.num_splits, self.block_n = d_v, config["num_splits"], config["BLOCK_N"]
        self.block_h = config["BLOCK_H"]
        self.slots_block = min(1024, next_pow2(k))
        self.slots_meta = dict(PAGE_SIZE=page_size, BLOCK=self.slots_block, num_warps=4)
        self.slots2_block = min(1024, next_pow2(extras.k2))
        self.slots2_meta = dict(PAGE_SIZE=extras.page_size2, BLOCK=self.slots2_block, num_warps=4)
        block_dv, block_dr = head_blocks(D, d_v)
        fp8 = {}
        if kv_fp8 and extras.model1_rope is not None:
            fp8 = {"MODEL1_NOPE": D - extras.model1_rope, "PAGE": page_size}
            fp8.update({"PAGE2": extras.page_size2} if extras.k2 else {})
        elif kv_fp8:
            fp8 = {"KV_FP8": True, "GROUP": min(LATENT_GROUP, block_dv), "ROPE_AT": d_v + 4 * cdiv(d_v, LATENT_GROUP)}
        flags = {"HAS_EXTRA": extras.k2 > 0, "HAS_LEN": extras.lengths, "HAS_LEN2": extras.lengths2,
                 "HAS_SINK": extras.sink}
        self.fwd_meta = dict(
            D_V=d_v, D_R=D - d_v, BLOCK_DV=block_dv, BLOCK_DR=max(16, block_dr),
            NUM_SPLITS=self.num_splits, BLOCK_H=self.block_h, BLOCK_N=self.block_n,
            DOT_FP32=q_dtype == torch.bfloat16 and interpreting(),
            num_warps=config["num_warps"], num_stages=config["num_stages"], **fp8,
            **{name: True for name, on in flags.items() if on})
        # the second set's columns start at k_pad in the token space the splits divide
        self.k_pad = cdiv(k, self.block_n) * self.block_n if extras.k2 else 0
        tokens = self.k_pad + extras.k2 if extras.k2 else k
        self.tokens_per_split = cdiv(cdiv(tokens, self.num_splits), self.block_n) * self.block_n
        self.gluon_kernel = (_sparse_attention_fwd_seesaw, seesaw_meta(self.fwd_meta))  # where gluon_applies
        self.block_c = self.combine_meta = None
        if self.num_splits > 1:
            block_s = next_pow2(self.num_splits)
            self.block_c = min(block_dv, max(16, COMBINE_ELEMENTS // block_s))
            self.combine_meta = dict(D_V=d_v, NUM_SPLITS=self.num_splits, BLOCK_S=block_s, BLOCK_C=self.block_c,
                                     num_warps=4, **({"HAS_SINK": True} if extras.sink else {}))


def logical_to_slots(indices: torch.Tensor, block_table: torch.Tensor, bt_div: int, num_pages: int,
                     launch: AttentionLaunch, second: bool = False) -> torch.Tensor:
    """``indices[R, k]`` logical positions -> ``slots[R, k]`` int32 (-1 where invalid); index row r reads
    block-table row ``r // bt_div`` (pages of ``launch``'s page size, or with ``second`` its second cache's)."""
    R, k = indices.shape
    block, meta = (launch.slots2_block, launch.slots2_meta) if second else (launch.slots_block, launch.slots_meta)
    slots = torch.empty((R, k), dtype=torch.int32, device=indices.device)
    if slots.numel():
        launch_with(_logical_to_slots, (R, cdiv(k, block)), meta,
                    indices, block_table, slots, k, block_table.shape[1], num_pages, bt_div, indices.stride(0),
                    block_table.stride(0))
    return slots


def cache_args(kv: torch.Tensor) -> tuple[int, int, int]:
    """``(num_slots, row stride, page stride)`` of a cache as the kernel takes it: rows ``[num_slots, D]`` (page
    stride 0), or MODEL1 pages ``[num_pages, P, bytes]``."""
    if kv.dim() == 3:
        return kv.shape[0] * kv.shape[1], kv.stride(1), kv.stride(0)
    return kv.shape[0], kv.stride(0), 0


def sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                         launch: AttentionLaunch, kernel: tuple | None = None,
                         extra: ExtraInputs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on checked arguments. ``q[R, S, H, D]`` (the S tokens share index row r), ``kv[num_slots, D]``
    (row stride free, last dim contiguous) or uint8 FP8 latent cache rows ``kv[num_slots, bytes]`` (latent
    width ``d_v``) or MODEL1 pages ``kv[num_pages, P, bytes]``, ``slots[R, k]`` (negative or >= num_slots:
    skipped) -> ``out[R, S, H, d_v]`` in q's dtype, ``lse[R, S, H]`` fp32; ``d_v``, the config and the constexprs
    from ``launch``, the tensors of its extras in ``extra``. ``kernel``: ``(kernel, meta)`` launched in place of the
    Triton kernel, with the arguments before the extras' and the same outputs (``launch.gluon_kernel``, where it
    applies; scripts/gluon_attention.py's alternative sources of the seesaw kernel)."""
    R, S, H = q.shape[:3]
    M, k = S * H, slots.shape[1]
    d_v, num_splits = launch.d_v, launch.num_splits
    out = torch.empty((R, S, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((R, S, H), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if num_splits > 1:  # one fp32 buffer: partial outputs [R, M, num_splits, d_v], then their lse [R, M, num_splits]
        parts = R * M * num_splits
        part = torch.empty((parts * (d_v + 1),), dtype=torch.float32, device=q.device)
        part_out, part_lse = part[:parts * d_v], part[parts * d_v:]
    else:
        part_out, part_lse = out, lse
    grid = (R * num_splits * cdiv(M, launch.block_h),)
    num_slots, s_kv, s_page = cache_args(kv)
    args = (q, kv, slots, part_out, part_lse, M, H, k, launch.tokens_per_split, num_slots, sm_scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), s_kv, slots.stride(0))
    extra = extra or NO_EXTRA_INPUTS
    if kernel is not None:
        launch_with(kernel[0], grid, kernel[1], *args)
    else:
        num_slots2, s_kv2, s_page2 = (0, 0, 0) if extra.kv is None else cache_args(extra.kv)
        launch_with(_sparse_attention_fwd, grid, launch.fwd_meta, *args,
                    extra.kv, extra.slots, extra.lengths, extra.lengths2, extra.sink, launch.extras.k2, launch.k_pad,
                    num_slots2, s_kv2, 0 if extra.slots is None else extra.slots.stride(0), s_page, s_page2,
                    extra.len_div, extra.len2_div)
    if num_splits > 1:
        launch_with(_combine_splits, (R * M, cdiv(d_v, launch.block_c)), launch.combine_meta,
                    part_out, part_lse, out, lse, extra.sink, H)
    return out, lse
