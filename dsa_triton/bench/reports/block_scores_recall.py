"""Report ``block_scores_recall``: recall of the exact top-k through the block-level path, and its time
against the token-level path (``python -m dsa_triton.bench --kernels block_scores_recall``).

Synthetic keys with locality: each sequence has a direction ``u``; a few *hot* pages hold keys
``alpha * u + noise`` (alpha graded across pages and tokens), every other key is noise, and the queries
lean towards ``u``. The exact top-k then sits mostly in the hot pages, as DSA's indexer scores do.
"""
from __future__ import annotations

import torch
import triton

from dsa_triton.bench.harness import graph_us, time_us
from dsa_triton.attention.block_indexer_logits import block_indexer_logits, block_scores, selected_page_logits
from dsa_triton.attention.cache import PagedCache
from dsa_triton.attention.formats import fp8_quantize_rows
from dsa_triton.attention.indexer_logits import indexer_logits
from dsa_triton.attention.select_pages import select_pages

FRACTIONS = (8, 16, 32)  # 1/8, 1/16, 1/32 of the pages selected


def local_keys_problem(B: int, L: int, P: int, H: int, DK: int, hot_pages: int, device, strength: float = 1.0,
                       seed: int = 0) -> dict:
    """A cache of ``B`` sequences of ``L`` keys with ``hot_pages`` hot pages each (hot keys lean towards
    ``u`` by ``strength * (0.5 .. 2)``), one decode row per sequence."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_pages = triton.cdiv(L, P)
    cache = PagedCache(B * n_pages, P, B, n_pages, kv_dim=0, index_dim=DK, device=device)
    u = torch.randn(B, DK, device=device, generator=g)
    u *= DK**0.5 / u.norm(dim=1, keepdim=True)
    for b in range(B):
        alpha = torch.zeros(n_pages, device=device)
        hot = torch.randperm(n_pages, device=device, generator=g)[:hot_pages]
        alpha[hot] = strength * (1.0 + torch.rand(hot_pages, device=device, generator=g))
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


def _paths(prob: dict, L: int):
    """``token_level(sizes_given)`` and ``block_level(n_select, sizes_given)`` over one problem; with
    ``sizes_given`` the calls skip the value checks and never wait on the device."""
    cache, q, w, limits, cu = (prob[n] for n in ("cache", "q", "weights", "limits", "cu_seqlens_q"))
    fast = {"max_q": 1, "check_values": False}

    def token_level(sizes_given: bool = False):
        return indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=cache.block_table,
                              seq_lens=cache.seq_lens, **({"num_cols": L, **fast} if sizes_given else {}))

    def block_level(n_select: int, sizes_given: bool = False):
        return block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table,
                                    cache.seq_lens, limits, n_select, cu_seqlens_q=cu,
                                    **({"max_len": L, **fast} if sizes_given else {}))

    def stages(n_select: int) -> dict:
        """The block path's three launches, each alone (sizes given, value checks off)."""
        bounds = block_scores(q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits,
                              cache.page_size, cu_seqlens_q=cu, num_cols=triton.cdiv(L, cache.page_size), **fast)
        pages = select_pages(bounds, n_select)
        return {
            "page bounds": lambda: block_scores(q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens,
                                                limits, cache.page_size, cu_seqlens_q=cu,
                                                num_cols=triton.cdiv(L, cache.page_size), **fast),
            "page selection": lambda: select_pages(bounds, n_select),
            "logits in selected pages": lambda: selected_page_logits(q, w, cache.ik, cache.ik_scale, cache.block_table,
                                                                     cache.seq_lens, limits, pages, cu_seqlens_q=cu,
                                                                     **fast),
        }

    return token_level, block_level, stages


def report(device, ceilings) -> list[dict]:
    gpu = ceilings is not None
    B, L, P, H, DK, k = (64, 131072, 64, 64, 128, 2048) if gpu else (2, 1024, 16, 8, 32, 16)
    n_pages = triton.cdiv(L, P)
    rows = []
    for strength in (0.25, 1.0):  # weak, then strong locality (kept for the timing)
        prob = local_keys_problem(B, L, P, H, DK, hot_pages=max(2, n_pages // 64), device=device, strength=strength)
        token_level, block_level, stages = _paths(prob, L)
        dense = token_level()
        exact = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, _topk_positions(dense, None, k), True)
        for frac in FRACTIONS:
            n_select = max(1, n_pages // frac)
            logits, positions = block_level(n_select)
            found = _topk_positions(logits, positions, k)
            hits = (exact.gather(1, found.clamp_min(0)) & (found >= 0)).sum(1).float() / k
            rows.append({"measure": "recall", "locality": strength, "k": k,
                         "pages_selected": f"1/{frac} ({n_select} of {n_pages})",
                         "recall_mean": hits.mean().item(), "recall_min": hits.min().item()})
        del dense, exact

    n_select = max(1, n_pages // 32)
    shape = f"B={B},L={L},P={P},H={H},DK={DK},pages 1/32"
    calls = {
        "logits": (lambda: token_level(True), lambda: block_level(n_select, True)),
        "logits, value checks on": (token_level, lambda: block_level(n_select)),
        f"logits + torch.topk({k})": (lambda: token_level(True).topk(k, dim=1),
                                      lambda: block_level(n_select, True)[0].topk(k, dim=1)),
    }
    modes = [("eager", time_us)] + ([("CUDA graph", graph_us)] if gpu else [])
    for what, (token_fn, block_fn) in calls.items():
        for mode, timer in modes:
            if mode == "CUDA graph" and "checks on" in what:
                continue  # the value checks wait on the device: not capturable
            token_us, block_us = timer(token_fn, device), timer(block_fn, device)
            rows.append({"measure": "time", "what": what, "mode": mode, "shape": shape, "token_us": token_us,
                         "block_us": block_us, "speedup": token_us / block_us})
    for what, fn in stages(n_select).items():  # where the block path's time goes
        for mode, timer in modes:
            rows.append({"measure": "time", "what": f"{what} alone", "mode": mode, "shape": shape,
                         "block_us": timer(fn, device)})
    rows.append({"measure": "memory", "what": "output bytes", "shape": shape, "token_MB": B * L * 4 / 1e6,
                 "block_MB": B * (n_pages * 4 + n_select * P * 8) / 1e6})
    return rows
