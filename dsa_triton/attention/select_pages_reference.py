"""Pure-PyTorch oracle for the page selection of the block-level indexer path."""
from __future__ import annotations

import torch


def select_pages_torch(bounds: torch.Tensor, n_select: int) -> torch.Tensor:
    """The ``n_select`` pages with the highest bounds per row, ``[T, n_select]`` int32 ascending, -1 after
    the last page with a finite bound (ties in any order). NaN ranks as ``-inf``: never taken."""
    T, n_pages = bounds.shape
    k = min(n_select, n_pages)
    top, idx = bounds.masked_fill(bounds.isnan(), float("-inf")).topk(k, dim=1, sorted=False)
    idx = idx.where(top > float("-inf"), n_pages).sort(dim=1).values  # invalid pages sort last
    pages = torch.full((T, n_select), -1, dtype=torch.int32, device=bounds.device)
    pages[:, :k] = idx.where(idx < n_pages, -1).int()
    return pages
