"""FlashMLA (deepseek-ai/FlashMLA), the sparse attention kernels a user would run instead of ours, as a baseline.

Imported when built on the GPU machine (``scripts/flashmla_build.sh`` puts the package on a path; ``import
flash_mla``). Its V3.2 FP8 cache (656 bytes a token: 512 e4m3, 4 fp32 scales, 64 bf16 rope) is byte-compatible
with ours, so both read the same cache bytes, indices (physical slots) and scale.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def module():
    """The ``flash_mla`` package, or None when it is not built here (or there is no GPU)."""
    if not torch.cuda.is_available():
        return None
    try:
        import flash_mla
    except ImportError:
        return None
    return flash_mla


def decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, sm_scale: float, d_v: int = 512):
    """A sparse decode call on the FP8 latent cache: ``q[B, S, H, D]`` bf16, ``kv_cache[pages, P, bytes]`` uint8,
    ``slots[B, S, k]`` int32 physical slots (-1 skipped) -> a function of no arguments returning ``(out[B, S, H,
    d_v] bf16, lse[B, H, S] fp32)``. The scheduling metadata is made on the first call and reused by later ones
    (same shapes: what a CUDA graph captures)."""
    fm = module()
    sched, _ = fm.get_mla_metadata()
    cache = kv_cache.view(torch.float8_e4m3fn).unsqueeze(2)  # [pages, P, 1 head, bytes]
    return lambda: fm.flash_mla_with_kvcache(q, cache, None, None, d_v, sched, None, sm_scale, False, True, slots)


def prefill(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float, d_v: int = 512):
    """A sparse prefill call over a bf16 cache: ``q[T, H, D]``, ``kv[num_slots, D]`` bf16, ``slots[T, k]`` int32
    (-1 skipped) -> a function of no arguments returning ``(out[T, H, d_v] bf16, max_logits, lse[T, H])``."""
    fm = module()
    cache, index = kv.unsqueeze(1), slots.unsqueeze(1)  # one KV head
    return lambda: fm.flash_mla_sparse_fwd(q, cache, index, sm_scale, d_v)
