"""DeepSeek-V3's blockwise-FP8 weight format, which the linear op and its reference both read.

A weight ``W[N, K]`` is stored as float8_e4m3fn ``weight[N, K]`` with one fp32 ``weight_scale_inv`` per block of
``BLOCK x BLOCK`` (128 x 128) elements, ``[ceil(N / 128), ceil(K / 128)]``; the value is
``weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (the name says "inverse": it undoes the division by the
scale at quantization).
"""
from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def expand_block_scales(scale_inv: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """``[ceil(N/128), ceil(K/128)]`` -> ``[N, K]`` fp32: each block's scale repeated over its elements."""
    return scale_inv.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]


def dequantize_fp8_blockwise(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 ``weight[N, K]`` times its block scales -> ``[N, K]`` in ``dtype`` (the product is taken in fp32)."""
    N, K = weight.shape
    return (weight.float() * expand_block_scales(weight_scale_inv, N, K)).to(dtype)


def quantize_fp8_blockwise(w: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[N, K]`` float -> ``(weight[N, K] e4m3, weight_scale_inv[ceil(N/128), ceil(K/128)] fp32)``.

    Each block's scale maps its absolute maximum to 448 (e4m3's largest value); ``power_of_two`` rounds the scale
    up to a power of two (DeepSeek-V3.2's ``ue8m0`` scale format), so the dequantized weights are exact in bf16.
    An all-zero block gets scale 1.
    """
    N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    weight = (w.float() / expand_block_scales(scale, N, K)).to(torch.float8_e4m3fn)
    return weight, scale
