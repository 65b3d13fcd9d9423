"""Triton kernel of the paged-cache append (:func:`~.cache.append_tokens`): rows as they are, or quantized into the
FP8 latent cache or into MODEL1 FP8 pages (:mod:`.formats`).

The kernel takes *work items*, one per (sequence, touched page): ``items[n, 4]`` int32 =
(first source row, token count, physical page, first slot in the page). Each page is written by one
program, so the summaries merge without atomics: a program whose first slot is 0 starts a fresh page.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..fp8_rounding import round_to_e4m3


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` -> bf16, rounded to nearest even on the bits (NaN stays NaN).

    The Triton interpreter's fp32 -> bf16 cast truncates; the GPU's cvt rounds to nearest even, like this."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)


@triton.jit
def quantize_rows(x, mask, FLOOR: tl.constexpr = 1e-4):
    """fp32 ``x[rows, cols]`` (0 where ``mask`` is off) -> (e4m3 bytes as uint8, fp32 scale per row, bad per row),
    one power-of-two scale per row (``2^ceil(log2(max(amax, FLOOR) / 448))``, the reference's rule).

    A row with a NaN or an inf gets scale NaN and bytes 0x7F (e4m3 NaN); counted in integers, because a float max
    or min on the GPU returns the other operand of a NaN."""
    bad = tl.sum((mask & ~(tl.abs(x) < float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
    # scale = 2^ceil(log2(amax / 448)) from the bits: 448 = 1.75 * 2^8, so the exponent is
    # exponent(amax) - 8, plus one when amax's mantissa exceeds 1.75 (exact, no division)
    bits = amax.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = tl.where(bad, float("nan"), (exp << 23).to(tl.float32, bitcast=True))
    inv_scale = ((254 - exp) << 23).to(tl.float32, bitcast=True)
    x8 = round_to_e4m3(x * inv_scale[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(bad[:, None], 0x7F, x8).to(tl.uint8), scale, bad


@triton.jit
def _append_fp8_latent(kv_src_ptr, kv_ptr, stride_kv_src, src, count, page, first, part, DL,
                       P: tl.constexpr, ROW_BYTES: tl.constexpr, ROPE_AT: tl.constexpr, DR: tl.constexpr,
                       BLOCK_T: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    """One part of the new rows of an FP8 latent cache (layout: :mod:`.formats`): part ``g`` < the number
    of groups quantizes latent columns ``[128 g, 128 g + 128)`` and writes their bytes and scale; the last part
    copies the rope values to bf16."""
    offs_t = tl.arange(0, BLOCK_T)
    if part * GROUP < DL:
        cols = part * GROUP + tl.arange(0, GROUP)
        cmask = cols < DL
        for t0 in range(0, count, BLOCK_T):
            rows = t0 + offs_t
            tmask = rows < count
            mask = tmask[:, None] & cmask[None, :]
            x = tl.load(kv_src_ptr + (src + rows)[:, None] * stride_kv_src + cols[None, :], mask=mask, other=0.0)
            x8, scale, _ = quantize_rows(x.to(tl.float32), mask)
            row_ptr = kv_ptr + (page * P + first + rows) * ROW_BYTES
            tl.store(row_ptr[:, None] + cols[None, :], x8, mask=mask)
            tl.store((row_ptr + DL + 4 * part).to(tl.pointer_type(tl.float32)), scale, mask=tmask)
    else:
        offs_r = tl.arange(0, BLOCK_R)
        for t0 in range(0, count, BLOCK_T):
            rows = t0 + offs_t
            mask = (rows < count)[:, None] & (offs_r < DR)[None, :]
            x = tl.load(kv_src_ptr + (src + rows)[:, None] * stride_kv_src + DL + offs_r[None, :], mask=mask)
            rope_ptr = (kv_ptr + (page * P + first + rows) * ROW_BYTES + ROPE_AT).to(tl.pointer_type(tl.bfloat16))
            tl.store(rope_ptr[:, None] + offs_r[None, :], round_to_bf16(x.to(tl.float32)), mask=mask)


@triton.jit
def _append_model1(kv_src_ptr, kv_ptr, stride_kv_src, src, count, page, first, part, DL,
                   P: tl.constexpr, PAGE_BYTES: tl.constexpr, DR: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_R: tl.constexpr, FLOOR: tl.constexpr):
    """One part of the new tokens of a MODEL1 cache (pages of ``PAGE_BYTES``; layout: :mod:`.formats`): part ``g``
    < ``DL / 64`` quantizes columns ``[64 g, 64 g + 64)`` and writes their bytes and ue8m0 scale byte; the last part
    copies the rope values to bf16 and writes the pad byte (0)."""
    offs_t = tl.arange(0, BLOCK_T)
    data = 2 * DR + DL  # e4m3 and bf16 bytes of a token; then P scale blocks of DL / 64 + 1 bytes
    base = kv_ptr + page * PAGE_BYTES
    scales = base + P * data + (DL // 64 + 1) * first
    if part * 64 < DL:
        cols = part * 64 + tl.arange(0, 64)
        for t0 in range(0, count, BLOCK_T):
            rows = t0 + offs_t
            tmask = rows < count
            mask = tmask[:, None] & (cols < DL)[None, :]
            x = tl.load(kv_src_ptr + (src + rows)[:, None] * stride_kv_src + cols[None, :], mask=mask, other=0.0)
            x8, scale, _ = quantize_rows(x.to(tl.float32), mask, FLOOR)
            tl.store(base + (first + rows)[:, None] * data + cols[None, :], x8, mask=mask)
            exponent = (scale.to(tl.int32, bitcast=True) >> 23).to(tl.uint8)  # 2^e -> e + 127; NaN -> 0xFF
            tl.store(scales + rows * (DL // 64 + 1) + part, exponent, mask=tmask)
    else:
        offs_r = tl.arange(0, BLOCK_R)
        for t0 in range(0, count, BLOCK_T):
            rows = t0 + offs_t
            tmask = rows < count
            mask = tmask[:, None] & (offs_r < DR)[None, :]
            x = tl.load(kv_src_ptr + (src + rows)[:, None] * stride_kv_src + DL + offs_r[None, :], mask=mask)
            rope_ptr = (base + (first + rows) * data + DL).to(tl.pointer_type(tl.bfloat16))
            tl.store(rope_ptr[:, None] + offs_r[None, :], round_to_bf16(x.to(tl.float32)), mask=mask)
            tl.store(scales + rows * (DL // 64 + 1) + DL // 64, tl.zeros([BLOCK_T], tl.uint8), mask=tmask)


@triton.jit
def append_kernel(
    items_ptr,
    kv_src_ptr, kv_ptr, stride_kv_src,
    ix_src_ptr, ik_ptr, iks_ptr, sum_ptr, stride_ix_src,
    D, DK,
    P: tl.constexpr,
    HAS_KV: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DKP: tl.constexpr,
    KV_FP8: tl.constexpr = False, ROW_BYTES: tl.constexpr = 0, ROPE_AT: tl.constexpr = 0, DR: tl.constexpr = 0,
    GROUP: tl.constexpr = 128, BLOCK_R: tl.constexpr = 16, KV_MODEL1: tl.constexpr = False,
    PAGE_BYTES: tl.constexpr = 0, FLOOR: tl.constexpr = 1e-4,
):
    """Program (item, part): part 0 quantizes the index keys and merges the page summaries (when
    HAS_INDEX); the other parts copy BLOCK_D latent columns each, or, into an FP8 latent cache (``KV_FP8``: rows
    of ``ROW_BYTES`` bytes, ``D`` = the latent width, ``DR`` rope values at byte ``ROPE_AT``), quantize one
    128-value group each, then copy the rope values; into a MODEL1 cache (``KV_MODEL1``: pages of ``PAGE_BYTES``,
    ``D`` quantized values a token, amax floor ``FLOOR``) one 64-value tile each, then the rope values."""
    item = tl.program_id(0)
    part = tl.program_id(1) - HAS_INDEX
    src = tl.load(items_ptr + item * 4).to(tl.int64)
    count = tl.load(items_ptr + item * 4 + 1)
    page = tl.load(items_ptr + item * 4 + 2).to(tl.int64)
    first = tl.load(items_ptr + item * 4 + 3)
    offs_t = tl.arange(0, BLOCK_T)
    if HAS_KV:
        if KV_MODEL1:
            if part >= 0:
                _append_model1(kv_src_ptr, kv_ptr, stride_kv_src, src, count, page, first, part, D, P=P,
                               PAGE_BYTES=PAGE_BYTES, DR=DR, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, FLOOR=FLOOR)
        elif KV_FP8:
            if part >= 0:
                _append_fp8_latent(kv_src_ptr, kv_ptr, stride_kv_src, src, count, page, first, part, D, P=P,
                                   ROW_BYTES=ROW_BYTES, ROPE_AT=ROPE_AT, DR=DR, BLOCK_T=BLOCK_T, GROUP=GROUP,
                                   BLOCK_R=BLOCK_R)
        elif part >= 0:
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
                x8, scale, bad = quantize_rows(x.to(tl.float32), mask)
                x8 = x8.to(tl.float8e4nv, bitcast=True)
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
