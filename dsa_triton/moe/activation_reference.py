"""SwiGLU oracle and the class-major activation layout of the fused MXFP4 GEMM, in plain torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def class_major(x: torch.Tensor) -> torch.Tensor:
    """``x[M, K]`` -> ``[M, 4, K/4]`` contiguous with ``out[m, c, q] = x[m, 4q + c]``: the layout in which the fused
    MXFP4 GEMM reads each nibble class of a K tile as one contiguous run."""
    return x.view(x.shape[0], x.shape[1] // 4, 4).transpose(1, 2).contiguous()


def row_major(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`class_major`: ``[M, 4, K/4]`` -> ``[M, K]``."""
    return x.transpose(1, 2).reshape(x.shape[0], -1)


def swiglu_torch(h: torch.Tensor, dtype: torch.dtype | None = None, class_major_out: bool = False) -> torch.Tensor:
    """``h[M, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[M, I]`` (``[M, 4, I/4]`` when ``class_major_out``) in
    ``dtype`` (None: ``h``'s), computed in fp32."""
    gate, up = h.to(torch.float32).chunk(2, dim=-1)
    y = F.silu(gate).mul_(up).to(h.dtype if dtype is None else dtype)
    return class_major(y) if class_major_out else y
