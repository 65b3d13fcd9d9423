"""Pure-PyTorch oracle for the paged caches: FP8 row quantization and the append op.

The quantization is DeepSeek-V3.2's (``act_quant`` with ue8m0 scales): per row ``amax = max|x|``
clamped to 1e-4, ``scale = 2^ceil(log2(amax / 448))``, ``x8 = e4m3(x / scale)`` (round to nearest even).
A row holding a NaN or an inf gets scale NaN and every ``x8`` NaN: it dequantizes to NaN, never to a finite
wrong number.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., D]`` float -> ``(x8[..., D] float8_e4m3fn, scale[...] fp32)``, one power-of-two scale per row.

    ``x8.float() * scale[..., None]`` approximates ``x`` (3 mantissa bits); a row with a NaN or an inf gets
    scale NaN (and ``x8`` NaN).
    """
    amax = x.float().abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    mant, exp = torch.frexp(amax / FP8_MAX)  # value = mant * 2^exp, mant in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(amax), exp - (mant == 0.5).to(exp.dtype))  # 2^ceil(log2(value))
    scale = scale.where(amax.isfinite(), float("nan"))
    x8 = (x.float() / scale[..., None]).to(torch.float8_e4m3fn)
    return x8, scale


def fp8_rows(x8: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x8[index]`` for an FP8 tensor, through a byte view (indexing FP8 is not on every device)."""
    return x8.view(torch.uint8)[index].view(x8.dtype)


def dequantize_rows(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x8[..., D]`` e4m3, ``scale[...]`` -> fp32 ``[..., D]``."""
    return x8.float() * scale[..., None].float()


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
) -> None:
    """Write token ``j`` at physical slot ``slots[j]`` (page = slot // P) in place, then recompute the
    summaries (max, min) of each touched page ``pages[i]`` from its first ``fill[i]`` slots.

    Shapes as in :class:`~dsa_triton.attention.cache.PagedCache`; ``slots[N]``, ``pages[n]``, ``fill[n]`` int64.
    """
    if kv is not None:
        kv_cache.view(-1, kv_cache.shape[-1])[slots] = kv.to(kv_cache.dtype)
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
