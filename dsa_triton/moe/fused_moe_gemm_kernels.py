"""The Triton kernel of :func:`.fused_moe_gemm.fused_moe_gemm` (the algorithm: :mod:`.fused_moe_gemm`'s docstring) and its
nibble-to-weight conversions: inline PTX to bf16x2 on the GPU's bf16 path (FAST), exact fp16 bit arithmetic elsewhere.
"""
from __future__ import annotations

import triton
import triton.language as tl

FAST_SHIFT = tl.constexpr(64)  # bf16 path: weights computed as W * 2^-64 (in bf16 range), the fp32 sums scaled back

# Nibble c (the tuple's index) of both halves of a 32-bit register (two int16 quarters) -> a bf16x2 pair
# ``code * 2^-126``: the magnitude bits go to bits 6..8 (exponent low bits + mantissa top bit) of each half,
# the sign to bit 15.
_E2M1_BF16X2 = tl.constexpr((
    "{.reg .b32 t; and.b32 t, $1, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 $0, t, 0x81C081C0;}",
    "{.reg .b32 t; and.b32 t, $1, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 $0, t, 0x81C081C0;}",
    "{.reg .b32 t; shr.b32 t, $1, 2; and.b32 t, t, 0x03C003C0; mul.lo.u32 t, t, 0x41; and.b32 $0, t, 0x81C081C0;}",
    "{.reg .b32 t, u; shr.b32 t, $1, 6; and.b32 t, t, 0x01C001C0; and.b32 u, $1, 0x80008000; or.b32 $0, t, u;}",
))


@triton.jit
def _class_weights(quarters, scales, c: tl.constexpr, dtype: tl.constexpr, FAST: tl.constexpr):
    """Weights of class ``c`` (k = 4q + c) of int16 ``quarters[BLOCK_N, Q]`` with their E8M0 ``scales`` (uint8,
    same shape), in ``dtype``: times 2^-64 on the FAST path (bf16, inline PTX), exact otherwise."""
    if FAST:
        code = tl.inline_asm_elementwise(_E2M1_BF16X2[c], "=r,r", [quarters], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
        factor = ((scales.to(tl.int16) + (126 - FAST_SHIFT)) << 7).to(tl.bfloat16, bitcast=True)  # 2^(s-1-64)
        w = code * factor
    else:
        nibble = quarters >> (4 * c)
        bits = ((nibble & 7) << 9) | ((nibble & 8) << 12)  # fp16 code * 2^-14 (the sign lands on bit 15)
        multiplier = ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 113)
        w = (bits.to(tl.float16, bitcast=True).to(tl.float32) * multiplier).to(dtype)
    return w


@triton.jit
def _x_classes_in_place(x_cols, k0, k_end, row_ok, Q: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr):
    """The four classes ``x[:, 4q + c]`` (c = 0..3) of the K tile at quarter ``k0``, each ``[Q, BLOCK_M]``, split
    in registers from one contiguous load of ``x`` (``x_cols``: the rows' starts, ``[1, BLOCK_M]``)."""
    kk = tl.max_contiguous(tl.multiple_of(4 * k0 + tl.arange(0, 4 * Q), 4 * Q), 4 * Q)
    if EVEN_K:
        mask = row_ok[None, :] & (k0 < k_end)
    else:
        mask = (kk < 4 * k_end)[:, None] & row_ok[None, :]
    x = tl.load(x_cols + kk[:, None], mask=mask, other=0.0)  # [4Q, BLOCK_M]
    x = tl.permute(tl.reshape(x, (Q, 2, 2, BLOCK_M)), (0, 3, 1, 2))  # [q, row, a, b]: k = 4q + 2a + b
    even, odd = tl.split(x)  # b = 0, 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _fused_moe_kernel(
    x_ptr, x_row_ptr, w_ptr, s_ptr, y_ptr, padded_rows_ptr, block_expert_ptr,
    N, K_QUARTERS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    GATHER: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr,
    X_COPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0) * BLOCK_M)  # a strided view: each block's first position
    if expert < 0:
        return
    Q: tl.constexpr = BLOCK_K // 4  # quarters (int16) per row of a K tile
    G: tl.constexpr = BLOCK_K // 32  # scale groups per row of a K tile
    rows = tl.load(padded_rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # sorted row, -1 = pad
    row_ok = rows >= 0
    if GATHER:
        x_rows = tl.load(x_row_ptr + rows, mask=row_ok, other=0)  # the token of each sorted row
    else:
        x_rows = rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    split = tl.cdiv(K_QUARTERS, SPLIT_K * Q) * Q
    k_begin = tl.program_id(2) * split
    k_end = tl.minimum(k_begin + split, K_QUARTERS)

    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    s_rows = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn
    x_cols = x_ptr + x_rows.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, Q):
        kq = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, Q), Q), Q)
        kg = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, G), G), G)
        if EVEN_K:  # a mask constant along k keeps the loads vectors
            w_mask = n_ok[:, None] & (k0 < k_end)
            s_mask = w_mask
            x_mask = row_ok[None, :] & (k0 < k_end)
        else:
            w_mask = n_ok[:, None] & (kq < k_end)[None, :]
            s_mask = n_ok[:, None] & (kg < tl.cdiv(k_end, 8))[None, :]
            x_mask = (kq < k_end)[:, None] & row_ok[None, :]
        quarters = tl.load(w_rows + kq[None, :], mask=w_mask, other=0)
        group_scales = tl.load(s_rows + kg[None, :], mask=s_mask, other=0)
        scales = tl.reshape(tl.broadcast_to(group_scales[:, :, None], (BLOCK_N, G, 8)), (BLOCK_N, Q))
        if not X_COPY:
            x_classes = _x_classes_in_place(x_cols, k0, k_end, row_ok, Q, BLOCK_M, EVEN_K)
        for c in tl.static_range(4):
            if X_COPY:  # class-major copy [rows, 4, K/4]
                x = tl.load(x_cols + c * K_QUARTERS + kq[:, None], mask=x_mask, other=0.0)
            else:
                x = x_classes[c]
            w = _class_weights(quarters, scales, c, x_ptr.dtype.element_ty, FAST)
            if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; fp32 of the same bf16 values is exact
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
            else:
                acc = tl.dot(w, x, acc)
    if FAST:
        acc = acc * (2.0 ** FAST_SHIFT)
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    y_mask = n_ok[:, None] & row_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
