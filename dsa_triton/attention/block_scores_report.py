"""Report ``block_scores_recall``: recall of the exact top-k through the block-level path, and its time
against the token-level path (``python -m dsa_triton.bench --kernels block_scores_recall``).

Synthetic keys with locality: each sequence has a direction ``u``; a few *hot* pages hold keys
``alpha * u + noise`` (alpha graded across pages and tokens), every other key is noise, and the queries
lean towards ``u``. The exact top-k then sits mostly in the hot pages, as DSA's indexer scores do.
"""
from __future__ import annotations

import torch
import triton

from .. import registry
from ..harness import time_us
from .block_scores import block_indexer_logits, block_scores
from .cache import PagedCache
from .cache_reference import fp8_quantize_rows
from .indexer import indexer_logits

FRACTIONS = (8, 16, 32)  # 1/8, 1/16, 1/32 of the pages selected


def local_keys_problem(B: int, L: int, P: int, H: int, DK: int, hot_pages: int, device, seed: int = 0) -> dict:
    """A cache of ``B`` sequences of ``L`` keys with ``hot_pages`` hot pages each, one decode row per sequence."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_pages = triton.cdiv(L, P)
    cache = PagedCache(B * n_pages, P, B, n_pages, kv_dim=0, index_dim=DK, device=device)
    u = torch.randn(B, DK, device=device, generator=g)
    u *= DK**0.5 / u.norm(dim=1, keepdim=True)
    for b in range(B):
        alpha = torch.zeros(n_pages, device=device)
        hot = torch.randperm(n_pages, device=device, generator=g)[:hot_pages]
        alpha[hot] = 1.0 + torch.rand(hot_pages, device=device, generator=g)
        token_alpha = alpha.repeat_interleave(P)[:L] * (0.5 + 0.5 * torch.rand(L, device=device, generator=g))
        keys = torch.randn(L, DK, device=device, generator=g) + token_alpha[:, None] * u[b]
        cache.append([b], [L], None, keys)
    q8, q_scale = fp8_quantize_rows(u[:, None, :] + torch.randn(B, H, DK, device=device, generator=g))
    w = (torch.randn(B, H, device=device, generator=g) * 0.5 + 1.0) * q_scale * (H * DK) ** -0.5
    return {"cache": cache, "q": q8, "weights": w, "limits": cache.seq_lens.clone(),
            "cu_seqlens_q": torch.arange(B + 1, dtype=torch.int32, device=device)}


def _topk_positions(logits: torch.Tensor, positions: torch.Tensor | None, k: int) -> torch.Tensor:
    idx = logits.topk(k, dim=1).indices
    return idx if positions is None else positions.gather(1, idx).long()


def report(device, ceilings) -> list[dict]:
    gpu = ceilings is not None
    B, L, P, H, DK, k = (64, 131072, 64, 64, 128, 2048) if gpu else (2, 2048, 16, 8, 32, 32)
    n_pages = triton.cdiv(L, P)
    prob = local_keys_problem(B, L, P, H, DK, hot_pages=max(2, n_pages // 64), device=device)
    cache, q, w, limits, cu = (prob[n] for n in ("cache", "q", "weights", "limits", "cu_seqlens_q"))

    def token_level():
        return indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=cache.block_table,
                              seq_lens=cache.seq_lens)

    def block_level(n_select):
        return block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table,
                                    cache.seq_lens, limits, n_select, cu_seqlens_q=cu)

    dense = token_level()
    exact = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, _topk_positions(dense, None, k), True)
    rows = []
    for frac in FRACTIONS:
        n_select = max(1, n_pages // frac)
        logits, positions = block_level(n_select)
        found = _topk_positions(logits, positions, k)
        hits = (exact.gather(1, found.clamp_min(0)) & (found >= 0)).sum(1).float() / k
        rows.append({"measure": "recall", "pages_selected": f"1/{frac} ({n_select} of {n_pages})", "k": k,
                     "recall_mean": hits.mean().item(), "recall_min": hits.min().item()})

    n_select = max(1, n_pages // 32)
    token_us = time_us(token_level, device)
    block_us = time_us(lambda: block_level(n_select), device)
    bounds_us = time_us(lambda: block_scores(q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens,
                                             limits, P, cu_seqlens_q=cu), device)
    token_topk_us = time_us(lambda: token_level().topk(k, dim=1), device)
    block_topk_us = time_us(lambda: block_level(n_select)[0].topk(k, dim=1), device)
    shape = f"B={B},L={L},P={P},H={H},DK={DK}"
    rows += [
        {"measure": "time", "path": "token-level logits [T, L]", "shape": shape, "us": token_us,
         "out_MB": B * L * 4 / 1e6},
        {"measure": "time", "path": "block-level 1/32 (bounds + pages + logits)", "shape": shape, "us": block_us,
         "speedup": token_us / block_us, "bounds_us": bounds_us, "out_MB": B * (n_pages * 4 + n_select * P * 8) / 1e6},
        {"measure": "time", "path": f"token-level + torch.topk({k})", "shape": shape, "us": token_topk_us},
        {"measure": "time", "path": f"block-level 1/32 + torch.topk({k})", "shape": shape, "us": block_topk_us,
         "speedup": token_topk_us / block_topk_us},
    ]
    return rows


registry.register_report("block_scores_recall", report)
