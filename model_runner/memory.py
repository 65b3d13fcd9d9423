"""The memory plan printed before a run: weights by format, the paged caches, and the workspace a step needs."""
from __future__ import annotations

import torch

from dsa_triton import registry

from .cache_manager import CacheManager
from .config import ModelConfig
from .ops import FP8Weight


def memory_plan(weights: dict, cache: CacheManager, config: ModelConfig, tokens_per_step: int) -> dict[str, int]:
    """Bytes by line: weights (each tensor once: a tied lm_head is the embedding), caches, per-step workspace.

    Workspace: the indexer logits of a step (``tokens_per_step x max_seq_len`` fp32, the largest transient) and
    the MoE prefill path's shared FP8 workspace at its largest (two stages of the most experts a stage can hold,
    each ``[2I, D]`` e4m3 with fp32 scales per 128 columns; allocated on the first prefill that takes it).
    """
    plan: dict[str, int] = {}
    seen = set()
    for name, value in weights.items():
        for t in (value if isinstance(value, FP8Weight) else (value,)):
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            if isinstance(value, FP8Weight):
                kind = "weights: dense FP8 (+ block scales)"
            elif t.dtype == torch.uint8:
                kind = "weights: experts MXFP4"
            else:
                kind = f"weights: {str(t.dtype).replace('torch.', '')}"
            plan[kind] = plan.get(kind, 0) + t.numel() * t.element_size()
    plan.update(cache.nbytes())
    max_seq_len = cache.max_pages * cache.page_size
    plan["workspace: indexer logits of a step"] = tokens_per_step * max_seq_len * 4
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        n, k = 2 * config.moe_intermediate_size, config.hidden_size
        slots = 2 * max(registry.get("fp8_grouped_gemm").space["EXPERTS_PER_STAGE"])
        plan["workspace: MoE FP8 (at most)"] = slots * (n * k + 4 * n * -(-k // 128))
    return plan


def bytes_per_token(cache: CacheManager) -> int:
    """Cache bytes one token takes in all layers (latent rows and indexer caches: whatever format they are in)."""
    return sum(cache.nbytes().values()) // (cache.allocator.num_pages * cache.page_size)


def format_plan(plan: dict[str, int]) -> list[str]:
    """One line per entry and a total, in MiB."""
    width = max(len(k) for k in plan)
    lines = [f"  {k:<{width}}  {v / 2**20:10.2f} MiB" for k, v in plan.items()]
    return ["memory plan:", *lines, f"  {'total':<{width}}  {sum(plan.values()) / 2**20:10.2f} MiB"]
