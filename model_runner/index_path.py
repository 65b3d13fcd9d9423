"""Which indexer path a step takes, per phase: "token" (logits over every cached position, then top-k: DeepSeek's
selection, exact) or "block" (``dt.block_indexer_logits``: page upper bounds from the page summaries, the
:func:`pages_to_select` best pages per token, logits inside them, then top-k among those: fewer bytes read at long
contexts, and the top-k runs over ``n_select * P`` columns instead of the context; it may miss a top-k token in a
page whose bound ranks low). "auto" asks the op which path serves the step's shape (:func:`dsa_triton.indexer_path`:
the path its tuned launch config names, which a study picks by timing both; the token path where nothing is tuned,
and in prefill, which the block path does not serve).

A step whose sequences have at most one new token each is "decode", any other "prefill" (a mixed step runs the
prefill kernels). The block path needs the FP8 indexer cache (the summaries live there); when the selected pages
would cover the whole context it is the token path, which the step then takes.
"""
from __future__ import annotations

import torch

from dsa_triton import indexer_path
from dsa_triton.hostmath import cdiv

PATHS = ("token", "block", "auto")
PAGES_PER_TOPK = 2  # the block path scores the pages of twice top-k tokens


def pages_to_select(top_k: int, page_size: int) -> int:
    return PAGES_PER_TOPK * cdiv(top_k, page_size)


def check_paths(paths: dict[str, str]) -> dict[str, str]:
    """``{"decode": path, "prefill": path}`` with every path one of :data:`PATHS` (a ValueError names it)."""
    if set(paths) != {"decode", "prefill"} or any(p not in PATHS for p in paths.values()):
        raise ValueError(f"indexer_path: need a path of {PATHS} for each of decode and prefill, got {paths!r}")
    return dict(paths)


class PathChoice:
    """The path of each step, from the settings per phase (host work only, cached per shape by the op's launch
    config: CUDA-graph safe)."""

    def __init__(self, paths: dict[str, str] | None = None):
        self.paths = check_paths(paths or {"decode": "token", "prefill": "token"})

    def __call__(self, batch, page_size: int, top_k: int, heads: int, head_dim: int, device) -> str:
        phase = "decode" if batch.max_q == 1 else "prefill"
        path = self.paths[phase]
        n_select = pages_to_select(top_k, page_size)
        if path == "token" or n_select >= cdiv(batch.num_cols, page_size):
            return "token"
        if path == "block":
            return "block"
        return indexer_path(phase, batch.cu_seqlens.shape[0] - 1, batch.max_q, batch.num_cols, page_size, heads,
                            head_dim, device)


def positions_to_slots(columns: torch.Tensor, positions: torch.Tensor, batch, page_size: int) -> torch.Tensor:
    """Top-k ``columns[T, k]`` (-1: none) of the block path's ``positions[T, n_select * P]`` (logical, -1: none)
    -> physical cache slots ``[T, k]`` int32 through each row's block-table row (-1 where none). Device work only."""
    pos = positions.gather(1, columns.clamp_min(0).long()).long()
    valid = (columns >= 0) & (pos >= 0)
    pos = pos.clamp_min(0)
    table = batch.block_table
    rows = batch.row_to_seq.long()[:, None] * table.shape[1] + pos // page_size
    slots = table.reshape(-1)[rows].long() * page_size + pos % page_size
    return slots.where(valid, -1).int()
