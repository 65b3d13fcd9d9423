"""The MoE weight and activation formats, which the ops, their kernels' host code and the references all read.

MXFP4 (OCP MX, the gpt-oss checkpoint layout), for weights ``w[..., N, K]`` with K a multiple of 32 (callers pad K
with zeros: :func:`pad_k`):

- ``blocks`` uint8 ``[..., N, K/32, 16]``: 32 E2M1 codes per block, two per byte, low nibble = even k;
- ``scales`` uint8 ``[..., N, K/32]``: E8M0, the block's value is ``2^(s - 127)``; 0xFF is NaN and rejected.

E2M1 codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same negated (the sign is the sign of the input, so a
negative input that rounds to zero keeps code 8).

FP8 workspace weights: e4m3 with one fp32 scale per (row, :data:`GROUP` k elements), ``n_groups(K)`` scale columns.

Class-major activations (what the fused down GEMM reads): ``[M, K]`` as ``[M, 4, K/4]`` with ``y[m, c, q]`` =
column ``4q + c``.
"""
from __future__ import annotations

import torch

from ..hostmath import cdiv

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


E4M3_MAX = 448.0
GROUP = 128  # k elements per fp32 scale of the FP8 weights
BLOCKS_PER_GROUP = GROUP // BLOCK
E2M1_HEADROOM = 6  # binades between the group's top block scale and the reference: 6 * 2^6 = 384 <= 448


def n_groups(k: int) -> int:
    """Scale columns for ``k`` elements: ``ceil(k / 128)``."""
    return cdiv(k, GROUP)


def class_major(x: torch.Tensor) -> torch.Tensor:
    """``x[M, K]`` -> ``[M, 4, K/4]`` contiguous with ``out[m, c, q] = x[m, 4q + c]``: the layout in which the fused
    MXFP4 GEMM reads each nibble class of a K tile as one contiguous run."""
    return x.view(x.shape[0], x.shape[1] // 4, 4).transpose(1, 2).contiguous()


def row_major(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`class_major`: ``[M, 4, K/4]`` -> ``[M, K]``."""
    return x.transpose(1, 2).reshape(x.shape[0], -1)
