"""Pure-PyTorch oracle of DeepSeek-V4's indexer logits (:func:`dsa_triton.v4_indexer_logits`), as transformers'
``DeepseekV4IndexerScorer`` computes them (queries and keys cast to fp32, relu, times the softmax scale, times the
head weights, summed over the heads); the runner's reference mode runs it (one oracle)."""
from __future__ import annotations

import torch

from .compress_entries_reference import paged_slots


def v4_indexer_logits_torch(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, limits: torch.Tensor,
                            block_table: torch.Tensor, softmax_scale: float, num_cols: int, *,
                            cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[T, num_cols]`` fp32 (``-inf`` outside ``[0, limits[t])``); arguments as
    :func:`dsa_triton.v4_indexer_logits` takes them."""
    T, P = q.shape[0], k.shape[1]
    cu = [0, T] if cu_seqlens_q is None else cu_seqlens_q.tolist()
    out = torch.full((T, num_cols), float("-inf"), dtype=torch.float32, device=q.device)
    keys_flat = k.reshape(-1, k.shape[-1])
    for b in range(len(cu) - 1):
        r0, r1 = cu[b], cu[b + 1]
        n = min(num_cols, int(limits[r0:r1].max())) if r1 > r0 else 0
        if n <= 0:
            continue
        keys = keys_flat[paged_slots(block_table[b], torch.arange(n, device=q.device), P)]
        scores = torch.zeros(r1 - r0, n, dtype=torch.float32, device=q.device)
        for h in range(q.shape[1]):  # one head at a time: [rows, n] live, not [rows, heads, n]
            head = torch.relu(q[r0:r1, h].float() @ keys.float().T) * softmax_scale
            scores += head * weights[r0:r1, h, None]
        out[r0:r1, :n] = scores.masked_fill(torch.arange(n, device=q.device) >= limits[r0:r1, None], float("-inf"))
    return out
