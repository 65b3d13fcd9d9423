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


def decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, sm_scale: float, d_v: int = 512, *,
           attn_sink: torch.Tensor | None = None, extra_kv_cache: torch.Tensor | None = None,
           extra_slots: torch.Tensor | None = None):
    """A sparse decode call on an FP8 cache (the latent one, or with ``d_v == D`` DeepSeek-V4's MODEL1 pages):
    ``q[B, S, H, D]`` bf16, ``kv_cache[pages, P, bytes]`` uint8, ``slots[B, S, k]`` int32 physical slots (-1
    skipped); DeepSeek-V4's ``attn_sink[H]`` fp32 and a second cache ``extra_kv_cache`` with its ``extra_slots[B, S,
    k2]`` -> a function of no arguments returning ``(out[B, S, H, d_v] bf16, lse[B, H, S] fp32)``. The scheduling
    metadata is made on the first call and reused by later ones (same shapes: what a CUDA graph captures)."""
    fm = module()
    sched, _ = fm.get_mla_metadata()
    as_heads = lambda c: None if c is None else c.view(torch.float8_e4m3fn).unsqueeze(2)  # noqa: E731  [pages, P, 1, bytes]
    cache, extra = as_heads(kv_cache), as_heads(extra_kv_cache)
    return lambda: fm.flash_mla_with_kvcache(q, cache, None, None, d_v, sched, None, sm_scale, False, True, slots,
                                             attn_sink, extra, extra_slots)


def prefill(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float, d_v: int = 512, *,
            attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None):
    """A sparse prefill call over a bf16 cache: ``q[T, H, D]``, ``kv[num_slots, D]`` bf16, ``slots[T, k]`` int32
    (-1 skipped); DeepSeek-V4's ``attn_sink[H]`` fp32 and ``topk_length[T]`` int32 (D 512) -> a function of no
    arguments returning ``(out[T, H, d_v] bf16, max_logits, lse[T, H])``."""
    fm = module()
    cache, index = kv.unsqueeze(1), slots.unsqueeze(1)  # one KV head
    return lambda: fm.flash_mla_sparse_fwd(q, cache, index, sm_scale, d_v, attn_sink, topk_length)
