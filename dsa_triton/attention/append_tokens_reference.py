"""Pure-PyTorch oracle of :func:`~dsa_triton.append_tokens`: new rows into the paged caches, quantized as
:mod:`.formats` says, and the page summaries kept current."""
from __future__ import annotations

import torch

from .formats import (dequantize_rows, fp8_latent_quantize, fp8_quantize_rows, fp8_rows, is_model1_width,
                      model1_write)


def append_torch(
    kv_cache: torch.Tensor | None,
    ik: torch.Tensor | None,
    ik_scale: torch.Tensor | None,
    summaries: torch.Tensor | None,
    kv: torch.Tensor | None,
    index_k: torch.Tensor | None,
    slots: torch.Tensor,
    pages: torch.Tensor,
    fill: torch.Tensor,
    rope_dim: int = 64,
) -> None:
    """Write token ``j`` at physical slot ``slots[j]`` (page = slot // P) in place, then recompute the
    summaries (max, min) of each touched page ``pages[i]`` from its first ``fill[i]`` slots.

    Shapes as in :class:`~dsa_triton.attention.cache.PagedCache`; ``slots[N]``, ``pages[n]``, ``fill[n]`` int64.
    A uint8 ``kv_cache`` is an FP8 latent cache or MODEL1 pages (by its width): ``kv[N, D]`` rows are quantized
    with the last ``rope_dim`` of their ``D`` values kept as bf16.
    """
    if kv is not None and kv_cache.dtype == torch.uint8 and is_model1_width(kv_cache.shape[-1], kv.shape[-1],
                                                                            rope_dim):
        model1_write(kv_cache, slots, kv, rope_dim)
    elif kv is not None:
        rows = fp8_latent_quantize(kv, kv.shape[-1] - rope_dim) if kv_cache.dtype == torch.uint8 else kv
        kv_cache.view(-1, kv_cache.shape[-1])[slots] = rows.to(kv_cache.dtype)
    if index_k is None:
        return
    x8, scale = fp8_quantize_rows(index_k)
    ik.view(-1, ik.shape[-1]).view(torch.uint8)[slots] = x8.view(torch.uint8)
    ik_scale.view(-1)[slots] = scale
    pmax, pmin = page_extremes(dequantize_rows(fp8_rows(ik, pages), ik_scale[pages]), fill)
    summaries[pages, 0] = pmax.to(summaries.dtype)  # exact in bf16
    summaries[pages, 1] = pmin.to(summaries.dtype)


def page_extremes(keys: torch.Tensor, fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise (max, min) ``[n, DK]`` over the first ``fill[i]`` of page ``i``'s keys ``keys[n, P, DK]``
    (``-inf`` / ``inf`` for an empty page)."""
    used = (torch.arange(keys.shape[1], device=keys.device) < fill[:, None])[..., None]
    return keys.where(used, float("-inf")).amax(dim=1), keys.where(used, float("inf")).amin(dim=1)
