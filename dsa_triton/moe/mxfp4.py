"""MXFP4 quantize / dequantize (OCP MX, gpt-oss layout): ``dt.mxfp4_quantize``, ``dt.mxfp4_dequantize``.

The format is :mod:`.formats`, the oracle :mod:`.mxfp4_reference`; the kernels (:mod:`.mxfp4_kernels`) match it bit
for bit (codes, scales and dequantized values). Launch configs: :data:`QUANTIZE` and :data:`DEQUANTIZE` (``BLOCK_B``
32-element blocks per program, ``num_warps``; shape ``N`` rows, every leading dimension flattened, and ``K``).
"""
from __future__ import annotations

import math

import torch

from ..checks import check_kernel_device, check_out, check_tensor
from ..hostmath import cdiv
from ..launch import launch_with
from ..library import dsa_op, op_config
from ..plans import cached
from ..registry import LaunchSpace
from .mxfp4_kernels import _dequantize_kernel, _quantize_kernel
from .formats import BLOCK, validate_mxfp4

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SPACE = {"BLOCK_B": (8, 16, 32, 64, 128), "num_warps": (1, 2, 4, 8)}


def _default(phase, shape):
    return {"BLOCK_B": 64, "num_warps": 4} if shape["N"] * shape["K"] >= 2**20 else {"BLOCK_B": 16, "num_warps": 2}


QUANTIZE, DEQUANTIZE = (LaunchSpace(name=name, phases=("load",), space=_SPACE, default=_default, fixed_dims=("K",),
                                    bucketed_dims=("N",)) for name in ("mxfp4_quantize", "mxfp4_dequantize"))


def _flat_shape(w_shape: tuple[int, ...]) -> dict[str, int]:
    return {"N": math.prod(w_shape[:-1]), "K": w_shape[-1]}


def mxfp4_quantize(w: torch.Tensor, *, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w[..., N, K]`` (fp32 / bf16 / fp16, finite, K % 32 == 0; pad with ``pad_k``) to MXFP4.

    Returns ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])``, bit-identical to
    :func:`mxfp4_quantize_torch`. A load-time op: it checks finiteness (one device sync). ``config``: an
    ``mxfp4_quantize`` config (None: the tuning database's), validated (:class:`~dsa_triton.ConfigError`).
    """
    check_tensor("w", w, dtype=WEIGHT_DTYPES, contiguous_last=False)
    device = check_kernel_device("w", w)
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], got shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"w: K = {w.shape[-1]} must be a multiple of {BLOCK} (pad with zeros: pad_k)")
    shape = _flat_shape(tuple(w.shape))
    config = QUANTIZE.launch_config("load", shape, device) if config is None else QUANTIZE.validate(config, shape)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w: holds NaN or inf, which MXFP4 cannot represent")
    return quantize_launch(w, config)


@cached
def _block_meta(block_b: int, num_warps: int) -> dict:
    return dict(BLOCK_B=block_b, num_warps=num_warps)


def quantize_launch(w: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mxfp4_quantize` without the argument checks (the registry times this): launch only."""
    w = w.contiguous()
    blocks = torch.empty(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(blocks.shape[:-1], dtype=torch.uint8, device=w.device)
    n_blocks = scales.numel()
    if n_blocks:
        grid = (cdiv(n_blocks, config["BLOCK_B"]),)
        launch_with(_quantize_kernel, grid, _block_meta(config["BLOCK_B"], config["num_warps"]), w, blocks, scales,
                    n_blocks)
    return blocks, scales


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                     name: str = "mxfp4", config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``blocks[..., N, K/32, 16]``, ``scales[..., N, K/32]`` (uint8) -> ``w[..., N, K]`` in ``dtype`` (fp32/bf16/fp16).

    Bit-identical to :func:`mxfp4_dequantize_torch` (values past ``dtype``'s range overflow to inf or flush,
    as a single rounding would). ``name`` labels the tensors in errors; a 0xFF scale is rejected. ``config``: an
    ``mxfp4_dequantize`` config (None: the tuning database's), validated (:class:`~dsa_triton.ConfigError`).
    ``out``: optional contiguous ``[..., N, K]`` tensor in ``dtype`` to write (and return).
    """
    validate_mxfp4(name, blocks, scales)
    device = check_kernel_device(f"{name}_blocks", blocks)
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {dtype}")
    shape = _flat_shape(tuple(blocks.shape[:-2]) + (blocks.shape[-2] * BLOCK,))
    if config is None:
        config = DEQUANTIZE.launch_config("load", shape, device)
    else:
        config = DEQUANTIZE.validate(config, shape)
    return dequantize_launch(blocks, scales, dtype, config, out)


def dequantize_launch(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, config: dict,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mxfp4_dequantize` without the checks and the 0xFF scan (the registry times this): launch only; a given
    ``out`` is still checked (its shape, dtype, device and contiguity: what the kernel writes through)."""
    blocks, scales = blocks.contiguous(), scales.contiguous()
    shape = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    else:
        check_out(out, shape, dtype, blocks.device)
    n_blocks = scales.numel()
    if n_blocks:
        grid = (cdiv(n_blocks, config["BLOCK_B"]),)
        launch_with(_dequantize_kernel, grid, _block_meta(config["BLOCK_B"], config["num_warps"]), blocks, scales,
                    out, n_blocks)
    return out


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

def _dequantize_config(blocks: torch.Tensor, config: str | None) -> dict:
    """The launch config of an unchecked dequantization: the given one, else the database's for its flat shape."""
    shape = _flat_shape((*blocks.shape[:-2], blocks.shape[-2] * BLOCK))
    return op_config(config) or DEQUANTIZE.launch_config("load", shape, blocks.device)


@dsa_op("mxfp4_quantize")
def mxfp4_quantize_op(w: torch.Tensor, check_values: bool = True,
                      config: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dt.mxfp4_quantize`: ``w[..., N, K]`` -> ``(blocks uint8 [..., N, K/32, 16], scales uint8
    [..., N, K/32])``. ``check_values=False`` skips the argument checks and the finiteness scan."""
    if check_values:
        return mxfp4_quantize(w, config=op_config(config))
    return quantize_launch(w, op_config(config) or QUANTIZE.launch_config("load", _flat_shape(w.shape), w.device))


@mxfp4_quantize_op.register_fake
def _(w, check_values=True, config=None):
    blocks = w.new_empty((*w.shape[:-1], w.shape[-1] // 32, 16), dtype=torch.uint8)
    return blocks, w.new_empty((*w.shape[:-1], w.shape[-1] // 32), dtype=torch.uint8)


@dsa_op("mxfp4_dequantize")
def mxfp4_dequantize_op(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                        check_values: bool = True, config: str | None = None) -> torch.Tensor:
    """:func:`dt.mxfp4_dequantize`: ``w[..., N, K]`` in ``dtype``. ``check_values=False`` skips the argument checks
    and the 0xFF (NaN) scale scan."""
    if check_values:
        return mxfp4_dequantize(blocks, scales, dtype, config=op_config(config))
    return dequantize_launch(blocks, scales, dtype, _dequantize_config(blocks, config))


@mxfp4_dequantize_op.register_fake
def _(blocks, scales, dtype=torch.float32, check_values=True, config=None):
    return blocks.new_empty((*blocks.shape[:-2], blocks.shape[-2] * 32), dtype=dtype)


@dsa_op("mxfp4_dequantize_out", mutates_args=("out",))
def mxfp4_dequantize_out(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, check_values: bool = True,
                         config: str | None = None) -> None:
    """:func:`dt.mxfp4_dequantize` into ``out[..., N, K]`` (contiguous; its dtype, fp32/bf16/fp16, is the output's).
    ``check_values=False`` skips the argument checks (``out``'s are kept) and the 0xFF (NaN) scale scan."""
    check_tensor("out", out, dtype=(torch.float32, torch.bfloat16, torch.float16), contiguous_last=False)
    if check_values:
        mxfp4_dequantize(blocks, scales, out.dtype, config=op_config(config), out=out)
        return
    dequantize_launch(blocks, scales, out.dtype, _dequantize_config(blocks, config), out)


@mxfp4_dequantize_out.register_fake
def _(blocks, scales, out, check_values=True, config=None):
    return None
