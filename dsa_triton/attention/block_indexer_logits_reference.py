"""Pure-PyTorch oracle for block-level (two-level) indexer scoring.

A page's bound for query row ``t``: per head ``ub_h = q+ . pmax + q- . pmin`` (at least ``q_h . k`` for
every key of the page) and ``lb_h = q+ . pmin + q- . pmax`` (at most), then
``sum_h max(w_h, 0) relu(ub_h) + min(w_h, 0) relu(lb_h)`` is at least the page's best token score.
"""
from __future__ import annotations

import torch

from ..hostmath import cdiv
from .formats import dequantize_rows
from .append_tokens_reference import page_extremes
from .indexer_logits_reference import exact_fp8_matmul


def page_summaries_torch(k: torch.Tensor, k_scale: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """``[num_pages, 2, DK]`` fp32 (max, min) of each used page's dequantized keys; NaN for unused pages.

    ``chunk`` pages at a time, so the dequantized temporaries stay bounded.
    """
    num_pages, P, DK = k.shape
    fill = torch.zeros(num_pages, dtype=torch.long, device=k.device)  # used slots per page
    lens = seq_lens.long()[: block_table.shape[0]]
    per_page = (lens[:, None] - torch.arange(block_table.shape[1], device=k.device) * P).clamp(0, P)
    fill[block_table.long()[per_page > 0]] = per_page[per_page > 0]
    out = torch.full((num_pages, 2, DK), float("nan"), device=k.device)
    for c in range(0, num_pages, chunk):
        pmax, pmin = page_extremes(dequantize_rows(k[c:c + chunk], k_scale[c:c + chunk]), fill[c:c + chunk])
        page_used = fill[c:c + chunk, None] > 0
        out[c:c + chunk, 0] = pmax.where(page_used, float("nan"))
        out[c:c + chunk, 1] = pmin.where(page_used, float("nan"))
    return out


def page_bounds_torch(q: torch.Tensor, weights: torch.Tensor, pmax: torch.Tensor, pmin: torch.Tensor,
                      block_table: torch.Tensor, limits: torch.Tensor, page_size: int, num_cols: int,
                      cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """Upper bounds ``[T, num_cols]`` fp32 of each logical page's best score; ``-inf`` for pages at or
    past ``limits[t]``. Shapes as in :func:`dsa_triton.block_scores`."""
    T = q.shape[0]
    cu = [0, T] if cu_seqlens_q is None else cu_seqlens_q.tolist()
    out = torch.full((T, num_cols), float("-inf"), device=q.device)
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            n = min(num_cols, cdiv(int(limits[t]), page_size))
            pages = block_table[b, :n].long()
            mx, mn = pmax[pages].float(), pmin[pages].float()  # [n, DK]
            qf = q[t].float()
            qp, qn = qf.clamp_min(0), qf.clamp_max(0)
            with exact_fp8_matmul():
                ub, lb = qp @ mx.t() + qn @ mn.t(), qp @ mn.t() + qn @ mx.t()  # [H, n]
            w = weights[t].float()[:, None]
            out[t, :n] = (w.clamp_min(0) * ub.relu() + w.clamp_max(0) * lb.relu()).sum(0)
    return out


def gather_selected_torch(dense: torch.Tensor, pages: torch.Tensor, page_size: int,
                          limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and logical positions ``[T, n_sel * P]`` of the selected pages, read off dense logits."""
    pos = (pages.long()[:, :, None] * page_size + torch.arange(page_size, device=pages.device)).flatten(1)
    valid = (pages.long()[:, :, None] >= 0).expand(-1, -1, page_size).flatten(1) & (pos < limits.long()[:, None])
    logits = dense.gather(1, pos.where(valid, 0).clamp_max(max(dense.shape[1] - 1, 0))) if dense.shape[1] else \
        torch.zeros(pos.shape, device=dense.device)
    return logits.where(valid, float("-inf")), pos.where(valid, -1).int()
