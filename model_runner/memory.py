"""The memory plan printed before a run (weights by format, the paged caches, the workspace a step needs), and the
long-context plan: what a model's caches cost per layer type, per token and per sequence, and how many tokens fit in
a given memory (:func:`context_plan`)."""
from __future__ import annotations

import torch

from pathlib import Path

from .cache_manager import CacheManager
from .families import family_of, read_config
from .ops import FP8Weight
from .paging import LayerCost


def memory_plan(weights: dict, cache: CacheManager, model, tokens_per_step: int) -> dict[str, int]:
    """Bytes by line: weights (each tensor once: a tied lm_head is the embedding), caches (the layout's lines), the
    per-step workspace (the layout's: indexer logits; the model's: e.g. the MoE FP8 workspace)."""
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
    plan.update(cache.layout.workspace(tokens_per_step, cache.max_pages * cache.page_size))
    plan.update(model.workspace(tokens_per_step))
    return plan


def bytes_per_token(cache: CacheManager) -> int:
    """Cache bytes one more token of a sequence takes in all layers (a window's fixed cost not counted)."""
    return round(sum(c.layers * c.per_token for c in cache.layout.costs(cache.dtype, cache.page_size)))


def format_plan(plan: dict[str, int]) -> list[str]:
    """One line per entry and a total, in MiB."""
    width = max(len(k) for k in plan)
    lines = [f"  {k:<{width}}  {v / 2**20:10.2f} MiB" for k, v in plan.items()]
    return ["memory plan:", *lines, f"  {'total':<{width}}  {sum(plan.values()) / 2**20:10.2f} MiB"]


def config_plan(config_path: str | Path, context: int, memory: int, dtype: torch.dtype = torch.bfloat16,
                page_size: int = 64) -> list[str]:
    """:func:`context_plan` of a config.json's caches as its family lays them out by default (indexer precision its
    default, rows in ``dtype``), no weights loaded."""
    config = read_config(config_path)
    family = family_of(config)
    layout = family.cache_layout(config, index_precision=family.index_precisions[0], kv_cache="activation",
                                 step_tokens=page_size)
    return [f"{config.model_type}, {config.num_hidden_layers} layers, caches in {str(dtype).replace('torch.', '')}:",
            *context_plan(layout.costs(dtype, page_size), context, memory)]


def context_plan(costs: list[LayerCost], context: int, memory: int) -> list[str]:
    """What a cache of the layer ``costs`` (a layout's ``costs(dtype, page_size)``) takes: per layer type the
    bytes a sequence and a token, the totals per token and for one sequence of ``context`` tokens, and the tokens
    that fit in ``memory`` bytes (one sequence; sequences of ``context`` tokens)."""
    lines = []
    for c in costs:
        lines.append(f"  {c.kind} x {c.layers}: {c.per_sequence / 2**10:.1f} KiB a sequence + {c.per_token:.2f} B a "
                     f"token, a layer ({c.what})")
    per_token = sum(c.layers * c.per_token for c in costs)
    per_sequence = sum(c.layers * c.per_sequence for c in costs)
    one = per_sequence + per_token * context
    fit = int((memory - per_sequence) // per_token) if per_token and memory > per_sequence else 0
    return ["cache plan:", *lines,
            f"  all layers: {per_token:.1f} B a token + {per_sequence / 2**20:.2f} MiB a sequence",
            f"  one sequence of {context} tokens: {one / 2**30:.3f} GiB",
            f"  in {memory / 2**30:.1f} GiB: {fit} tokens in one sequence, {int(memory // one)} sequences of "
            f"{context} tokens"]
