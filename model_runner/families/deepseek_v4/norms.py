"""DeepSeek-V4's RMS norms as transformers computes them: in fp32, the fp32 weight applied before the cast back
(:func:`rms_norm`: the one of the compressors' oracle, :mod:`dsa_triton.attention.compress_entries_reference`)."""
from __future__ import annotations

import torch

from dsa_triton.attention.compress_entries_reference import rms_norm  # noqa: F401  (re-exported: one definition)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim (the scale computed in fp32, applied in ``x``'s dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
