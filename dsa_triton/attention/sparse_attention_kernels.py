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
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """``tl.dot(a, b, acc)``; with ``DOT_FP32`` on fp32 copies of the operands."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _sparse_attention_fwd(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    M, H, k_len, tokens_per_split, num_slots, qk_scale,
    s_qr, s_qs, s_qh, s_kv, s_ir,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr = False, GROUP: tl.constexpr = 128, ROPE_AT: tl.constexpr = 0,
):
    """Query row (r, m) is ``q_ptr + r*s_qr + (m // H)*s_qs + (m % H)*s_qh``; outputs are contiguous
    ``[R, M, NUM_SPLITS, D_V]`` and lse ``[R, M, NUM_SPLITS]`` (with one split: the final out and lse).
    ``DOT_FP32``: upcast the dot operands to fp32 (bf16 in the interpreter, whose bf16 ``tl.dot`` is wrong);
    the probabilities are rounded to the cache dtype first either way. A NaN score makes ``l_i`` NaN, and
    out and lse NaN with it (only ``l_i == 0`` is an empty row); so does a +inf score (``exp2(inf - inf)``); a -inf
    score adds 0. ``KV_FP8``: ``kv_ptr`` holds FP8 latent cache
    rows of ``s_kv`` bytes (rope values at byte ``ROPE_AT``), dequantized into q's dtype (the "cache dtype"
    above)."""
    pid = tl.program_id(0)
    num_hb = tl.cdiv(M, BLOCK_H)
    hb = pid % num_hb
    split = (pid // num_hb) % NUM_SPLITS
    r = (pid // num_hb // NUM_SPLITS).to(tl.int64)

    offs_m = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_ok = offs_m < M
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    q_rows = q_ptr + r * s_qr + (offs_m // H) * s_qs + (offs_m % H) * s_qh
    q_nope = tl.load(q_rows[:, None] + offs_dv[None, :], mask=_tile_mask(m_ok, offs_dv, D_V, BLOCK_DV), other=0.0)
    if D_R > 0:
        q_rope = tl.load(q_rows[:, None] + D_V + offs_dr[None, :], mask=_tile_mask(m_ok, offs_dr, D_R, BLOCK_DR),
                         other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, k_len)
    idx_row = idx_ptr + r * s_ir
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + offs_n, mask=offs_n < hi, other=-1)
        ok = (slot >= 0) & (slot < num_slots)
        rows = kv_ptr + tl.where(ok, slot, 0).to(tl.int64) * s_kv
        if KV_FP8:
            k_nope = _fp8_latent_tile(rows, ok, D_V, BLOCK_N, BLOCK_DV, GROUP).to(q_ptr.dtype.element_ty)
        else:
            k_nope = tl.load(rows[:, None] + offs_dv[None, :], mask=_tile_mask(ok, offs_dv, D_V, BLOCK_DV),
                             other=0.0)
        qk = _dot(q_nope, tl.trans(k_nope), None, DOT_FP32)
        if D_R > 0:
            if KV_FP8:
                rope_rows = (rows + ROPE_AT).to(tl.pointer_type(tl.bfloat16))
                k_rope = tl.load(rope_rows[:, None] + offs_dr[None, :], mask=_tile_mask(ok, offs_dr, D_R, BLOCK_DR),
                                 other=0.0).to(q_ptr.dtype.element_ty)
            else:
                k_rope = tl.load(rows[:, None] + D_V + offs_dr[None, :],
                                 mask=_tile_mask(ok, offs_dr, D_R, BLOCK_DR), other=0.0)
            qk = _dot(q_rope, tl.trans(k_rope), qk, DOT_FP32)
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while nothing is valid yet
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], DOT_FP32)
        m_i = m_new

    empty = l_i == 0  # not NaN: a NaN score propagates to out and lse
    l_ref = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_ref)) * _LN2)
    out = acc / l_ref[:, None]
    out_row = (r * M + offs_m) * NUM_SPLITS + split
    tl.store(out_ptr + out_row[:, None] * D_V + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=_tile_mask(m_ok, offs_dv, D_V, BLOCK_DV))
    tl.store(lse_ptr + out_row, lse, mask=m_ok)


@triton.jit
def _combine_splits(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, D_V: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (rows, cdiv(D_V, BLOCK_C)): ``part_out[rows, NUM_SPLITS, D_V]`` fp32, ``part_lse[rows, NUM_SPLITS]``
    (natural log, -inf for an empty split) -> ``out[rows, D_V]``, ``lse[rows]``; every split of a column chunk
    is loaded at once (one memory round trip). A row with every split empty gives 0, -inf; a NaN split lse
    gives NaN."""
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
    tl.store(out_ptr + row * D_V + offs_c, acc.to(out_ptr.dtype.element_ty), mask=offs_c < D_V)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + row, tl.where(empty, float("-inf"), m + tl.log(total_ref)))


def head_blocks(d: int, d_v: int) -> tuple[int, int]:
    """Padded widths of the value part and the rope part of a ``d``-wide row (each at least 16, for ``tl.dot``)."""
    return max(16, next_pow2(d_v)), max(16, next_pow2(d - d_v))


class AttentionLaunch:
    """The keyword arguments of one sparse attention call's launches (:func:`logical_to_slots`, the attention kernel
    and the combine of its splits), worked out once: the ops keep it in their plans, whose key holds all it is made
    of (``D`` from q's shape, ``k`` from the indices', q's dtype, whether the cache is FP8, ``d_v``, the page size,
    the config; the interpreter's state and :data:`COMBINE_ELEMENTS` are read here, fixed for a process)."""

    def __init__(self, D: int, d_v: int, k: int, page_size: int, q_dtype: torch.dtype, kv_fp8: bool,
                 config: dict) -> None:
        self.config = config
        self.d_v, self.num_splits, self.block_n = d_v, config["num_splits"], config["BLOCK_N"]
        self.block_h = config["BLOCK_H"]
        self.slots_block = min(1024, next_pow2(k))
        self.slots_meta = dict(PAGE_SIZE=page_size, BLOCK=self.slots_block, num_warps=4)
        block_dv, block_dr = head_blocks(D, d_v)
        fp8 = {}
        if kv_fp8:
            fp8 = {"KV_FP8": True, "GROUP": min(LATENT_GROUP, block_dv), "ROPE_AT": d_v + 4 * cdiv(d_v, LATENT_GROUP)}
        self.fwd_meta = dict(
            D_V=d_v, D_R=D - d_v, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
            NUM_SPLITS=self.num_splits, BLOCK_H=self.block_h, BLOCK_N=self.block_n,
            DOT_FP32=q_dtype == torch.bfloat16 and interpreting(),
            num_warps=config["num_warps"], num_stages=config["num_stages"], **fp8)
        self.tokens_per_split = cdiv(cdiv(k, self.num_splits), self.block_n) * self.block_n
        self.gluon_kernel = (_sparse_attention_fwd_seesaw, seesaw_meta(self.fwd_meta))  # where gluon_applies
        self.block_c = self.combine_meta = None
        if self.num_splits > 1:
            block_s = next_pow2(self.num_splits)
            self.block_c = min(block_dv, max(16, COMBINE_ELEMENTS // block_s))
            self.combine_meta = dict(D_V=d_v, NUM_SPLITS=self.num_splits, BLOCK_S=block_s, BLOCK_C=self.block_c,
                                     num_warps=4)


def logical_to_slots(indices: torch.Tensor, block_table: torch.Tensor, bt_div: int, num_pages: int,
                     launch: AttentionLaunch) -> torch.Tensor:
    """``indices[R, k]`` logical positions -> ``slots[R, k]`` int32 (-1 where invalid); index row r reads
    block-table row ``r // bt_div`` (pages of ``launch``'s page size)."""
    R, k = indices.shape
    slots = torch.empty((R, k), dtype=torch.int32, device=indices.device)
    if slots.numel():
        launch_with(_logical_to_slots, (R, cdiv(k, launch.slots_block)), launch.slots_meta,
                    indices, block_table, slots, k, block_table.shape[1], num_pages, bt_div, indices.stride(0),
                    block_table.stride(0))
    return slots


def sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                         launch: AttentionLaunch, kernel: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on checked arguments. ``q[R, S, H, D]`` (the S tokens share index row r), ``kv[num_slots, D]``
    (row stride free, last dim contiguous) or uint8 FP8 latent cache rows ``kv[num_slots, bytes]`` (latent
    width ``d_v``), ``slots[R, k]`` (negative or >= num_slots: skipped) -> ``out[R, S, H, d_v]`` in q's dtype,
    ``lse[R, S, H]`` fp32; ``d_v``, the config and the constexprs from ``launch``. ``kernel``: ``(kernel, meta)``
    launched in place of the Triton kernel, with the same arguments and outputs (``launch.gluon_kernel``, where it
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
    kernel, meta = kernel or (_sparse_attention_fwd, launch.fwd_meta)
    launch_with(
        kernel, grid, meta,
        q, kv, slots, part_out, part_lse,
        M, H, k, launch.tokens_per_split, kv.shape[0], sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), slots.stride(0),
    )
    if num_splits > 1:
        launch_with(_combine_splits, (R * M, cdiv(d_v, launch.block_c)), launch.combine_meta,
                    part_out, part_lse, out, lse)
    return out, lse
