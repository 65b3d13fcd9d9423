"""Oracle of the prefill (workspace) grouped GEMM: dynamic FP8 quantization of the activations, then the
exact product with the MXFP4 weights, in pure PyTorch.

Activations are quantized per row (token) to e4m3 with a power-of-two scale ``2^e``, ``e`` the smallest
integer with ``amax <= 448 * 2^e`` (at least -126; all-zero rows take -126), elements rounded to nearest
even. A power of two keeps the scaling exact, so the kernel and this oracle agree bit for bit. A row holding NaN
or inf has no scale: it takes scale NaN (and elements 0), so its products are NaN rather than finite. One scale per
row rather than per 128-k group: e4m3 is a float format, so a row scale costs only elements below 2^-15 of
the row's largest (their share of a dot product is under ~1e-4), and the GEMM applies it once after its K loop
(rowwise FP8 in vLLM-style stacks does the same). The weights keep their per-(row, 128-k group) scales.
"""
from __future__ import annotations

import torch

from .fused_moe_gemm_reference import grouped_gemm_torch
from .formats import E4M3_MAX, exp2_exact

MIN_EXPONENT = -126


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[M, K]`` float -> ``(q float8_e4m3fn [M, K], scale fp32 [M])`` with ``x ~= q * scale[:, None]``.

    A row holding NaN or inf gets scale NaN and elements 0 (so every product of it is NaN)."""
    xd = x.double()
    bad = ~torch.isfinite(xd).all(-1) if x.shape[1] else torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    xd = torch.where(bad[:, None], 0.0, xd)
    amax = xd.abs().amax(-1) if x.shape[1] else xd.new_zeros(x.shape[0])
    _, f = torch.frexp(amax)  # amax = m * 2^f, m in [0.5, 1)
    e = f - 9 + (amax > E4M3_MAX * exp2_exact(f - 9)).to(f.dtype)
    e = torch.where(amax > 0, e, MIN_EXPONENT).clamp(min=MIN_EXPONENT)
    scale = exp2_exact(e)
    q = (xd / scale[:, None]).float().to(torch.float8_e4m3fn)
    return q, torch.where(bad, torch.nan, scale.float())


def dequantize_rows_fp8_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q[M, K]`` e4m3 times its row scales ``[M]`` -> fp32 ``[M, K]`` (exact)."""
    return q.float() * scale[:, None]


def fp8_grouped_gemm_torch(x_sorted: torch.Tensor, expert_offsets: torch.Tensor, blocks: torch.Tensor,
                           scales: torch.Tensor) -> torch.Tensor:
    """``y_sorted[M, N]`` fp32: rows of expert ``e`` (``expert_offsets[e] : expert_offsets[e + 1]``) times
    ``W_e^T`` from MXFP4 ``blocks[E, N, K/32, 16]`` / ``scales[E, N, K/32]``, with ``x`` first taken through
    :func:`quantize_rows_fp8_torch` (K of ``x`` may stop short of the weights' padded K); rows outside every
    expert are 0."""
    k_w = blocks.shape[2] * 32
    xd = dequantize_rows_fp8_torch(*quantize_rows_fp8_torch(x_sorted))
    return grouped_gemm_torch(torch.nn.functional.pad(xd, (0, k_w - xd.shape[1])), expert_offsets, blocks, scales)
