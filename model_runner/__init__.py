"""A minimal DeepSeek-V3.2-style model runner on the dsa_triton ops: config, checkpoint loader, model (kernel or
reference backend), paged cache manager and an offline batch engine. ``python -m model_runner --help``."""
from __future__ import annotations

from pathlib import Path

import torch

from .cache_manager import CacheManager
from .config import ModelConfig, tiny_config
from .engine import Engine, SamplingParams
from .loader import load_checkpoint, save_random_checkpoint
from .model import Model
from .ops import KernelOps, ReferenceOps


def build_engine(config: ModelConfig, checkpoint: str | Path, *, mode: str = "kernel", dtype: torch.dtype,
                 device, num_pages: int = 64, page_size: int = 16, max_seqs: int = 8, max_seq_len: int = 256,
                 max_num_batched_tokens: int = 256, seed: int = 0, poison: bool = False,
                 check_values: bool = True) -> Engine:
    """Load ``checkpoint`` into a model on the ``mode`` backend ("kernel" or "reference") with its caches;
    ``check_values``: see :class:`.ops.KernelOps`."""
    if mode not in ("kernel", "reference"):
        raise ValueError(f"mode: must be 'kernel' or 'reference', got {mode!r}")
    ops = KernelOps(check_values) if mode == "kernel" else ReferenceOps()
    model = Model(config, load_checkpoint(checkpoint, config, dtype, device), ops)
    cache = CacheManager(config, num_pages, page_size, max_seqs, max_seq_len, dtype, device, poison=poison)
    return Engine(model, cache, max_num_batched_tokens, seed)


__all__ = ["ModelConfig", "tiny_config", "load_checkpoint", "save_random_checkpoint", "Model", "CacheManager",
           "Engine", "SamplingParams", "build_engine"]
