"""MXFP4 (OCP MX, the gpt-oss checkpoint layout) in pure PyTorch: the oracle for the Triton kernels.

Layout, for weights ``w[..., N, K]`` with K a multiple of 32 (callers pad K with zeros: :func:`pad_k`):

- ``blocks`` uint8 ``[..., N, K/32, 16]``: 32 E2M1 codes per block, two per byte, low nibble = even k;
- ``scales`` uint8 ``[..., N, K/32]``: E8M0, the block's value is ``2^(s - 127)``; 0xFF is NaN and rejected.

E2M1 codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same negated (the sign is the sign of
the input, so a negative input that rounds to zero keeps code 8). Quantization: shared exponent
``floor(log2(amax)) - 2`` (clamped at -127, so tiny blocks get scale 0), elements round to nearest
even and saturate at 6. Everything here is exact in float64, independent of the kernels' bit tricks.
"""
from __future__ import annotations

import torch

from .formats import BLOCK, E2M1_THRESHOLDS, e2m1_lut, exp2_exact, validate_mxfp4


def e2m1_codes_torch(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 0..15) of ``x`` already divided by the block scale: round to nearest even, saturate at 6."""
    a = x.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t, tie_up in E2M1_THRESHOLDS:
        code += (a >= t if tie_up else a > t).to(torch.uint8)
    return code + 8 * (x < 0).to(torch.uint8)


def mxfp4_quantize_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[..., N, K]`` (any float dtype, finite, K % 32 == 0) -> ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])``."""
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"w: expected a float tensor [..., N, K], got {w.dtype} of shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"w: K = {w.shape[-1]} must be a multiple of {BLOCK} (pad with zeros: pad_k)")
    if not torch.isfinite(w).all():
        raise ValueError("w: holds NaN or inf, which MXFP4 cannot represent")
    x = w.double().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1)
    _, e2 = torch.frexp(amax)  # amax = m * 2^e2, m in [0.5, 1): floor(log2(amax)) = e2 - 1
    exponent = torch.where(amax > 0, e2 - 1 - 2, -127).clamp(-127, 127)
    codes = e2m1_codes_torch(x * exp2_exact(-exponent).unsqueeze(-1))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_dequantize_torch(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks[..., N, K/32, 16]``, ``scales[..., N, K/32]`` (uint8) -> ``w[..., N, K]`` in ``dtype``.

    Exact in float64, rounded once to ``dtype`` (values beyond its range become inf or flush to zero).
    """
    validate_mxfp4("mxfp4", blocks, scales)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)  # [..., N, K/32, 32]
    values = e2m1_lut(device=blocks.device)[codes.long()] * exp2_exact(scales.to(torch.int64) - 127).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


