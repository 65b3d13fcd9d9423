"""Grouped expert GEMM oracle: one expert at a time on weights dequantized by the MXFP4 reference, in fp32."""
from __future__ import annotations

import torch

from .formats import row_major
from .mxfp4_reference import mxfp4_dequantize_torch
from .permute import ExpertSort


def grouped_gemm_torch(x_rows: torch.Tensor, expert_offsets: torch.Tensor, blocks: torch.Tensor,
                       scales: torch.Tensor) -> torch.Tensor:
    """``x_rows[M, K]`` sorted by expert (CSR ``expert_offsets[E + 1]``), MXFP4 ``blocks[E, N, K/32, 16]`` /
    ``scales[E, N, K/32]`` -> ``y[M, N]`` fp32 with ``y[r] = x_rows[r] @ W[e].T`` for the expert ``e`` of row r.

    Only experts that got rows are dequantized (one at a time, so memory stays at one expert).
    """
    y = torch.zeros(x_rows.shape[0], blocks.shape[1], dtype=torch.float32, device=x_rows.device)
    bounds = expert_offsets.tolist()
    for e, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            w = mxfp4_dequantize_torch(blocks[e], scales[e], torch.float32)
            y[start:end] = x_rows[start:end].float() @ w.t()
    return y


def fused_moe_gemm_torch(x: torch.Tensor, sort: ExpertSort, blocks: torch.Tensor, scales: torch.Tensor,
                         gather_tokens: bool = True) -> torch.Tensor:
    """The oracle of :func:`.fused_moe_gemm.fused_moe_gemm` (``x`` in rows or class-major): ``y_sorted[M, N]`` fp32."""
    x = row_major(x) if x.dim() == 3 else x
    rows = x[sort.sorted_token.long()] if gather_tokens else x
    return grouped_gemm_torch(rows, sort.expert_offsets, blocks, scales)
