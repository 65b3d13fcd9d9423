"""Gluon kernel of sparse attention for Hopper (sm_90a), bf16 q, a bf16 or FP8 latent cache, DSA head dims (512
latent + 64 rope), with two warpgroups that split each tile; and what the Gluon kernels share: the gathers, the
slots of a tile, and whether a launch takes a Gluon kernel (:func:`gluon_fits`, :func:`gluon_applies`). The ops run
the seesaw kernel of :mod:`.sparse_attention_seesaw` where a Gluon kernel applies (at decode B=64 on the H200
1.15x this one over a bf16 cache, 1.28-1.29x over the FP8 cache); this one stays as scripts/gluon_attention.py's
comparison.

Same contract as :func:`.sparse_attention_kernels._sparse_attention_fwd` (same arguments, same partial out / lse
layout, so ``_combine_splits`` merges its splits; ``KV_FP8``, ``GROUP`` = 128, ``ROPE_AT`` = 528 for the FP8 cache),
for ``BLOCK_H`` = ``BLOCK_N`` = 64 and 8 warps. What Triton cannot be told and Gluon can: every MMA uses the warp
layout [4, 2] (two warpgroups side by side along N), so

- the score MMA ``q[64, 576] @ k^T[576, 64]`` gives warpgroup w the tokens ``[32w, 32w + 32)`` (no duplicated
  score work, the tile's rows read once from shared memory); the row maxima are cross-warpgroup reductions (over a
  bf16 cache :func:`_row_reduce_xchg`'s one-barrier exchange, else the compiler's; :func:`gluon_meta`), the row
  sums are kept per column (16 registers a thread) and reduced once at the end;
- the probabilities go to a shared ``[64, 64]`` bf16 buffer, and the value MMA ``p @ v[64, 512]`` gives
  warpgroup w the value columns ``[256w, 256w + 256)``: its half of the 64 x 512 fp32 accumulator (128 registers
  a thread).

Shared memory: q (72 KB) once, two gathered tiles of 64 rows x 576 bf16 (72 KB each) and the probabilities (8 KB).
The rows are gathered with 16-byte ``cp.async`` (invalid slots zero-filled, never read): tile j + 1's gather is
issued at the top of tile j's step and lands while tile j computes; the slots are loaded a tile before their gather.

FP8 latent cache (656 bytes a token: 512 e4m3, 4 fp32 scales, 64 bf16 rope; :mod:`.cache_reference`): the MMAs
still read bf16 tiles (q stays bf16), and shared memory has no room for a third tile or a separate staging buffer
of the 64 x 512 e4m3 bytes, so the free bf16 tile is its own staging: tile j + 1's bytes land by cp.async in the
first half of the tile they become (the scales in a 2 KB buffer of their own, the rope values straight in the rope
tile), each thread reads back the bytes it copied before the probabilities' barrier, and after it converts them
(e4m3 -> fp32, times the scale, -> bf16: exact for the power-of-two scales) and stores them over the staging while
tile j's value MMA runs. A tile costs two barriers more than with the bf16 cache (everyone's copies landed before
the scales, copied by other threads, are read; and the one the compiler puts between the value MMA's issue and the
stores into the same allocation) and 41 KB of copies into shared memory instead of 72; holding the bytes in
registers across the softmax instead would not fit beside the accumulator.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ..runtime import interpreting
from .cache_reference import fp8_latent_bytes

ENABLED = os.environ.get("DSA_GLUON", "1") != "0"  # off (DSA_GLUON=0): the Triton kernel serves every launch

GLUON_D_V, GLUON_D_R = 512, 64  # the head dims the kernel is written for (DSA)
GLUON_CONFIG = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}  # num_stages: for the config's key
_LN2 = gl.constexpr(0.6931471805599453)
# FP8 cache, 64-token tiles at 8 warps: the byte copies (16 a thread, a warp 4 rows x 128 bytes: the rows of the bf16
# copies' layout), the scale copies (one fp32 a thread) and the dequantization (2 rows x 4 groups x 16 bytes a thread)
_BYTES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0]))
_SCALES = gl.constexpr(gl.BlockedLayout([1, 1], [8, 4], [8, 1], [1, 0]))
_DEQUANT = gl.constexpr(gl.BlockedLayout([1, 1, 16], [4, 1, 8], [8, 1, 1], [2, 1, 0]))
_PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
# the score tile's rows (64, the layout of SliceLayout(1, S_MMA)) with the two warpgroups' partials of each in one
# thread's registers: what :func:`_row_reduce_xchg` reads back
_PAIRS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0], [0, 0]], block_bases=[], shape=[64, 2]))
_FLAGS = gl.constexpr(gl.BlockedLayout([4], [32], [8], [0]))  # 16 words, 4 a lane (lanes 4 apart alike)


@gluon.jit
def _copy_rows(dst, rows, ok, COLS: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async ``dst[i, :COLS]`` from the ``COLS`` elements at pointer ``rows[i]`` (``rows`` in
    ``SliceLayout(1, LAYOUT)``); rows where ``ok`` is off are zero-filled without a read."""
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    async_copy.async_copy_global_to_shared(dst, rows[:, None] + cols[None, :], mask=ok[:, None])


@gluon.jit
def _gather(dst_nope, dst_rope, base, rows, ok, D_V: gl.constexpr, D_R: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async rows ``base + rows[i]`` (element offsets, int64; ``rows`` in ``SliceLayout(1, LAYOUT)``) into
    ``dst_nope[i, :D_V]`` and ``dst_rope[i, :D_R]`` (from element ``D_V`` on); rows where ``ok`` is off are
    zero-filled without a read."""
    ptrs = base + rows
    _copy_rows(dst_nope, ptrs, ok, D_V, LAYOUT)
    _copy_rows(dst_rope, ptrs + D_V, ok, D_R, LAYOUT)


@gluon.jit
def _fp8_staging(nope):
    """The first half of a bf16 tile ``nope[BLOCK_N, D_V]`` as ``uint8[BLOCK_N, D_V]``: where the e4m3 bytes of FP8
    latent cache rows land before they are dequantized into the tile itself."""
    return nope._reinterpret(gl.uint8, [2, nope.shape[0], nope.shape[1]], _PLAIN).index(0)


@gluon.jit
def _gather_fp8(nope, rope, scales, kv_ptr, slot, ok, idx_row, start, hi, num_slots, s_kv, D_V: gl.constexpr,
                D_R: gl.constexpr, GROUP: gl.constexpr, ROPE_AT: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async FP8 latent cache rows (``s_kv`` bytes apart from ``kv_ptr``) of the tokens ``[start, start +
    BLOCK_N)`` of ``idx_row``: their e4m3 bytes into :func:`_fp8_staging` of the bf16 tile ``nope``, their fp32
    scales into ``scales[BLOCK_N, D_V // GROUP]``, their bf16 rope values (byte ``ROPE_AT`` on) into
    ``rope[BLOCK_N, D_R]``. ``slot``, ``ok``: those tokens' slots in ``SliceLayout(1, LAYOUT)`` (bf16 row copies of
    16 bytes); the scales take their own slot load. Rows where ``ok`` is off are zero-filled without a read."""
    base = kv_ptr + slot.to(gl.int64) * s_kv
    rows8 = gl.convert_layout(base, gl.SliceLayout(1, _BYTES), assert_trivial=True)
    ok8 = gl.convert_layout(ok, gl.SliceLayout(1, _BYTES), assert_trivial=True)
    _copy_rows(_fp8_staging(nope), rows8, ok8, D_V, _BYTES)
    _copy_rows(rope, (base + ROPE_AT).to(gl.pointer_type(gl.bfloat16)), ok, D_R, LAYOUT)
    slot_s, ok_s = _slots(idx_row, start, hi, num_slots, nope.shape[0], gl.SliceLayout(1, _SCALES))
    rows_s = (kv_ptr + slot_s.to(gl.int64) * s_kv + D_V).to(gl.pointer_type(gl.float32))
    _copy_rows(scales, rows_s, ok_s, D_V // GROUP, _SCALES)


@gluon.jit
def _read_staged(nope, scales, GROUP: gl.constexpr):
    """Wait for the FP8 rows staged by :func:`_gather_fp8` (this thread's copies, then a barrier for everyone's) and
    read them: ``(x8 uint8[BLOCK_N, D_V // GROUP, GROUP], scale fp32[BLOCK_N, D_V // GROUP])`` in ``_DEQUANT`` (2
    rows x 4 groups x 16 bytes a thread: the bytes it copied itself). A barrier must follow before
    :func:`_store_dequantized` overwrites them."""
    async_copy.wait_group(0)
    gl.thread_barrier()
    x8 = _fp8_staging(nope).reshape([nope.shape[0], nope.shape[1] // GROUP, GROUP]).load(_DEQUANT)
    return x8, scales.load(gl.SliceLayout(2, _DEQUANT))


@gluon.jit
def _store_dequantized(nope, x8, scale, D_V: gl.constexpr):
    """``nope[BLOCK_N, D_V] = x8 * scale`` in bf16 (each e4m3 byte times its group's fp32 scale: exact for
    power-of-two scales). The MMAs may read it after a ``fence_async_shared`` and a barrier (the loop's top; no fence
    here: ptxas of Triton 3.6 crashes on one between a wgmma and its wait)."""
    x = x8.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, :, None]
    nope.store(gl.reshape(x.to(gl.bfloat16), [nope.shape[0], D_V]))


@gluon.jit
def _row_reduce_xchg(x, xchg, ROWS: gl.constexpr, SUM: gl.constexpr):
    """Row maxima (``SUM``: sums) of ``x[64, 64]`` in the score layout (warps [4, 2]) in ``ROWS``
    (``SliceLayout(1, x.layout)``): each warp reduces its 32 columns, the two warpgroups' partials meet in ``xchg``
    (fp32 ``[2, 64]``) across one barrier. The caller keeps a barrier between two calls (the buffer's reuse)."""
    parts = x.reshape([x.shape[0], 2, x.shape[1] // 2])
    part = gl.sum(parts, 2) if SUM else gl.max(parts, 2)
    xchg.permute((1, 0)).store(part)
    gl.thread_barrier()
    pairs = xchg.permute((1, 0)).load(_PAIRS)
    both = gl.sum(pairs, 1) if SUM else gl.max(pairs, 1)
    return gl.convert_layout(both, ROWS, assert_trivial=True)


@gluon.jit
def _any_flag(flags):
    """Whether any byte of ``flags`` (uint8 ``[64]`` in shared memory, written before a barrier) is nonzero, read by
    every thread alike (a scalar: uniform across the program)."""
    words = flags._reinterpret(gl.int32, [flags.shape[0] // 4], gl.SwizzledSharedLayout(1, 1, 1, [0])).load(_FLAGS)
    return gl.max(words, 0) != 0


@gluon.jit
def _valid(slot, num_slots):
    """Whether each slot names a cache row (a negative one or one past the cache is skipped)."""
    return (slot >= 0) & (slot < num_slots)


@gluon.jit
def _slots(idx_row, start, hi, num_slots, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Slots of tokens ``[start, start + BLOCK_N)`` (-1 from ``hi`` on) in ``LAYOUT`` and whether each is valid."""
    offs = start + gl.arange(0, BLOCK_N, layout=LAYOUT)
    slot = gl.load(idx_row + offs, mask=offs < hi, other=-1)
    return slot, _valid(slot, num_slots)


@gluon.jit
def _gather_tile(nope, rope, scales, kv_ptr, slot, ok, idx_row, start, hi, num_slots, s_kv, D_V: gl.constexpr,
                 D_R: gl.constexpr, KV_FP8: gl.constexpr, GROUP: gl.constexpr, ROPE_AT: gl.constexpr,
                 LAYOUT: gl.constexpr):
    """Issue (one commit group) the cp.async gather of the tokens ``[start, start + BLOCK_N)`` (slots ``slot``,
    ``ok`` in ``SliceLayout(1, LAYOUT)``): bf16 rows into ``nope`` and ``rope``, or FP8 latent cache rows
    (:func:`_gather_fp8`, with ``scales``)."""
    if KV_FP8:
        _gather_fp8(nope, rope, scales, kv_ptr, slot, ok, idx_row, start, hi, num_slots, s_kv, D_V, D_R, GROUP, ROPE_AT,
                    LAYOUT)
    else:
        _gather(nope, rope, kv_ptr, slot.to(gl.int64) * s_kv, ok, D_V, D_R, LAYOUT)
    async_copy.commit_group()


@gluon.jit
def _sparse_attention_fwd_gluon(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    M, H, k_len, tokens_per_split, num_slots, qk_scale,
    s_qr, s_qs, s_qh, s_kv, s_ir,
    D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_DR: gl.constexpr,
    NUM_SPLITS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DOT_FP32: gl.constexpr,
    KV_FP8: gl.constexpr = False, GROUP: gl.constexpr = 128, ROPE_AT: gl.constexpr = 0,
    MAX_XCHG: gl.constexpr = False, LAZY_RESCALE: gl.constexpr = False,
):
    """The arguments of ``_sparse_attention_fwd`` (bf16 q; ``D_V`` = 512, ``D_R`` = 64, ``BLOCK_H`` = ``BLOCK_N`` =
    64, 8 warps). ``KV_FP8``: ``kv_ptr`` holds FP8 latent cache rows of ``s_kv`` bytes (``GROUP`` = 128, rope values
    at byte ``ROPE_AT`` = 528), else bf16 rows of ``s_kv`` elements. Query row (r, m) is ``q_ptr + r*s_qr +
    (m // H)*s_qs + (m % H)*s_qh``; outputs
    ``out[R, M, NUM_SPLITS, D_V]`` (q's dtype with one split, else fp32 partials) and ``lse[R, M, NUM_SPLITS]``
    natural log, -inf and 0 for a row without a valid slot; a NaN score makes out and lse NaN. ``MAX_XCHG``: the
    row maxima and the final row sums by :func:`_row_reduce_xchg` (one barrier each) instead of the compiler's
    cross-warp reductions. ``LAZY_RESCALE``: the accumulator is rescaled only in tiles where some row's ``alpha``
    is not 1 (flags exchanged across the probabilities' barrier; the same results)."""
    gl.static_assert(D_V == 512 and D_R == 64 and BLOCK_H == 64 and BLOCK_N == 64 and gl.num_warps() == 8)
    gl.static_assert(BLOCK_DV == D_V and BLOCK_DR == D_R and not DOT_FP32)
    gl.static_assert(not KV_FP8 or (GROUP == 128 and ROPE_AT == D_V + 4 * (D_V // GROUP)))
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # 16-byte chunks, a warp covers 4 rows x 128 bytes; the rope part takes the same rows (one slot layout)
    GATHER: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, GATHER)
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    S_COLS: gl.constexpr = gl.SliceLayout(0, S_MMA)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_MMA)
    NOPE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], dtype)
    ROPE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], dtype)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

    pid = gl.program_id(0)
    num_hb = gl.cdiv(M, BLOCK_H)
    hb = pid % num_hb
    split = (pid // num_hb) % NUM_SPLITS
    r = (pid // num_hb // NUM_SPLITS).to(gl.int64)

    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], NOPE)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], ROPE)
    k_nope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_V], NOPE)
    k_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_R], ROPE)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], P_SMEM)
    k_scale = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, D_V // GROUP], _PLAIN)  # FP8 only (else unused)
    if MAX_XCHG:
        xchg = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], _PLAIN)
    if LAZY_RESCALE:
        flags = gl.allocate_shared_memory(gl.uint8, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    offs_m = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
    q_rows = r * s_qr + (offs_m // H) * s_qs + (offs_m % H) * s_qh
    _gather(q_nope, q_rope, q_ptr, q_rows, offs_m < M, D_V, D_R, GATHER)

    lo = split * tokens_per_split
    hi = gl.minimum(lo + tokens_per_split, k_len)
    idx_row = idx_ptr + r * s_ir
    slot, ok = _slots(idx_row, lo, hi, num_slots, BLOCK_N, ROWS)
    _gather_tile(k_nope.index(0), k_rope.index(0), k_scale.index(0), kv_ptr, slot, ok, idx_row, lo, hi, num_slots,
                 s_kv, D_V, D_R, KV_FP8, GROUP, ROPE_AT, GATHER)
    if KV_FP8:
        x8, scale = _read_staged(k_nope.index(0), k_scale.index(0), GROUP)
        gl.thread_barrier()
        _store_dequantized(k_nope.index(0), x8, scale, D_V)
    slot, ok = _slots(idx_row, lo + BLOCK_N, hi, num_slots, BLOCK_N, ROWS)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=S_ROWS)
    l_2d = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)  # row sums by column, summed at the end
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=O_MMA)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
    buf = 0
    for start in range(lo, hi, BLOCK_N):
        # tile j landed (this thread's copies; the barrier: everyone's; FP8: dequantized), tile j - 1's MMAs are
        # done everywhere
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        kn = k_nope.index(buf)
        s = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope, k_rope.index(buf).permute((1, 0)), s, is_async=True)
        # the next gather is issued while the score MMAs run (into the other buffer)
        _gather_tile(k_nope.index(1 - buf), k_rope.index(1 - buf), k_scale.index(1 - buf), kv_ptr, slot, ok, idx_row,
                     start + BLOCK_N, hi, num_slots, s_kv, D_V, D_R, KV_FP8, GROUP, ROPE_AT, GATHER)
        slot, ok = _slots(idx_row, start + 2 * BLOCK_N, hi, num_slots, BLOCK_N, ROWS)
        _, cols_ok = _slots(idx_row, start, hi, num_slots, BLOCK_N, S_COLS)
        s = warpgroup_mma_wait(0, deps=(s, ))
        s = gl.where(cols_ok[None, :], s * qk_scale, float("-inf"))
        if MAX_XCHG:
            m_new = gl.maximum(m_i, _row_reduce_xchg(s, xchg, S_ROWS, False))
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while nothing is valid yet
        p = gl.exp2(s - m_ref[:, None])
        alpha = gl.exp2(m_i - m_ref)
        l_2d = l_2d * alpha[:, None] + p
        m_i = m_new
        if KV_FP8:  # the next tile's bytes, read before the barrier that lets them be overwritten
            x8, scale = _read_staged(k_nope.index(1 - buf), k_scale.index(1 - buf), GROUP)
        p_smem.store(p.to(dtype))
        if LAZY_RESCALE:
            flags.store((alpha != 1.0).to(gl.uint8))
        fence_async_shared()
        gl.thread_barrier()
        if LAZY_RESCALE:
            if _any_flag(flags):
                acc = acc * gl.convert_layout(alpha, O_ROWS, assert_trivial=True)[:, None]
        else:
            acc = acc * gl.convert_layout(alpha, O_ROWS, assert_trivial=True)[:, None]
        acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
        if KV_FP8:  # dequantized in place while the value MMAs run
            _store_dequantized(k_nope.index(1 - buf), x8, scale, D_V)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        buf = 1 - buf
    async_copy.wait_group(0)  # the last (empty) gather
    if MAX_XCHG:  # the last tile's reads of the buffer are behind the probabilities' barrier
        l_i = _row_reduce_xchg(l_2d, xchg, S_ROWS, True)
    else:
        l_i = gl.sum(l_2d, 1)

    empty = l_i == 0  # not NaN: a NaN score propagates to out and lse
    l_ref = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_ref)) * _LN2)
    out = acc / gl.convert_layout(l_ref, O_ROWS, assert_trivial=True)[:, None]
    rows_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=O_ROWS)
    cols_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, O_MMA))
    out_row = (r * M + rows_o) * NUM_SPLITS + split
    gl.store(out_ptr + out_row[:, None] * D_V + cols_o[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows_o < M)[:, None])
    rows_l = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=S_ROWS)
    gl.store(lse_ptr + (r * M + rows_l) * NUM_SPLITS + split, lse, mask=rows_l < M)


LAZY_RESCALE_TILES = 16  # tiles a split from which LAZY_RESCALE pays (its flag exchange costs more in short splits)


def gluon_meta(fwd_meta: dict, tiles_per_split: int) -> dict:
    """The Gluon kernel's keyword arguments: the Triton kernel's ``fwd_meta`` and the two choices measured on the H200
    (decode B=64, k=2048): ``MAX_XCHG`` over a bf16 cache (1.028x; 0.98x over the FP8 cache, whose registers it
    crowds), ``LAZY_RESCALE`` over a bf16 cache in splits of at least :data:`LAZY_RESCALE_TILES` tiles (1.051x at
    32 tiles, both 1.053x; 0.978x at 4 tiles a split, B=8). At the prefill row's 4096 index rows (32 tiles a split)
    both give 1.013x over neither (6268 -> 6190 us), and LAZY_RESCALE added to MAX_XCHG 0.991x (6133 -> 6190):
    inside the run-to-run spread."""
    bf16 = not fwd_meta.get("KV_FP8", False)
    return {**fwd_meta, "MAX_XCHG": bf16, "LAZY_RESCALE": bf16 and tiles_per_split >= LAZY_RESCALE_TILES}


def gluon_fits(q: torch.Tensor, kv: torch.Tensor, d_v: int, config: dict) -> bool:
    """Whether the Gluon kernel's shapes, dtypes and strides fit a launch (metadata only: the pointers are
    :func:`gluon_aligned`'s): bf16 ``q[..., D]`` with D = 576 and ``d_v`` = 512, and ``kv[num_slots, D]`` bf16 or the
    FP8 latent cache ``kv[num_slots, 656]`` uint8; the last dim contiguous and the other strides multiples of 16
    bytes (the gathers are 16-byte cp.async), and a config of ``BLOCK_H`` = ``BLOCK_N`` = 64 at 8 warps (any
    ``num_splits`` and stages)."""
    strided = all(t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
                  for t in (q, kv))
    width = {torch.bfloat16: GLUON_D_V + GLUON_D_R, torch.uint8: fp8_latent_bytes(GLUON_D_V, GLUON_D_R)}
    return (q.dtype == torch.bfloat16 and d_v == GLUON_D_V and q.shape[-1] == GLUON_D_V + GLUON_D_R
            and kv.shape[-1] == width.get(kv.dtype) and strided
            and all(config[k] == v for k, v in GLUON_CONFIG.items() if k != "num_stages"))


def gluon_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's address is a multiple of 16 bytes (with :func:`gluon_fits`' strides: every row)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def gluon_applies(q: torch.Tensor, kv: torch.Tensor, d_v: int, config: dict) -> bool:
    """Whether the Gluon kernel serves launches of this metadata: :func:`gluon_fits`, on a CUDA sm_90 device outside
    the interpreter, unless ``DSA_GLUON=0`` (then the Triton kernel serves every launch). A call still needs
    :func:`gluon_aligned` pointers."""
    return (ENABLED and q.is_cuda and not interpreting() and torch.cuda.get_device_capability(q.device) == (9, 0)
            and gluon_fits(q, kv, d_v, config))
