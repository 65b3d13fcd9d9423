"""MXFP4 (OCP MX, the gpt-oss checkpoint layout) in pure PyTorch: the oracle for the Triton kernels.

Layout, for weights ``w[..., N, K]`` with K a multiple of 32 (callers pad K with zeros: :func:`pad_k`):

- ``blocks`` uint8 ``[..., N, K/32, 16]``: 32 E2M1 codes per block, two per byte, low nibble = even k;
- ``scales`` uint8 ``[..., N, K/32]``: E8M0, the block's value is ``2^(s - 127)``; 0xFF is NaN and rejected.

E2M1 codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same negated (the sign is the sign of
the input, so a negative input that rounds to zero keeps code 8). Quantization: shared exponent
``floor(log2(amax)) - 2`` (clamped at -127, so tiny blocks get scale 0), elements round to nearest
even and saturate at 6. Everything here is exact in float64, independent of the kernels' bit tricks.
"""
from __future__ import annotations

import torch

BLOCK = 32  # elements per MXFP4 block (one E8M0 scale)
SCALE_NAN = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |x| / 2^e rounds to code c = number of thresholds it passes; ">" where the tie goes down (to the even
# code below), ">=" where it goes up: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4.
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_lut(dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 values by code: ``[16]``."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


def exp2_exact(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` in float64 for integer ``e`` in [-1022, 1023], built from the exponent bits: exact on every
    device (CUDA's float64 ``pow`` is off by an ulp for some integer exponents, which breaks ties and round trips)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def pad_k(w: torch.Tensor) -> torch.Tensor:
    """Zero-pad the last dimension of ``w[..., N, K]`` to a multiple of 32 (a no-op when it already is)."""
    pad = -w.shape[-1] % BLOCK
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def e2m1_codes_torch(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 0..15) of ``x`` already divided by the block scale: round to nearest even, saturate at 6."""
    a = x.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t, tie_up in E2M1_THRESHOLDS:
        code += (a >= t if tie_up else a > t).to(torch.uint8)
    return code + 8 * (x < 0).to(torch.uint8)


def mxfp4_quantize_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[..., N, K]`` (any float dtype, finite, K % 32 == 0) -> ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])``."""
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"w: expected a float tensor [..., N, K], got {w.dtype} of shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"w: K = {w.shape[-1]} must be a multiple of {BLOCK} (pad with zeros: pad_k)")
    if not torch.isfinite(w).all():
        raise ValueError("w: holds NaN or inf, which MXFP4 cannot represent")
    x = w.double().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1)
    _, e2 = torch.frexp(amax)  # amax = m * 2^e2, m in [0.5, 1): floor(log2(amax)) = e2 - 1
    exponent = torch.where(amax > 0, e2 - 1 - 2, -127).clamp(-127, 127)
    codes = e2m1_codes_torch(x * exp2_exact(-exponent).unsqueeze(-1))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_dequantize_torch(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks[..., N, K/32, 16]``, ``scales[..., N, K/32]`` (uint8) -> ``w[..., N, K]`` in ``dtype``.

    Exact in float64, rounded once to ``dtype`` (values beyond its range become inf or flush to zero).
    """
    validate_mxfp4("mxfp4", blocks, scales)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2)  # [..., N, K/32, 32]
    values = e2m1_lut(device=blocks.device)[codes.long()] * exp2_exact(scales.to(torch.int64) - 127).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def validate_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` (and the first bad block) unless ``blocks``/``scales`` are valid MXFP4.

    Checks: both uint8 tensors, ``blocks[..., N, K/32, 16]``, ``scales`` of shape ``blocks.shape[:-1]``,
    same device, and no 0xFF (NaN) scale. Meant for load time: the NaN scan reads every scale once.
    """
    for part, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}_{part}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}_{part}: dtype must be uint8, got {str(t.dtype).replace('torch.', '')}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{name}_blocks: expected shape [..., N, K/32, 16], got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{name}_scales: shape must be {tuple(blocks.shape[:-1])} (blocks' without the last 16), got {tuple(scales.shape)}"
        )
    if scales.device != blocks.device:
        raise ValueError(f"{name}_scales: on {scales.device}, but {name}_blocks is on {blocks.device}")
    check_no_nan_scale(f"{name}_scales", scales)


def check_no_nan_scale(label: str, scales: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``label``, the first 0xFF (NaN) block and their count, if ``scales`` holds one
    (reads every scale once: a sync)."""
    bad = (scales == SCALE_NAN).flatten().nonzero()
    if bad.numel():
        flat = int(bad[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(scales.shape)))
        k0 = index[-1] * BLOCK
        raise ValueError(
            f"{label}: block {index} (k {k0}..{k0 + BLOCK - 1}) has scale 0xFF, which is NaN in E8M0 "
            f"({bad.numel()} such block(s) in all)"
        )
