"""Triton kernel of the paged-cache append (:func:`~.cache.append_tokens`).

The kernel takes *work items*, one per (sequence, touched page): ``items[n, 4]`` int32 =
(first source row, token count, physical page, first slot in the page). Each page is written by one
program, so the summaries merge without atomics: a program whose first slot is 0 starts a fresh page.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """Round fp32 ``x`` (|x| <= 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic.

    The cast that follows is then exact. (The Triton interpreter's own fp32 -> e4m3 cast rounds
    wrongly near binade edges and ties; the GPU's cvt is right, and agrees with this.)
    """
    bits = x.to(tl.int32, bitcast=True)
    ulp_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # e4m3: 3 mantissa bits, min normal 2^-6
    y = x * ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)  # exact: |y| < 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds y to an integer, ties to even
    y = tl.where(y == 0.0, x * 0.0, y)  # keep the sign of zero
    return y * ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def append_kernel(
    items_ptr,
    kv_src_ptr, kv_ptr, stride_kv_src,
    ix_src_ptr, ik_ptr, iks_ptr, sum_ptr, stride_ix_src,
    D, DK,
    P: tl.constexpr,
    HAS_KV: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DKP: tl.constexpr,
):
    """Program (item, part): part 0 quantizes the index keys and merges the page summaries (when
    HAS_INDEX); the other parts copy BLOCK_D latent columns each."""
    item = tl.program_id(0)
    part = tl.program_id(1) - HAS_INDEX
    src = tl.load(items_ptr + item * 4).to(tl.int64)
    count = tl.load(items_ptr + item * 4 + 1)
    page = tl.load(items_ptr + item * 4 + 2).to(tl.int64)
    first = tl.load(items_ptr + item * 4 + 3)
    offs_t = tl.arange(0, BLOCK_T)
    if HAS_KV:
        if part >= 0:
            cols = part * BLOCK_D + tl.arange(0, BLOCK_D)
            cmask = cols < D
            for t0 in range(0, count, BLOCK_T):
                rows = t0 + offs_t
                mask = (rows < count)[:, None] & cmask[None, :]
                x = tl.load(kv_src_ptr + (src + rows)[:, None] * stride_kv_src + cols[None, :], mask=mask)
                slot = page * P + first + rows
                tl.store(kv_ptr + slot[:, None] * D + cols[None, :], x, mask=mask)
    if HAS_INDEX:
        if part < 0:
            offs_d = tl.arange(0, DKP)
            dmask = offs_d < DK
            # a page whose first written slot is > 0 already holds keys: start from its summary
            old = dmask & (first > 0)
            run_max = tl.load(sum_ptr + page * 2 * DK + offs_d, mask=old, other=float("-inf")).to(tl.float32)
            run_min = tl.load(sum_ptr + page * 2 * DK + DK + offs_d, mask=old, other=float("inf")).to(tl.float32)
            for t0 in range(0, count, BLOCK_T):
                rows = t0 + offs_t
                tmask = rows < count
                mask = tmask[:, None] & dmask[None, :]
                x = tl.load(ix_src_ptr + (src + rows)[:, None] * stride_ix_src + offs_d[None, :], mask=mask, other=0.0)
                x = x.to(tl.float32)
                # a row with a NaN or an inf gets scale NaN and NaN keys; counted in integers, because a float
                # max or min on the GPU returns the other operand of a NaN
                bad = tl.sum((mask & ~(tl.abs(x) < float("inf"))).to(tl.int32), axis=1) > 0
                amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
                # scale = 2^ceil(log2(amax / 448)) from the bits: 448 = 1.75 * 2^8, so the exponent is
                # exponent(amax) - 8, plus one when amax's mantissa exceeds 1.75 (exact, no division)
                bits = amax.to(tl.int32, bitcast=True)
                exp = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
                scale = tl.where(bad, float("nan"), (exp << 23).to(tl.float32, bitcast=True))
                inv_scale = ((254 - exp) << 23).to(tl.float32, bitcast=True)
                x8 = round_to_e4m3(x * inv_scale[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
                x8 = tl.where(bad[:, None], 0x7F, x8).to(tl.uint8).to(tl.float8e4nv, bitcast=True)  # 0x7F: NaN
                slot = page * P + first + rows
                tl.store(ik_ptr + slot[:, None] * DK + offs_d[None, :], x8, mask=mask)
                tl.store(iks_ptr + slot, scale, mask=tmask)
                deq = x8.to(tl.float32) * scale[:, None]
                # a page with a NaN key (now or in its old summary) keeps NaN summaries
                tile_bad = tl.sum((bad & tmask).to(tl.int32), axis=0) > 0
                nan_max = tile_bad | (run_max != run_max)
                nan_min = tile_bad | (run_min != run_min)
                run_max = tl.maximum(run_max, tl.max(tl.where(mask, deq, float("-inf")), axis=0))
                run_min = tl.minimum(run_min, tl.min(tl.where(mask, deq, float("inf")), axis=0))
                run_max = tl.where(nan_max, float("nan"), run_max)
                run_min = tl.where(nan_min, float("nan"), run_min)
            tl.store(sum_ptr + page * 2 * DK + offs_d, run_max, mask=dmask)
            tl.store(sum_ptr + page * 2 * DK + DK + offs_d, run_min, mask=dmask)
