"""Pure-PyTorch oracle for the page selection of the block-level indexer path."""
from __future__ import annotations

import torch

from .topk_indices_reference import NEG_INF_KEY, position_keys, sort_keys


def select_pages_torch(bounds: torch.Tensor, n_select: int) -> torch.Tensor:
    """The ``n_select`` pages with the highest bounds per row, ``[T, n_select]`` int32 ascending, -1 after
    the last page with a finite bound; among equal bounds the lower page first (the kernel's order of the fp32 sort
    keys: -0.0 below +0.0). NaN ranks as ``-inf``: never taken."""
    T, n_pages = bounds.shape
    k = min(n_select, n_pages)
    top = torch.topk(position_keys(sort_keys(bounds)), k, dim=1, sorted=False)
    idx = top.indices.where((top.values >> 32) > NEG_INF_KEY, n_pages).sort(dim=1).values  # invalid pages sort last
    pages = torch.full((T, n_select), -1, dtype=torch.int32, device=bounds.device)
    pages[:, :k] = idx.where(idx < n_pages, -1).int()
    return pages
