"""Pure-PyTorch oracle of :func:`~dsa_triton.fp8_blockwise_linear` (weight format: :mod:`.formats`)."""
from __future__ import annotations

import torch

from .formats import dequantize_fp8_blockwise


def fp8_blockwise_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """``x[M, K] @ dequantize(weight, weight_scale_inv).T`` in fp32 -> ``y[M, N]`` in ``x``'s dtype."""
    return (x.float() @ dequantize_fp8_blockwise(weight, weight_scale_inv).t()).to(x.dtype)
