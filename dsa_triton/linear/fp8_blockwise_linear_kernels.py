"""Triton kernel of the blockwise-FP8 linear ``y[M, N] = x[M, K] @ (weight[N, K] * block scales).T``.

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``; programs are ordered in groups of ``GROUP_M`` row
tiles so that consecutive programs share weight tiles in L2. Along K, each ``BLOCK_K`` step (a divisor of 128)
lies in one scale block, so a step is one ``tl.dot`` of ``x`` by the e4m3 weights converted to the dot's dtype
(exact: every e4m3 value is a bf16, fp16 and fp32 value) and one multiply of the fp32 partial product by the
scales of its ``BLOCK_N`` columns. ``DOT_F32`` converts both operands to fp32 (fp32 activations, and the
interpreter, whose bf16 ``tl.dot`` is wrong); its dot is IEEE fp32, not TF32.
"""
from __future__ import annotations

import triton
import triton.language as tl

SCALE_BLOCK = tl.constexpr(128)  # weight_scale_inv holds one scale per 128 x 128 block of the weight


@triton.jit
def fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    s_cols = s_ptr + (offs_n // SCALE_BLOCK) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        scale = tl.load(s_cols + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * scale[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
