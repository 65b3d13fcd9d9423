"""Gluon kernel of sparse attention for Hopper (sm_90a) over a bf16 or FP8 latent cache in FlashMLA's "seesaw"
schedule: the contract of the Triton kernel :func:`.sparse_attention_kernels._sparse_attention_fwd` (same arguments,
same partial out / lse layout, so ``_combine_splits`` merges its splits), bf16 q, DSA head dims (512 latent + 64
rope), ``BLOCK_H`` = ``BLOCK_N`` = 64. The ops launch it in the Triton kernel's place where it applies
(:func:`gluon_applies`: :func:`gluon_fits` on a CUDA sm_90 device outside the interpreter, unless ``DSA_GLUON=0``)
on :func:`gluon_aligned` pointers; the interpreter cannot run Gluon, so its CPU twin is the Triton kernel.

Two warpgroups by ``gl.warp_specialize`` (the kernel's 4 warps and one worker of 4; launch with ``num_warps`` = 4,
:func:`seesaw_meta`), one source (:func:`_seesaw_wg`) for both. The tokens go in pairs of 64-token blocks, A = block
2i and B = block 2i + 1; warpgroup 0 scores A, warpgroup 1 scores B, each the whole tile (wgmma 64 x 64, K = 576).
The online softmax stays sequential over the blocks, through shared memory:

1. warpgroup 0: ``m_A = max(m, rowmax S_A)``, published; ``P_A = exp2(S_A - m_A)`` published;
2. warpgroup 1 (its score MMA overlaps step 1): ``m_B = max(m_A, rowmax S_B)``, published; ``P_B`` published;
3. warpgroup w holds its 256 value columns ``O_w[64, 256]`` (128 fp32 registers a thread):
   ``O_w = O_w * exp2(m - m_A) + P_A @ V_A[:, 256w:256w+256]``, then ``O_w = O_w * exp2(m_A - m_B) + P_B @ V_B[...]``.

Warpgroup 0 makes ``P_A`` while warpgroup 1's score MMA runs, and runs its ``P_A @ V_A`` while warpgroup 1 makes
``P_B``; warpgroup 1 publishes ``m_B`` first, then runs its ``P_A @ V_A`` while it makes ``P_B`` itself (no wait
between the issue and the wait of any wgmma crosses the loop's back edge).

Row sums: warpgroup w sums the probabilities of the blocks it scores, rescaled to the pair's ``m_B`` as its ``O_w``
is; the two meet in shared memory at the end (``l = l_0 + l_1``). A missing B (an odd number of blocks) is a tile of
masked tokens (zero-filled, scores -inf, ``P_B`` = 0).

Shared memory (222476 bytes): q (72 KB) and two tiles (72 KB each: 64 rows x 512 + 64), the maxima and sums
exchanged (2 x 512 bytes), the mbarriers; no room for a third tile nor for two probability buffers of their own, so
``P_X`` [64, 64] bf16 goes into tile X's rope part (the same shape and layout), free once X's score MMA is done.
Hence the next pair's tile X is gathered (by the warpgroup that scores it, 16-byte ``cp.async`` landing on an
mbarrier) only once both warpgroups are done with ``V_X`` and ``P_X``: A' while warpgroup 0's ``P_B @ V_B`` runs,
B' after warpgroup 1's; the gather has the rest of the pair's work of the other warpgroup to land in, not a whole
pair. mbarriers carry every exchange between the warpgroups (no CTA-wide barrier in the loop): tile landed
(``ready``), ``m_A`` / ``m_B`` / ``P_A`` / ``P_B`` published, tile X free, the final row sums.

FP8 latent cache (656 bytes a token: 512 e4m3, 4 fp32 scales, 64 bf16 rope; :mod:`.formats`): a third
warpgroup, the producer (:func:`_produce`), gathers q and every tile; the math warpgroups run the same code without
their gathers (they wait on ``ready`` only, arrived once a tile by the producer), except that warpgroup 1 runs its
``P_A @ V_A`` before it waits for tile B, so tile A is free before B lands and the producer, the slower side, does
not wait for ``free``; and each math warpgroup dequantizes the last 16 tokens of its own next tile itself
(:func:`_own_chunk`), where it would otherwise wait for the other's row maxima: warpgroup 0 those of the next A
once both are done with A, warpgroup 1 those of B as a pair starts, once the previous pair is done with B.
Registers a thread: 200 for each math warpgroup, 104 for the producer (the pool of 3 x 168).
The producer stages each tile's slots in shared memory two tiles ahead (``k_idx``: one global load serves every
use, where a load at each use costs a round trip in series), prefetches the next tile's rows to L2 as a tile starts,
holds the next tile's e4m3 bytes in registers (its first 3 chunks of 16 tokens, 16 registers each, 16-byte loads)
while it waits for ``free[X]``, and its scales in a small buffer of their own (``[2, 64, 4]`` fp32, cp.async a tile
ahead); once tile X is free it copies its rope values (cp.async, 8 KB), dequantizes chunk after chunk into
``k_nope[X]`` (e4m3 -> bf16 by bit operations, times the scale in bf16x2: exact for the cache's power-of-two scales),
loading the next tile's chunk into the registers each frees, and arrives on ``ready[X]`` after a proxy fence. Shared
memory: 225104 bytes.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..runtime import interpreting
from .formats import fp8_latent_bytes

ENABLED = os.environ.get("DSA_GLUON", "1") != "0"  # off (DSA_GLUON=0): the Triton kernel serves every launch

GLUON_D_V, GLUON_D_R = 512, 64  # the head dims the kernel is written for (DSA)
# the launch config (the Triton kernel's, which the plan holds) the kernel serves: 64 x 64 tiles; seesaw_meta launches
# it with 4 warps; num_stages: for the config's key
GLUON_CONFIG = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}

SEESAW_WORKER_REGS = gl.constexpr(240)  # setmaxnreg of the worker warpgroup (the default one: 256)
# FP8 cache: setmaxnreg of the second math warpgroup and of the producer; the first math warpgroup gets the rest of
# the pool of 3 x 168 (the launch's registers at 384 threads): 200 + 200 + 104
SEESAW_FP8_MATH_REGS = gl.constexpr(200)
SEESAW_PRODUCER_REGS = gl.constexpr(104)
_LN2 = gl.constexpr(0.6931471805599453)
_XCHG = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
_GATHER = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # 16-byte bf16 copies, 16 rows a pass
# the producer (FP8 cache): a tile's e4m3 bytes in 4 chunks of 16 tokens, a chunk int32 [16, 4, 32] (token, group
# of 128 values, word of 4 values) with 4 words a thread of each of 4 tokens (a warp reads whole rows: 16-byte loads,
# 16 registers; as uint8 elements the compiler keeps one byte a register)
_CHUNK = gl.constexpr(16)
_OWN = gl.constexpr(3)  # the chunk of a tile its math warpgroup dequantizes (the producer: the ones before)
_CHUNK_WORDS = gl.constexpr(gl.BlockedLayout([1, 1, 4], [2, 4, 4], [4, 1, 1], [2, 1, 0]))
_CHUNK_SCALES = gl.constexpr(gl.SliceLayout(2, _CHUNK_WORDS))
_SCALE_COPY = gl.constexpr(gl.BlockedLayout([1, 2], [16, 2], [4, 1], [1, 0]))  # fp32 [64, 4], 8-byte cp.async
_ROPE_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))  # bf16 [64, 64], one row a thread
_PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
_IDX = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # a tile's 64 slots over the producer's 128 threads
_PREFETCH = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0]))  # [64 tokens, 8 lines]
_SCALES_AT = gl.constexpr(512)  # byte of an FP8 latent cache row where its 4 fp32 scales start
_ROPE_AT = gl.constexpr(528)  # byte of an FP8 latent cache row where its bf16 rope values start
# mbarriers: tile X landed (2), m_A, m_B, P_A, P_B published, tile X free (2), the row sums published
_READY, _M_A, _M_B, _P, _FREE, _DONE = (gl.constexpr(i) for i in (0, 2, 3, 4, 6, 8))
_NUM_BARS = gl.constexpr(9)


def seesaw_meta(fwd_meta: dict) -> dict:
    """The seesaw kernel's keyword arguments from the Triton kernel's ``fwd_meta`` (a bf16 or FP8 cache): 4 warps
    (the other warpgroups come from ``gl.warp_specialize``)."""
    return {**fwd_meta, "num_warps": 4}


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
def _publish(bars, i: gl.constexpr):
    """Arrive on mbarrier ``bars[i]``: once for the warpgroup, by its first thread after a barrier of its 128 (so
    after every thread's stores and proxy fences before the call)."""
    mbarrier.arrive(bars.index(i))


@gluon.jit
def _gather_q(q_nope, q_rope, q_ptr, H, s_qs, s_qh, M, row0):
    """cp.async query rows ``row0 + j`` (j < 64; rows from ``M`` on zero-filled), row m at ``q_ptr + (m // H) * s_qs
    + (m % H) * s_qh``, into ``q_nope[1, 64, 512]`` and ``q_rope[1, 64, 64]``."""
    offs_m = row0 + gl.arange(0, q_nope.shape[1], layout=gl.SliceLayout(1, _GATHER))
    q_rows = (offs_m // H).to(gl.int64) * s_qs + (offs_m % H) * s_qh
    _gather(q_nope.index(0), q_rope.index(0), q_ptr, q_rows, offs_m < M, q_nope.shape[2], q_rope.shape[2], _GATHER)


@gluon.jit
def _gather_own(nope, rope, kv_ptr, idx_row, start, hi, num_slots, s_kv, bars, WG: gl.constexpr):
    """Warpgroup ``WG``'s gather of the tokens ``[start, start + 64)`` (slots past ``hi`` or invalid: zero-filled
    rows) into its tile ``nope[64, 512]``, ``rope[64, 64]`` from a bf16 cache, landing on mbarrier ``bars[WG]``
    (every thread's copies arrive there)."""
    slot, ok = _slots(idx_row, start, hi, num_slots, nope.shape[0], gl.SliceLayout(1, _GATHER))
    _gather(nope, rope, kv_ptr, slot.to(gl.int64) * s_kv, ok, nope.shape[1], rope.shape[1], _GATHER)
    async_copy.mbarrier_arrive(bars.index(_READY + WG), increment_count=False)


@gluon.jit
def _finite(m):
    """The row maxima ``m`` with -inf as 0: the reference a row's exponents are taken from (no -inf - -inf while
    nothing of the row is valid yet)."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _issue_pv(acc, factor, k_nope, k_rope, x, COL: gl.constexpr):
    """``acc * factor[:, None] + P_x @ V_x[:, COL:COL + 256]`` issued (async): ``acc`` a warpgroup's ``O_w[64, 256]``
    fp32, ``factor[64]`` its rescale (rows), ``P_x`` tile x's probabilities (in its rope part), ``V_x`` its values."""
    acc = acc * gl.convert_layout(factor, gl.SliceLayout(1, acc.type.layout))[:, None]
    return warpgroup_mma(k_rope.index(x), k_nope.index(x).slice(COL, acc.shape[1], dim=1), acc, is_async=True)


@gluon.jit
def _issue_pv_a(acc, m_run, m_a, k_nope, k_rope, z, bars, ph):
    """Warpgroup 1's ``O_1 * exp2(m_run - m_A) + P_A @ V_A[:, 256:]`` issued (async) once ``P_A`` is published (phase
    ``ph``); ``z`` = 0 (:func:`_seesaw_wg`'s loop-variant zero)."""
    mbarrier.wait(bars.index(_P), ph)
    fence_async_shared()
    return _issue_pv(acc, gl.exp2(m_run - _finite(m_a)), k_nope, k_rope, z, acc.shape[1])


@gluon.jit
def _seesaw_wg(WG: gl.constexpr, q_nope, q_rope, k_nope, k_rope, m_x, l_x, bars, q_ptr, H, s_qs, s_qh, kv_ptr,
               idx_row, lo, hi, num_slots, s_kv, qk_scale, out_ptr, lse_ptr, M, row0, base_row, num_splits):
    """Warpgroup ``WG`` of the seesaw (4 warps): scores block ``2i + WG`` of every pair i, accumulates the value
    columns ``[256 WG, 256 WG + 256)`` and writes them for query rows ``row0 + j < M`` (at ``out_ptr + (base_row + j)
    * num_splits * 512``); warpgroup 0 writes the lse too (at ``lse_ptr + (base_row + j) * num_splits``). Shared
    memory: ``q_nope[1, 64, 512]``, ``q_rope[1, 64, 64]`` (gathered by warpgroup 0 with its first tile: query row m
    at ``q_ptr + (m // H) * s_qs + (m % H) * s_qh``), tiles A and B ``k_nope[2, 64, 512]``, ``k_rope[2, 64, 64]``
    (``k_rope[X]`` holds ``P_X`` once X is scored), ``m_x[2, 64]`` (``m_A``, ``m_B``), ``l_x[2, 64]`` (the final
    row sums), ``bars`` (the mbarriers: the module docstring). Over the FP8 cache (``kv_ptr`` uint8) the producer
    (:func:`_produce`) gathers q and the tiles: only the waits on ``ready`` stay, warpgroup 1 runs its ``P_A @
    V_A`` before it waits for tile B, and each dequantizes chunk ``_OWN`` of its own tiles (:func:`_own_chunk`). The
    DSA shapes only (the partitions take no constexpr argument)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    D_V: gl.constexpr = 512
    BLOCK_H: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 64
    HALF: gl.constexpr = D_V // 2
    FED: gl.constexpr = kv_ptr.dtype.element_ty == gl.uint8  # the FP8 cache: the producer fills the tiles
    S_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_MMA)
    S_COLS: gl.constexpr = gl.SliceLayout(0, S_MMA)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_MMA)

    n_pairs = gl.cdiv(hi - lo, 2 * BLOCK_N)  # <= 0 for an empty split (hi < lo past k_len)
    own_n, own_r = k_nope.index(WG), k_rope.index(WG)
    if n_pairs > 0:
        if not FED:
            if WG == 0:
                _gather_q(q_nope, q_rope, q_ptr, H, s_qs, s_qh, M, row0)
            _gather_own(own_n, own_r, kv_ptr, idx_row, lo + WG * BLOCK_N, hi, num_slots, s_kv, bars, WG)
        if WG == 1:  # q: gathered with tile A
            mbarrier.wait(bars.index(_READY), 0)
        if FED and WG == 0:  # its chunk of the first A
            _own_chunk(own_n, kv_ptr, idx_row, lo, hi, num_slots, s_kv)

    m_run = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=S_ROWS)  # the last pair's m_B (O_w's reference)
    l_w = gl.zeros([BLOCK_H], gl.float32, layout=S_ROWS)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=O_MMA)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_MMA)
    for i in range(n_pairs):
        ph = i & 1
        # z = 0 (fewer than 2^30 pairs), but not loop-invariant: the MMAs' shared memory descriptors are made in the
        # loop (hoisted, ptxas spills them: 36 + 8 of 64 bits)
        z = i >> 30
        own_n, own_r = k_nope.index(WG + z), k_rope.index(WG + z)
        start = lo + (2 * i + WG) * BLOCK_N
        if WG == 1 and FED:  # its chunk of B (once the last pair is done with B), then P_A @ V_A: tile A is
            # free before B lands (the producer is the slower side)
            if i > 0:
                mbarrier.wait(bars.index(_FREE + 1), ph ^ 1)
            _own_chunk(own_n, kv_ptr, idx_row, start, hi, num_slots, s_kv)
            mbarrier.wait(bars.index(_M_A), ph)
            m_in = m_x.index(0).load(S_ROWS)
            acc = warpgroup_mma_wait(0, deps=(_issue_pv_a(acc, m_run, m_in, k_nope, k_rope, z, bars, ph), ))
            _publish(bars, _FREE)
        mbarrier.wait(bars.index(_READY + WG), ph)
        fence_async_shared()
        s = warpgroup_mma(q_nope.index(z), own_n.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope.index(z), own_r.permute((1, 0)), s, is_async=True)
        _, cols_ok = _slots(idx_row, start, hi, num_slots, BLOCK_N, S_COLS)
        s = warpgroup_mma_wait(0, deps=(s, ))
        s = gl.where(cols_ok[None, :], s * qk_scale, float("-inf"))
        if WG == 0:
            m_in = m_run
        elif not FED:  # m_A of this pair
            mbarrier.wait(bars.index(_M_A), ph)
            m_in = m_x.index(0).load(S_ROWS)
        m_new = gl.maximum(m_in, gl.max(s, 1))
        m_x.index(WG).store(m_new)
        _publish(bars, _M_A + WG)
        m_ref = _finite(m_new)
        if WG == 0:  # P_A, l_0; O_0 = O_0 * exp2(m_run - m_A) + P_A @ V_A[:, :256]
            p = gl.exp2(s - m_ref[:, None])
            alpha = gl.exp2(m_run - m_ref)
            l_w = l_w * alpha + gl.sum(p, 1)
            own_r.store(p.to(dtype))  # P_A over the rope part of tile A (its score MMA is done)
            fence_async_shared()
            _publish(bars, _P)
            acc = warpgroup_mma_wait(0, deps=(_issue_pv(acc, alpha, k_nope, k_rope, z, 0), ))
            _publish(bars, _FREE)
            if FED and i + 1 < n_pairs:  # its chunk of the next A, once both are done with A
                mbarrier.wait(bars.index(_FREE), ph)
                _own_chunk(own_n, kv_ptr, idx_row, start + 2 * BLOCK_N, hi, num_slots, s_kv)
            mbarrier.wait(bars.index(_M_B), ph)  # then O_0 and l_0 *= exp2(m_A - m_B)
            m_b = m_x.index(1).load(S_ROWS)
            beta = gl.exp2(m_new - _finite(m_b))
            l_w = l_w * beta
            mbarrier.wait(bars.index(_P + 1), ph)
            fence_async_shared()
        else:  # bf16 cache: warpgroup 1's P_A @ V_A runs while P_B and l_1 are made
            if not FED:
                acc = _issue_pv_a(acc, m_run, m_in, k_nope, k_rope, z, bars, ph)
            p = gl.exp2(s - m_ref[:, None])
            l_w = l_w * gl.exp2(m_run - m_ref) + gl.sum(p, 1)
            own_r.store(p.to(dtype))  # P_B over the rope part of tile B (its score MMA is done)
            fence_async_shared()
            _publish(bars, _P + 1)
            if not FED:
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                _publish(bars, _FREE)
            m_b = m_new
            beta = gl.exp2(m_in - m_ref)  # O_1 *= exp2(m_A - m_B)
        acc = _issue_pv(acc, beta, k_nope, k_rope, 1 + z, WG * HALF)  # P_B @ V_B
        # the next pair's tile of this warpgroup once both are done with it: A while warpgroup 0's PV_B runs
        # (that reads B), B after warpgroup 1's PV_B
        if WG == 0 and not FED:
            mbarrier.wait(bars.index(_FREE), ph)
            if i + 1 < n_pairs:
                _gather_own(own_n, own_r, kv_ptr, idx_row, start + 2 * BLOCK_N, hi, num_slots, s_kv, bars, WG)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        _publish(bars, _FREE + 1)
        if WG == 1 and not FED:
            if i + 1 < n_pairs:
                mbarrier.wait(bars.index(_FREE + 1), ph)
                _gather_own(own_n, own_r, kv_ptr, idx_row, start + 2 * BLOCK_N, hi, num_slots, s_kv, bars, WG)
        m_run = m_b

    l_x.index(WG).store(l_w)
    _publish(bars, _DONE)
    mbarrier.wait(bars.index(_DONE), 0)
    l_i = l_w + l_x.index(1 - WG).load(S_ROWS)
    empty = l_i == 0  # not NaN: a NaN score propagates to out and lse
    l_ref = gl.where(empty, 1.0, l_i)
    out = acc / gl.convert_layout(l_ref, O_ROWS)[:, None]
    rows_o = gl.arange(0, BLOCK_H, layout=O_ROWS)
    cols_o = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_MMA))
    gl.store(out_ptr + ((base_row + rows_o) * num_splits)[:, None] * D_V + cols_o[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(row0 + rows_o < M)[:, None])
    if WG == 0:
        lse = gl.where(empty, float("-inf"), (m_run + gl.log2(l_ref)) * _LN2)
        rows_l = gl.arange(0, BLOCK_H, layout=S_ROWS)
        gl.store(lse_ptr + (base_row + rows_l) * num_splits, lse, mask=row0 + rows_l < M)


@gluon.jit
def _seesaw_wg0(q_nope, q_rope, k_nope, k_rope, m_x, l_x, bars, q_ptr, H, s_qs, s_qh, kv_ptr, idx_row, lo, hi,
                num_slots, s_kv, qk_scale, out_ptr, lse_ptr, M, row0, base_row, num_splits):
    _seesaw_wg(0, q_nope, q_rope, k_nope, k_rope, m_x, l_x, bars, q_ptr, H, s_qs, s_qh, kv_ptr, idx_row, lo, hi,
               num_slots, s_kv, qk_scale, out_ptr, lse_ptr, M, row0, base_row, num_splits)


@gluon.jit
def _seesaw_wg1(q_nope, q_rope, k_nope, k_rope, m_x, l_x, bars, q_ptr, H, s_qs, s_qh, kv_ptr, idx_row, lo, hi,
                num_slots, s_kv, qk_scale, out_ptr, lse_ptr, M, row0, base_row, num_splits):
    _seesaw_wg(1, q_nope, q_rope, k_nope, k_rope, m_x, l_x, bars, q_ptr, H, s_qs, s_qh, kv_ptr, idx_row, lo, hi,
               num_slots, s_kv, qk_scale, out_ptr, lse_ptr, M, row0, base_row, num_splits)


@gluon.jit
def _staged(idx, num_slots, LAYOUT: gl.constexpr):
    """Slots staged in shared memory (``idx``: an int32[n] view, -1 past the split) in ``LAYOUT`` and whether each is
    valid (a shared load, where :func:`_slots` waits for a global one)."""
    slot = idx.load(LAYOUT)
    return slot, _valid(slot, num_slots)


@gluon.jit
def _load_chunk(kv_ptr, idx, num_slots, s_kv):
    """The e4m3 bytes as ``int32[16, 4, 32]`` words (token, group of 128 values, 4 values a word, the first in the
    low byte) of the FP8 latent cache rows (``s_kv`` bytes apart from ``kv_ptr``) of the 16 tokens whose slots are
    staged in ``idx`` in ``_CHUNK_WORDS``: 16-byte loads, zeros for invalid slots (not read)."""
    slot, ok = _staged(idx, num_slots, gl.SliceLayout(1, _CHUNK_SCALES))
    return _load_words(kv_ptr, slot, ok, s_kv)


@gluon.jit
def _load_words(kv_ptr, slot, ok, s_kv):
    """:func:`_load_chunk` of the rows ``slot`` (16, in ``SliceLayout(1, _CHUNK_SCALES)``; not read where not
    ``ok``)."""
    rows = (kv_ptr + slot.to(gl.int64) * s_kv).to(gl.pointer_type(gl.int32))
    groups = gl.arange(0, 4, layout=gl.SliceLayout(0, _CHUNK_SCALES))
    words = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _CHUNK_WORDS)))
    ptrs = rows[:, None, None] + (groups * 32)[None, :, None] + words[None, None, :]
    return gl.load(ptrs, mask=ok[:, None, None], other=0)


@gluon.jit
def _e4m3x4_to_bf16(w, scale):
    """Four e4m3 values a word ``w`` (int32, the first in the low byte) times ``scale`` (fp32, a power of two) ->
    four bf16 tensors (exact). Each byte b as the bf16 bits ``(b & 0x80) << 8 | (b & 0x7F) << 4`` is its value
    times 2^-120 (subnormals too; ``prmt``'s sign-replicating selectors make the sign bit, one shift and one mask
    two values), then times 2^120 and ``scale`` in bf16x2 (``scale``'s bf16 bits: the high half of its fp32 bits,
    exact for a power of two)."""
    bits = scale.to(gl.int32, bitcast=True)
    scale2 = (bits & -65536) | ((bits >> 16) & 65535)  # bf16x2 (scale, scale)
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi, k;
        prmt.b32 lo, $4, 0, 0x9180;
        prmt.b32 hi, $4, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 lo, lo, 0x87F087F0;
        and.b32 hi, hi, 0x87F087F0;
        mov.b32 k, 0x7B807B80;
        mul.rn.bf16x2 lo, lo, k;
        mul.rn.bf16x2 hi, hi, k;
        mul.rn.bf16x2 lo, lo, $5;
        mul.rn.bf16x2 hi, hi, $5;
        mov.b32 {$0, $1}, lo;
        mov.b32 {$2, $3}, hi;
        }""",
        "=h,=h,=h,=h,r,r", [w, scale2], dtype=(gl.bfloat16, ) * 4, is_pure=True, pack=1)


@gluon.jit
def _scale_rows(kv_ptr, slot, s_kv):
    """fp32 pointers to the 4 scales of the FP8 latent cache rows ``slot`` (``s_kv`` bytes apart from ``kv_ptr``)."""
    return (kv_ptr + slot.to(gl.int64) * s_kv + _SCALES_AT).to(gl.pointer_type(gl.float32))


@gluon.jit
def _copy_scales(scales, kv_ptr, idx, num_slots, s_kv):
    """cp.async the fp32 scales (4 a row, from byte ``_SCALES_AT``) of the FP8 latent cache rows of the 64 tokens
    whose slots are staged in ``idx`` into ``scales[64, 4]`` (zeros for invalid slots), one commit group."""
    slot, ok = _staged(idx, num_slots, gl.SliceLayout(1, _SCALE_COPY))
    _copy_rows(scales, _scale_rows(kv_ptr, slot, s_kv), ok, scales.shape[1], _SCALE_COPY)
    async_copy.commit_group()


@gluon.jit
def _dequantize_chunk(nope, scales, words, c: gl.constexpr):
    """Chunk ``c`` of a tile: ``nope[16c:16c + 16, :]`` = the e4m3 ``words`` (:func:`_load_chunk`'s) times their
    scales (``scales[64, 4]``: the tile's) in bf16."""
    _store_chunk(nope, scales.slice(c * _CHUNK, _CHUNK, dim=0).load(_CHUNK_SCALES), words, c)


@gluon.jit
def _store_chunk(nope, scale, words, c: gl.constexpr):
    """``nope[16c:16c + 16, :]`` = the e4m3 ``words`` times ``scale`` (fp32 ``[16, 4]`` in ``_CHUNK_SCALES``, a
    token's 4 groups) in bf16."""
    v0, v1, v2, v3 = _e4m3x4_to_bf16(words, scale[:, :, None])
    x = gl.join(gl.join(v0, v2), gl.join(v1, v3))  # [16, 4, 32, 2, 2]: [..., k, m] = v(2k + m), value 4 word + 2k + m
    nope.slice(c * _CHUNK, _CHUNK, dim=0).store(gl.reshape(x, [_CHUNK, nope.shape[1]]))


@gluon.jit
def _own_chunk(nope, kv_ptr, idx_row, start, hi, num_slots, s_kv):
    """A math warpgroup's share of the tile of the tokens ``[start, start + 64)``: chunk ``_OWN`` (its 16 tokens from
    ``start + 16 _OWN``) into ``nope``, their slots, e4m3 words and scales loaded from global memory (the rows are in
    L2: the producer prefetched them); tokens from ``hi`` on or invalid slots: zero rows."""
    slot, ok = _slots(idx_row, start + _OWN * _CHUNK, hi, num_slots, _CHUNK, gl.SliceLayout(1, _CHUNK_SCALES))
    groups = gl.arange(0, 4, layout=gl.SliceLayout(0, _CHUNK_SCALES))
    scale = gl.load(_scale_rows(kv_ptr, slot, s_kv)[:, None] + groups[None, :], mask=ok[:, None], other=0.0)
    _store_chunk(nope, scale, _load_words(kv_ptr, slot, ok, s_kv), _OWN)


@gluon.jit
def _prefetch_tile(kv_ptr, idx, num_slots, s_kv):
    """``prefetch.global.L2`` of the FP8 latent cache rows (656 bytes, ``s_kv`` apart) of the valid slots staged in
    ``idx`` (64): every 128-byte line of each (offsets 0, 128, ..., 640 and 655), so that the loads of that tile
    (the producer's after its ``free`` wait, its math warpgroup's chunk) hit L2."""
    slot, ok = _staged(idx, num_slots, gl.SliceLayout(1, _PREFETCH))
    offs = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(0, _PREFETCH)) * 128, 655)
    rows = kv_ptr + gl.where(ok, slot, 0).to(gl.int64) * s_kv
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [rows[:, None] + offs[None, :]],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _produce_tile(k_nope, k_rope, k_scale, k_idx, bars, kv_ptr, idx_row, lo, hi, num_slots, s_kv, t, x0, x1, x2):
    """Tile t (tokens ``[lo + 64t, lo + 64t + 64)``; X = t % 2 of pair t // 2) into ``k_nope[X]`` but for chunk
    ``_OWN`` (its math warpgroup's), and ``k_rope[X]``, arriving on ``ready[X]``: ``x0, x1, x2`` hold its e4m3 words
    of chunks 0, 1, 2 (:func:`_load_chunk`, 16 tokens each), ``k_scale[X]`` its scales (in flight), ``k_idx[X]`` /
    ``k_idx[1 - X]`` the slots of tiles t and t + 1 (then ``k_idx[X]`` those of t + 2). Returns the next tile's three
    chunks (loaded as the chunks are dequantized). ``X`` stays a runtime value: unrolled, the two tiles' code spills."""
    gl.static_assert(_OWN == 3, "the producer dequantizes chunks 0, 1, 2; its math warpgroup the last")
    X = t % 2
    nope, rope, scales = k_nope.index(X), k_rope.index(X), k_scale.index(X)
    cur, nxt = k_idx.index(X), k_idx.index(1 - X)
    _prefetch_tile(kv_ptr, nxt, num_slots, s_kv)  # the next tile's loads after its free wait: L2 hits
    # the next tile's scales: everyone read that buffer (the previous tile) before its ready arrive
    _copy_scales(k_scale.index(1 - X), kv_ptr, nxt, num_slots, s_kv)
    # the slots of tile t + 2, staged once this tile is done with cur
    after, _ = _slots(idx_row, lo + (t + 2) * 4 * _CHUNK, hi, num_slots, 64, _IDX)
    slot, ok = _staged(cur, num_slots, gl.SliceLayout(1, _ROPE_COPY))
    if t >= 2:  # pair t // 2 - 1 is done with tile X (its V and its P in the rope part)
        mbarrier.wait(bars.index(_FREE + X), (t // 2 - 1) & 1)
    rows = (kv_ptr + slot.to(gl.int64) * s_kv + _ROPE_AT).to(gl.pointer_type(rope.dtype))
    _copy_rows(rope, rows, ok, rope.shape[1], _ROPE_COPY)
    async_copy.commit_group()
    async_copy.wait_group(2)  # q and this tile's scales (every group before the last two)
    gl.thread_barrier()  # everyone's scale copies
    _dequantize_chunk(nope, scales, x0, 0)
    x0 = _load_chunk(kv_ptr, nxt.slice(0, _CHUNK), num_slots, s_kv)
    _dequantize_chunk(nope, scales, x1, 1)
    x1 = _load_chunk(kv_ptr, nxt.slice(_CHUNK, _CHUNK), num_slots, s_kv)
    _dequantize_chunk(nope, scales, x2, 2)
    x2 = _load_chunk(kv_ptr, nxt.slice(2 * _CHUNK, _CHUNK), num_slots, s_kv)
    gl.thread_barrier()  # everyone's reads of cur
    cur.store(after)
    async_copy.wait_group(0)  # the rope values (and the next tile's scales)
    fence_async_shared()  # the generic-proxy stores and copies, before the wgmma reads
    mbarrier.arrive(bars.index(_READY + X))  # after a barrier of the 128
    return x0, x1, x2


@gluon.jit
def _produce(q_nope, q_rope, k_nope, k_rope, k_scale, k_idx, bars, q_ptr, H, s_qs, s_qh, kv_ptr, idx_row, lo, hi,
             num_slots, s_kv, M, row0):
    """The producer warpgroup over the FP8 latent cache (``kv_ptr``: uint8 rows of ``s_kv`` bytes): q (as
    :func:`_gather_q`), then tiles A and B of the tokens ``[lo, hi)`` for every pair (:func:`_produce_tile`; tokens
    past ``hi`` or invalid slots: zero rows), arriving on ``ready[X]`` once a tile (q with the first A). A tile's
    slots are staged in ``k_idx`` (``[2, 64]`` int32) two tiles ahead, the e4m3 bytes of its first 3 chunks are in
    registers since the previous tile, its scales in ``k_scale[X]`` (``[2, 64, 4]`` fp32, cp.async) since the
    previous tile's start; the rest once both math warpgroups are done with tile X."""
    n_pairs = gl.cdiv(hi - lo, 8 * _CHUNK)  # <= 0 for an empty split
    if n_pairs > 0:
        _gather_q(q_nope, q_rope, q_ptr, H, s_qs, s_qh, M, row0)
        async_copy.commit_group()
    for X in gl.static_range(2):  # the slots of tiles 0 and 1 (-1 past the split)
        slot, _ = _slots(idx_row, lo + X * 4 * _CHUNK, hi, num_slots, 64, _IDX)
        k_idx.index(X).store(slot)
    gl.thread_barrier()
    first = k_idx.index(0)
    _copy_scales(k_scale.index(0), kv_ptr, first, num_slots, s_kv)
    x0 = _load_chunk(kv_ptr, first.slice(0, _CHUNK), num_slots, s_kv)
    x1 = _load_chunk(kv_ptr, first.slice(_CHUNK, _CHUNK), num_slots, s_kv)
    x2 = _load_chunk(kv_ptr, first.slice(2 * _CHUNK, _CHUNK), num_slots, s_kv)
    for t in range(2 * n_pairs):
        x0, x1, x2 = _produce_tile(k_nope, k_rope, k_scale, k_idx, bars, kv_ptr, idx_row, lo, hi, num_slots,
                                   s_kv, t, x0, x1, x2)
    async_copy.wait_group(0)  # an empty split's (zero-filling) scale copies


@gluon.jit
def _sparse_attention_fwd_seesaw(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    M, H, k_len, tokens_per_split, num_slots, qk_scale,
    s_qr, s_qs, s_qh, s_kv, s_ir,
    D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_DR: gl.constexpr,
    NUM_SPLITS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DOT_FP32: gl.constexpr,
    KV_FP8: gl.constexpr = False, GROUP: gl.constexpr = 128, ROPE_AT: gl.constexpr = 0,
):
    """The arguments and outputs of the Triton kernel ``_sparse_attention_fwd``, launched with 4 warps
    (:func:`seesaw_meta`): ``kv_ptr`` rows of ``s_kv`` bf16 elements, or (``KV_FP8``) FP8 latent cache rows of
    ``s_kv`` bytes (``GROUP`` = 128, rope values at byte ``ROPE_AT`` = 528); ``out[R, M, NUM_SPLITS, D_V]`` (q's dtype
    with one split, else fp32 partials), ``lse[R, M, NUM_SPLITS]`` natural log (-inf and out 0 for a row without a
    valid slot; NaN scores propagate)."""
    gl.static_assert(D_V == 512 and D_R == 64 and BLOCK_H == 64 and BLOCK_N == 64 and gl.num_warps() == 4)
    gl.static_assert(BLOCK_DV == D_V and BLOCK_DR == D_R and not DOT_FP32)
    gl.static_assert(not KV_FP8 or (GROUP == 128 and ROPE_AT == _ROPE_AT and _SCALES_AT + 4 * 4 == _ROPE_AT))
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    NOPE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], dtype)
    ROPE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], dtype)
    gl.static_assert(ROPE == gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))  # P in the rope part

    pid = gl.program_id(0)
    num_hb = gl.cdiv(M, BLOCK_H)
    hb = pid % num_hb
    split = (pid // num_hb) % NUM_SPLITS
    r = (pid // num_hb // NUM_SPLITS).to(gl.int64)

    q_nope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], NOPE)
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], ROPE)
    k_nope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_V], NOPE)
    k_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_R], ROPE)
    m_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], _XCHG)
    l_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], _XCHG)
    bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(_NUM_BARS):
        # tiles: the cp.async arrive of each thread of the gathering warpgroup (FP8: one arrive of the producer); the
        # rest: one arrive (its first thread, after a barrier of the warpgroup) of one warpgroup, or of both
        mbarrier.init(bars.index(b), count=(1 if KV_FP8 else 128) if b < _M_A else (2 if b >= _FREE else 1))

    row0 = hb * BLOCK_H
    lo = split * tokens_per_split
    hi = gl.minimum(lo + tokens_per_split, k_len)
    args = (q_nope, q_rope, k_nope, k_rope, m_x, l_x, bars, q_ptr + r * s_qr, H, s_qs, s_qh, kv_ptr, idx_ptr + r * s_ir,
            lo, hi, num_slots, s_kv, qk_scale, out_ptr + split * D_V, lse_ptr + split, M, row0, r * M + row0,
            NUM_SPLITS)
    if KV_FP8:
        k_scale = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, D_V // GROUP], _PLAIN)
        k_idx = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], _XCHG)
        feed = (q_nope, q_rope, k_nope, k_rope, k_scale, k_idx, bars, q_ptr + r * s_qr, H, s_qs, s_qh, kv_ptr,
                idx_ptr + r * s_ir, lo, hi, num_slots, s_kv, M, row0)
        gl.warp_specialize([(_seesaw_wg0, args), (_seesaw_wg1, args), (_produce, feed)], [4, 4],
                           [SEESAW_FP8_MATH_REGS, SEESAW_PRODUCER_REGS])
    else:
        gl.warp_specialize([(_seesaw_wg0, args), (_seesaw_wg1, args)], [4], [SEESAW_WORKER_REGS])


def gluon_fits(q: torch.Tensor, kv: torch.Tensor, d_v: int, config: dict) -> bool:
    """Whether the seesaw kernel's shapes, dtypes and strides fit a launch (metadata only: the pointers are
    :func:`gluon_aligned`'s): bf16 ``q[..., D]`` with D = 576 and ``d_v`` = 512, and ``kv[num_slots, D]`` bf16 or the
    FP8 latent cache ``kv[num_slots, 656]`` uint8; the last dim contiguous and the other strides multiples of 16
    bytes (the gathers are 16-byte cp.async), and a config of ``BLOCK_H`` = ``BLOCK_N`` = 64 at 8 warps
    (:data:`GLUON_CONFIG`; any ``num_splits`` and stages)."""
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
    """Whether the seesaw kernel serves launches of this metadata: :func:`gluon_fits`, on a CUDA sm_90 device outside
    the interpreter, unless ``DSA_GLUON=0`` (then the Triton kernel serves every launch). A call still needs
    :func:`gluon_aligned` pointers."""
    return (ENABLED and q.is_cuda and not interpreting() and torch.cuda.get_device_capability(q.device) == (9, 0)
            and gluon_fits(q, kv, d_v, config))
