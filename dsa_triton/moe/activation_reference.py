"""SwiGLU oracle and the class-major activation layout of the fused MXFP4 GEMM, in plain torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import class_major


def swiglu_torch(h: torch.Tensor, dtype: torch.dtype | None = None, class_major_out: bool = False) -> torch.Tensor:
    """``h[M, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[M, I]`` (``[M, 4, I/4]`` when ``class_major_out``) in
    ``dtype`` (None: ``h``'s), computed in fp32."""
    gate, up = h.to(torch.float32).chunk(2, dim=-1)
    y = F.silu(gate).mul_(up).to(h.dtype if dtype is None else dtype)
    return class_major(y) if class_major_out else y
