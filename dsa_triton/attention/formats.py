"""The formats of the paged caches, which the ops, their kernels' host code and the references all read.

Page sizes ``P`` in :data:`PAGE_SIZES`; page summaries in :data:`SUMMARY_DTYPES`; latent rows either as they are
(:data:`ROW_DTYPES`) or in the FP8 latent layout below.

FP8 rows (indexer keys): DeepSeek-V3.2's ``act_quant`` with ue8m0 scales: per row ``amax = max|x|`` clamped to
1e-4, ``scale = 2^ceil(log2(amax / 448))``, ``x8 = e4m3(x / scale)`` (round to nearest even). A row holding a NaN
or an inf gets scale NaN and every ``x8`` NaN: it dequantizes to NaN, never to a finite wrong number.

FP8 latent cache (DeepSeek's FlashMLA layout): a row of ``d_latent`` latent values and ``d_rope`` rope values is
``fp8_latent_bytes(d_latent, d_rope)`` bytes, one contiguous read per selected token (656 for 512 + 64):

- bytes ``[0, d_latent)``: the latent values in e4m3;
- then ``ceil(d_latent / 128)`` fp32 scales, one per group of 128 latent values (the last group may be partial);
- then the ``d_rope`` rope values in bf16.

Each group is quantized like an indexer key row above (the same rule, per 128 values instead of per row). The
scale is a power of two, for three reasons: ``x / scale`` is exact, so the kernels and the references agree bit for
bit; a dequantized value (4 significant bits times a power of two) is exact in bf16, so the attention kernels
feed the tensor cores bf16 without a second rounding; and FlashMLA's own FP8 cache quantizer rounds its scales
up to a power of two too (``amax / 448`` rounded up). Saturation is built in: ``amax / scale <= 448``. A latent
``d_latent`` that is a multiple of 4 and an even ``d_rope`` keep every scale 4-byte and every rope value 2-byte
aligned in every row (the kernels load them as fp32 and bf16).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor

PAGE_SIZES = (16, 32, 64, 128)
SUMMARY_DTYPES = (torch.bfloat16, torch.float32)
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # latent rows kept as they are; new rows of an FP8 cache
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
LATENT_GROUP = 128  # latent values per fp32 scale in the FP8 latent cache
def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., D]`` float -> ``(x8[..., D] float8_e4m3fn, scale[...] fp32)``, one power-of-two scale per row.

    ``x8.float() * scale[..., None]`` approximates ``x`` (3 mantissa bits); a row with a NaN or an inf gets
    scale NaN (and ``x8`` NaN); a row of no values (``D = 0``) the scale of an all-zero row. ``x`` that is not a
    floating-point tensor of at least one dimension raises a ValueError naming ``x``.
    """
    check_tensor("x", x, contiguous_last=False)
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"x: expected a floating-point tensor of rows [..., D], got {x.dtype}{list(x.shape)}")
    amax = x.float().abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1], dtype=torch.float32)
    amax = amax.clamp_min(AMAX_FLOOR)
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


def fp8_latent_bytes(d_latent: int, d_rope: int) -> int:
    """Bytes of one FP8 latent cache row: e4m3 latent values, one fp32 scale per 128 of them, bf16 rope values."""
    return d_latent + 4 * -(-d_latent // LATENT_GROUP) + 2 * d_rope


def fp8_latent_quantize(x: torch.Tensor, d_latent: int) -> torch.Tensor:
    """``x[..., d_latent + d_rope]`` float -> ``uint8[..., fp8_latent_bytes(d_latent, d_rope)]``: the FP8 latent
    cache rows of ``x`` (a group with a NaN or an inf gets scale NaN and NaN bytes; rope values are rounded to bf16
    as they are)."""
    groups = -(-d_latent // LATENT_GROUP)
    latent = torch.zeros(*x.shape[:-1], groups * LATENT_GROUP, dtype=torch.float32, device=x.device)
    latent[..., :d_latent] = x[..., :d_latent].float()  # zero padding changes no amax
    x8, scale = fp8_quantize_rows(latent.unflatten(-1, (groups, LATENT_GROUP)))
    rope = x[..., d_latent:].to(torch.bfloat16)
    as_bytes = lambda t: t.contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)  # noqa: E731
    return torch.cat([as_bytes(x8)[..., :d_latent], as_bytes(scale), as_bytes(rope)], dim=-1)


def fp8_latent_dequantize(rows: torch.Tensor, d_latent: int) -> torch.Tensor:
    """``uint8[..., bytes]`` FP8 latent cache rows -> fp32 ``[..., d_latent + d_rope]``: each e4m3 latent value times
    its group's scale, then the bf16 rope values."""
    groups = -(-d_latent // LATENT_GROUP)
    scales_end = d_latent + 4 * groups
    x8 = rows[..., :d_latent].contiguous().view(torch.float8_e4m3fn)
    scale = rows[..., d_latent:scales_end].contiguous().view(torch.float32)
    rope = rows[..., scales_end:].contiguous().view(torch.bfloat16)
    latent = x8.float() * scale.repeat_interleave(LATENT_GROUP, dim=-1)[..., :d_latent]
    return torch.cat([latent, rope.float()], dim=-1)


def check_fp8_latent_layout(name: str, d_latent: int, d_rope: int) -> None:
    """The FP8 latent layout's sizes: ``d_latent >= 1`` a multiple of 4 and ``d_rope >= 0`` even, so every fp32
    scale and bf16 rope value is aligned in every row; else a ValueError naming ``name``."""
    if d_latent < 1 or d_latent % 4 or d_rope < 0 or d_rope % 2:
        raise ValueError(f"{name}: an FP8 latent cache needs a latent width that is a positive multiple of 4 and an "
                         f"even rope width, got {d_latent} + {d_rope}")
