"""Rotary position embedding as Hugging Face's DeepSeek-V3.2 computes it: plain or YaRN frequencies, cos / sin
times the YaRN attention factor, applied to pairs (2i, 2i + 1) in MLA (``interleaved``) and to (i, i + d/2) in the
indexer (NeoX layout, FACTS.md). Either way the output holds the rotated first members, then the second members
(Hugging Face's layout; a fixed permutation of the rope dims, the same for queries and keys, so every q . k is
unchanged)."""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """``[dim / 2]`` fp32 inverse frequencies (``transformers.modeling_rope_utils``, default and yarn)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs
    factor, original = rope.factor, rope.original_max_position_embeddings
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations):  # the dim whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: divide it by factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class Rotary:
    """cos / sin of positions for ``dim`` rope dims, then rotation of ``x[T, ..., dim]``."""

    def __init__(self, rope: RopeConfig, dim: int, device=None):
        """``device``: where the frequencies live (so that ``tables`` copies nothing: CUDA-graph safe)."""
        self.inv_freq, self.scale = inverse_frequencies(rope, dim).to(device), rope.attention_factor_value

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions[T]`` -> cos, sin ``[T, dim / 2]`` fp32 (times the attention factor)."""
        angle = positions.float()[:, None] * self.inv_freq.to(positions.device)
        return angle.cos() * self.scale, angle.sin() * self.scale

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], interleaved: bool) -> torch.Tensor:
        cos, sin = (t.to(x.dtype).view(x.shape[0], *([1] * (x.dim() - 2)), -1) for t in tables)
        d = x.shape[-1]
        a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2:])
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
