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

MODEL1 FP8 cache (FlashMLA's ``MODEL1_FP8Sparse``, DeepSeek-V4's K=V rows of ``d = d_nope + d_rope`` values, 512 =
448 + 64): ``model1_bytes(d_nope, d_rope)`` bytes a token (584), arranged per *page* of ``P`` tokens, not per row:

- bytes ``[0, P (d_nope + 2 d_rope))``: token ``t``'s ``d_nope`` e4m3 values then its ``d_rope`` bf16 rope values
  at ``t (d_nope + 2 d_rope)`` (576 bytes a token);
- then ``P (d_nope / 64 + 1)`` bytes: token ``t``'s ``d_nope / 64`` ue8m0 scales (one per 64-value tile, a byte
  ``e`` for ``2^(e - 127)``, 0xFF NaN) and one pad byte (0) at ``P (d_nope + 2 d_rope) + t (d_nope / 64 + 1)``.

The ``[num_pages, P, bytes]`` view of a cache (FlashMLA's ``k_cache`` without its ``h_k`` dim) has row stride
``bytes``; its page stride may be larger (FlashMLA allocates pages rounded up to a multiple of ``d_nope + 2 d_rope``
bytes: :func:`model1_cache`). A tile is quantized as a row above with FlashMLA's floor (``amax / 448`` clamped at
1e-4, not ``amax``: :data:`MODEL1_AMAX_FLOOR`), so for bf16 rows (what it takes) the bytes are those of FlashMLA's
``tests/quant.py`` ``quantize_k_cache`` (its pad byte is uninitialized; here 0); rows of another dtype are quantized
from their own values, the rope values rounded to bf16. A tile holding a NaN or an inf gets scale 0xFF and NaN bytes.
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
MODEL1_TILE = 64  # values per ue8m0 scale in the MODEL1 FP8 cache
MODEL1_ROPE = 64  # DeepSeek-V4's rope values a row ends with
MODEL1_AMAX_FLOOR = FP8_MAX * 1e-4  # FlashMLA clamps amax / 448 at 1e-4: amax at 0.0448 (the same scales)


def fp8_quantize_rows(x: torch.Tensor, amax_floor: float = AMAX_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., D]`` float -> ``(x8[..., D] float8_e4m3fn, scale[...] fp32)``, one power-of-two scale per row
    (``amax`` clamped at ``amax_floor``).

    ``x8.float() * scale[..., None]`` approximates ``x`` (3 mantissa bits); a row with a NaN or an inf gets
    scale NaN (and ``x8`` NaN); a row of no values (``D = 0``) the scale of an all-zero row. ``x`` that is not a
    floating-point tensor of at least one dimension raises a ValueError naming ``x``.
    """
    check_tensor("x", x, contiguous_last=False)
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"x: expected a floating-point tensor of rows [..., D], got {x.dtype}{list(x.shape)}")
    amax = x.float().abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1], dtype=torch.float32)
    amax = amax.clamp_min(amax_floor)
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


def model1_bytes(d_nope: int = 448, d_rope: int = MODEL1_ROPE) -> int:
    """Bytes of one token in the MODEL1 FP8 cache: e4m3 values, bf16 rope values, one ue8m0 scale per 64 values and
    a pad byte (584 for 448 + 64)."""
    return d_nope + 2 * d_rope + d_nope // MODEL1_TILE + 1


def check_model1_layout(name: str, d_nope: int, d_rope: int) -> None:
    """The MODEL1 layout's sizes: ``d_nope`` a positive multiple of 64 and ``d_rope >= 0``; else a ValueError naming
    ``name``."""
    if d_nope < MODEL1_TILE or d_nope % MODEL1_TILE or d_rope < 0:
        raise ValueError(f"{name}: a MODEL1 FP8 cache needs a positive multiple of {MODEL1_TILE} quantized values "
                         f"and a rope width >= 0, got {d_nope} + {d_rope}")


def is_model1_width(width: int, d: int, d_rope: int) -> bool:
    """Whether ``width`` bytes a token are MODEL1 tokens of ``d`` values, the last ``d_rope`` rope (never also the FP8
    latent layout's width of the same split)."""
    d_nope = d - d_rope
    return d_nope > 0 and d_nope % MODEL1_TILE == 0 and d_rope >= 0 and width == model1_bytes(d_nope, d_rope)


def model1_rope(d: int, width: int) -> int | None:
    """The rope width of MODEL1 rows of ``d`` values in ``width`` bytes, or None when none fits. Unique: with
    ``d - d_rope`` a multiple of 64, 64 more rope values take 63 more bytes."""
    return next((r for r in range(d % MODEL1_TILE, d - MODEL1_TILE + 1, MODEL1_TILE)
                 if model1_bytes(d - r, r) == width), None)


def model1_page_stride(page_size: int, d_nope: int = 448, d_rope: int = MODEL1_ROPE) -> int:
    """FlashMLA's page stride in bytes: ``page_size`` tokens rounded up to a multiple of ``d_nope + 2 d_rope``."""
    data = d_nope + 2 * d_rope
    return -(-page_size * model1_bytes(d_nope, d_rope) // data) * data


def model1_cache(num_pages: int, page_size: int, d_nope: int = 448, d_rope: int = MODEL1_ROPE, fill: int = 0,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """An empty MODEL1 cache as FlashMLA allocates it: uint8 ``[num_pages, page_size, model1_bytes]`` over pages of
    :func:`model1_page_stride` bytes, every byte ``fill`` (0xFF: NaN in every part, for tests)."""
    check_model1_layout("d_nope", d_nope, d_rope)
    width = model1_bytes(d_nope, d_rope)
    pages = torch.full((num_pages, model1_page_stride(page_size, d_nope, d_rope)), fill, dtype=torch.uint8,
                       device=device)
    return pages[:, :page_size * width].view(num_pages, page_size, width)


def model1_quantize(x: torch.Tensor, d_rope: int = MODEL1_ROPE) -> torch.Tensor:
    """Pages ``x[..., P, d]`` float -> uint8 ``[..., P, model1_bytes(d - d_rope, d_rope)]``, each ``[P, bytes]``
    block one page in the MODEL1 layout (module docstring); rope values rounded to bf16, pad bytes 0."""
    check_tensor("x", x, contiguous_last=False)
    if not x.is_floating_point() or x.dim() < 2:
        raise ValueError(f"x: expected floating-point pages [..., P, d], got {x.dtype}{list(x.shape)}")
    d_nope = x.shape[-1] - d_rope
    check_model1_layout("x, d_rope", d_nope, d_rope)
    tiles = d_nope // MODEL1_TILE
    x8, scale = fp8_quantize_rows(x[..., :d_nope].float().unflatten(-1, (tiles, MODEL1_TILE)), MODEL1_AMAX_FLOOR)
    exponent = (scale.view(torch.int32) >> 23).to(torch.uint8)  # 2^e -> e + 127; NaN -> 0xFF
    as_bytes = lambda t: t.contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1)  # noqa: E731
    data = torch.cat([as_bytes(x8), as_bytes(x[..., d_nope:].to(torch.bfloat16))], dim=-1)
    scales = torch.cat([exponent, torch.zeros_like(exponent[..., :1])], dim=-1)
    return torch.cat([data.flatten(-2), scales.flatten(-2)], dim=-1).view(*x.shape[:-1], -1)


def model1_dequantize(pages: torch.Tensor, d_rope: int = MODEL1_ROPE) -> torch.Tensor:
    """uint8 MODEL1 pages ``[..., P, bytes]`` (page stride free) -> fp32 ``[..., P, d]``: each e4m3 value times
    its tile's scale, then the bf16 rope values."""
    P, width = pages.shape[-2:]
    d_nope, data_bytes, tiles = _model1_sizes("pages", width, d_rope)
    flat = pages.reshape(*pages.shape[:-2], P * width)
    exponent = flat[..., P * data_bytes:].unflatten(-1, (P, tiles + 1))[..., :tiles]
    return _model1_values(flat[..., :P * data_bytes].unflatten(-1, (P, data_bytes)), exponent, d_nope)


def model1_gather(pages: torch.Tensor, slots: torch.Tensor, d_rope: int = MODEL1_ROPE) -> torch.Tensor:
    """fp32 ``[..., d]``: the dequantized tokens at physical ``slots`` (int, any shape; ``page * P + offset``, each
    in range) of MODEL1 pages ``[num_pages, P, bytes]`` (page stride free), without dequantizing the others."""
    flat, page, data, scales, d_nope = _model1_token_bytes(pages, slots, d_rope)
    return _model1_values(flat[page, data], flat[page, scales[..., :-1]], d_nope)


def model1_write(pages: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, d_rope: int = MODEL1_ROPE) -> None:
    """Write rows ``x[N, d]`` float as MODEL1 tokens at physical ``slots[N]`` of ``pages`` ``[num_pages, P, bytes]``
    (page stride free), in place: each row quantized as :func:`model1_quantize` quantizes a page of one token."""
    flat, page, data, scales, _ = _model1_token_bytes(pages, slots, d_rope)
    token = model1_quantize(x[:, None], d_rope)[:, 0]  # a one-token page: its data bytes, then its scale bytes
    flat[page, data] = token[:, :data.shape[-1]]
    flat[page, scales] = token[:, data.shape[-1]:]


def _model1_token_bytes(pages: torch.Tensor, slots: torch.Tensor, d_rope: int):
    """``(pages as [num_pages, P * bytes] (a view), page [..., 1], data columns, scale columns (pad included),
    d_nope)`` of the tokens at ``slots``: the index of each of their bytes."""
    num_pages, P, width = pages.shape
    d_nope, data_bytes, tiles = _model1_sizes("pages", width, d_rope)
    page, off = (slots.long() // P)[..., None], (slots.long() % P)[..., None]
    arange = lambda n: torch.arange(n, device=pages.device)  # noqa: E731
    return (pages.view(num_pages, P * width), page, off * data_bytes + arange(data_bytes),
            P * data_bytes + off * (tiles + 1) + arange(tiles + 1), d_nope)


def _model1_sizes(name: str, width: int, d_rope: int) -> tuple[int, int, int]:
    """``(d_nope, data bytes, tiles)`` of MODEL1 tokens of ``width`` bytes with ``d_rope`` rope values."""
    d_nope = (width - 2 * d_rope - 1) * MODEL1_TILE // (MODEL1_TILE + 1)
    check_model1_layout(f"{name}, d_rope", d_nope, d_rope)
    if model1_bytes(d_nope, d_rope) != width:
        raise ValueError(f"{name}: {width} bytes a token is no MODEL1 row with {d_rope} rope values")
    return d_nope, d_nope + 2 * d_rope, d_nope // MODEL1_TILE


def _model1_values(data: torch.Tensor, exponent: torch.Tensor, d_nope: int) -> torch.Tensor:
    """fp32 ``[..., d]`` of tokens' data bytes ``[..., d_nope + 2 d_rope]`` and scale bytes ``[..., d_nope / 64]``."""
    exponent = exponent.int()
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 127)
    scale = scale.where(exponent != 255, float("nan"))  # ue8m0: 2^(e - 127), 0xFF NaN
    nope = data[..., :d_nope].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, MODEL1_TILE))
    rope = data[..., d_nope:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).flatten(-2), rope], dim=-1)
