"""MXFP4 -> FP8 (e4m3fn) with one fp32 scale per (row, 128-k group), in pure PyTorch: the conversion's oracle.

Per group of four 32-blocks the reference exponent is ``ref = max(s) - 6``, the lowest that keeps the
largest E2M1 value in range (6 * 2^6 = 384 <= 448, the e4m3 maximum). Block values become
``e2m1 * 2^(s - ref)`` in e4m3 and the group scale is ``2^(ref - 127)``, so ``fp8 * scale`` is the MXFP4 value.
e4m3 reaches down to 2^-9, so a block roughly 14 binades below its group's top loses low bits or flushes
to zero: such blocks are *unfit* and counted (a block is unfit when any of its 32 values differs after
the round trip), never hidden.
"""
from __future__ import annotations

import torch

from .formats import BLOCK, BLOCKS_PER_GROUP, E2M1_HEADROOM, GROUP, exp2_exact, validate_mxfp4
from .mxfp4_reference import mxfp4_dequantize_torch


def group_reference_exponent(scales: torch.Tensor) -> torch.Tensor:
    """``scales[..., N, K/32]`` uint8 -> ``ref[..., N, ceil(K/128)]`` int32: each group's max scale minus 6."""
    s = scales.to(torch.int32)
    s = torch.nn.functional.pad(s, (0, -s.shape[-1] % BLOCKS_PER_GROUP))  # a missing block has scale 0
    return s.unflatten(-1, (-1, BLOCKS_PER_GROUP)).amax(-1) - E2M1_HEADROOM


def fp8_conversion_torch(blocks: torch.Tensor, scales: torch.Tensor, name: str = "mxfp4"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w float8_e4m3fn [..., N, K], scale fp32 [..., N, ceil(K/128)], lost bool [..., N, K/32])``: lost marks unfit blocks."""
    validate_mxfp4(name, blocks, scales)
    k = blocks.shape[-2] * BLOCK
    group_scale = exp2_exact(group_reference_exponent(scales) - 127)  # [..., N, G]
    per_k = group_scale.repeat_interleave(GROUP, dim=-1)[..., :k]
    exact = mxfp4_dequantize_torch(blocks, scales, torch.float64)
    w_fp8 = (exact / per_k).float().to(torch.float8_e4m3fn)
    lost = (w_fp8.double() * per_k != exact).unflatten(-1, (-1, BLOCK)).any(-1)
    return w_fp8, group_scale.float(), lost


def mxfp4_to_fp8_torch(blocks: torch.Tensor, scales: torch.Tensor, name: str = "mxfp4"
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``blocks[..., N, K/32, 16]``, ``scales[..., N, K/32]`` -> ``(w float8_e4m3fn [..., N, K], scale fp32 [..., N, ceil(K/128)], n_unfit)``."""
    w_fp8, group_scale, lost = fp8_conversion_torch(blocks, scales, name)
    return w_fp8, group_scale, int(lost.sum())
