"""MXFP4 quantize / dequantize kernels (OCP MX, gpt-oss layout): ``dt.mxfp4_quantize``, ``dt.mxfp4_dequantize``.

The format and the oracle are in :mod:`.mxfp4_reference`; these kernels match it bit for bit (codes,
scales and dequantized values). One program handles ``BLOCK_B`` consecutive 32-element blocks of the
flattened weight, so any leading shape ``[..., N, K]`` works. The E2M1 helpers here
(:func:`e2m1_code`, :func:`e2m1_bits`) are shared with the MXFP4 -> FP8 conversion.
"""
from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

from .. import registry
from ..checks import check_kernel_device, check_tensor, exact_mismatch
from ..hostmath import cdiv
from ..registry import Cost
from . import mxfp4_reference
from .mxfp4_reference import BLOCK, mxfp4_dequantize_torch, mxfp4_quantize_torch, validate_mxfp4

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def e2m1_code(x):
    """E2M1 code (int32 0..15) of fp32 ``x`` already divided by its block scale: nearest even, saturating at 6."""
    a = tl.abs(x)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    code += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return code | ((x < 0).to(tl.int32) << 3)


@triton.jit
def e2m1_bits(code, exp_field):
    """fp32 bit pattern (int32) of E2M1 ``code`` times ``2^(exp_field - 127)``; needs 2 <= exp_field <= 249.

    Built from the code's 2 exponent bits and 1 mantissa bit: magnitude m >= 2 is
    ``2^((m >> 1) - 1) * (1 + (m & 1) / 2)``, m = 1 is 0.5, m = 0 is 0.
    """
    mag = code & 7
    bits = (mag << 22) + ((exp_field - 1) << 23) - ((mag == 1).to(tl.int32) << 22)
    bits = tl.where(mag == 0, 0, bits)
    return bits | ((code & 8) << 28)


@triton.jit
def widen_to_fp32(x):
    """fp32 of a loaded fp32/fp16/bf16 tensor; bf16 is widened by its bits (exact, subnormals too, where the
    interpreter's cast is wrong)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _quantize_kernel(w_ptr, blocks_ptr, scales_ptr, n_blocks, BLOCK_B: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    inside = b < n_blocks
    w = widen_to_fp32(tl.load(w_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=inside[:, None], other=0.0))
    amax = tl.max(tl.abs(w), axis=1)
    # floor(log2(amax)) - 2 + 127, clamped at 0: the biased fp32 exponent of amax minus 2 (subnormals give 0)
    scale = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 2, 0)
    inv_scale = ((254 - scale) << 23).to(tl.float32, bitcast=True)  # 2^(127 - scale), a normal fp32
    code = e2m1_code(w * inv_scale[:, None])
    even, odd = tl.split(tl.reshape(code, [BLOCK_B, 16, 2]))
    packed = (even | (odd << 4)).to(tl.uint8)
    tl.store(blocks_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], packed, mask=inside[:, None])
    tl.store(scales_ptr + b, scale.to(tl.uint8), mask=inside)


@triton.jit
def _dequantize_kernel(blocks_ptr, scales_ptr, out_ptr, n_blocks, BLOCK_B: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    inside = b < n_blocks
    packed = tl.load(blocks_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], mask=inside[:, None], other=0).to(tl.int32)
    scale = tl.load(scales_ptr + b, mask=inside, other=127).to(tl.int32)
    # 2^(scale - 127) as max(scale, 1) in the exponent field, halved once more for scale 0 (a subnormal)
    factor = (tl.maximum(scale, 1) << 23).to(tl.float32, bitcast=True) * tl.where(scale == 0, 0.5, 1.0)
    lo = e2m1_bits(packed & 0xF, 127).to(tl.float32, bitcast=True)
    hi = e2m1_bits(packed >> 4, 127).to(tl.float32, bitcast=True)
    values = tl.reshape(tl.join(lo, hi), [BLOCK_B, 32]) * factor[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # every MXFP4 value has <= 2 significant bits, so bf16 is the fp32 pattern's top half (exact, and
        # right for bf16 subnormals, which the interpreter's cast gets wrong)
        out = (values.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = values.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], out, mask=inside[:, None])


def _flat_shape(w_shape: tuple[int, ...]) -> dict[str, int]:
    return {"N": math.prod(w_shape[:-1]), "K": w_shape[-1]}


def mxfp4_quantize(w: torch.Tensor, *, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w[..., N, K]`` (fp32 / bf16 / fp16, finite, K % 32 == 0; pad with ``pad_k``) to MXFP4.

    Returns ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])``, bit-identical to
    :func:`mxfp4_quantize_torch`. A load-time op: it checks finiteness (one device sync).
    """
    check_tensor("w", w, dtype=WEIGHT_DTYPES, contiguous_last=False)
    device = check_kernel_device("w", w)
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], got shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"w: K = {w.shape[-1]} must be a multiple of {BLOCK} (pad with zeros: pad_k)")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w: holds NaN or inf, which MXFP4 cannot represent")
    return quantize_launch(w, config or QUANTIZE.launch_config("load", _flat_shape(tuple(w.shape)), device))


def quantize_launch(w: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mxfp4_quantize` without the argument checks (the registry times this): launch only."""
    w = w.contiguous()
    blocks = torch.empty(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(blocks.shape[:-1], dtype=torch.uint8, device=w.device)
    n_blocks = scales.numel()
    if n_blocks:
        grid = (cdiv(n_blocks, config["BLOCK_B"]),)
        _quantize_kernel[grid](w, blocks, scales, n_blocks, BLOCK_B=config["BLOCK_B"], num_warps=config["num_warps"])
    return blocks, scales


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                     name: str = "mxfp4", config: dict | None = None) -> torch.Tensor:
    """``blocks[..., N, K/32, 16]``, ``scales[..., N, K/32]`` (uint8) -> ``w[..., N, K]`` in ``dtype`` (fp32/bf16/fp16).

    Bit-identical to :func:`mxfp4_dequantize_torch` (values past ``dtype``'s range overflow to inf or flush,
    as a single rounding would). ``name`` labels the tensors in errors; a 0xFF scale is rejected.
    """
    validate_mxfp4(name, blocks, scales)
    device = check_kernel_device(f"{name}_blocks", blocks)
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {dtype}")
    shape = _flat_shape(tuple(blocks.shape[:-2]) + (blocks.shape[-2] * BLOCK,))
    return dequantize_launch(blocks, scales, dtype, config or DEQUANTIZE.launch_config("load", shape, device))


def dequantize_launch(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, config: dict) -> torch.Tensor:
    """:func:`mxfp4_dequantize` without the checks and the 0xFF scan (the registry times this): launch only."""
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * BLOCK, dtype=dtype, device=blocks.device)
    n_blocks = scales.numel()
    if n_blocks:
        grid = (cdiv(n_blocks, config["BLOCK_B"]),)
        _dequantize_kernel[grid](blocks, scales, out, n_blocks, BLOCK_B=config["BLOCK_B"], num_warps=config["num_warps"])
    return out


# -- registry -----------------------------------------------------------------------------------
def random_weights(n: int, k: int, device, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Fresh weights ``[n, k]`` whose rows span magnitudes (1e-6 .. 1e3), so scales vary over the blocks."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device)
    spread = torch.exp2(torch.randint(-20, 10, (n, 1), generator=g, device=device).float())
    return (w * spread).to(dtype)


def random_mxfp4(shape: tuple[int, ...], k: int, device, seed: int, spread: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``(blocks [*shape, k/32, 16], scales [*shape, k/32])``: every code, scales 127 +- ``spread``."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, k // BLOCK, BLOCK // 2), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(127 - spread, 128 + spread, (*shape, k // BLOCK), generator=g, device=device).to(torch.uint8)
    return blocks, scales


def realistic_mxfp4(shape: tuple[int, ...], k: int, device, seed: int, outliers: float = 1e-3
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 shaped like a trained layer's: every code, scales within a few binades per row (a base of 2^-7 +- 2,
    each block +-1 around it, as the amax of 32 Gaussian weights varies), and a fraction ``outliers`` of blocks
    15..40 binades below their row (near-dead inputs): the ones the FP8 conversion cannot fit."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, k // BLOCK, BLOCK // 2), generator=g, device=device, dtype=torch.uint8)
    base = torch.randint(118, 123, (*shape, 1), generator=g, device=device)
    scales = base + torch.randint(-1, 2, (*shape, k // BLOCK), generator=g, device=device)
    low = torch.rand(scales.shape, generator=g, device=device) < outliers
    drop = torch.randint(15, 41, scales.shape, generator=g, device=device)
    return blocks, torch.where(low, scales - drop, scales).to(torch.uint8)


def _compare_exact(out, ref) -> str | None:
    out, ref = (out,) if isinstance(out, torch.Tensor) else out, (ref,) if isinstance(ref, torch.Tensor) else ref
    return exact_mismatch((f"output {i}", a, b) for i, (a, b) in enumerate(zip(out, ref)))


_SPACE = {"BLOCK_B": (8, 16, 32, 64, 128), "num_warps": (1, 2, 4, 8)}


def _default(phase, shape):
    return {"BLOCK_B": 64, "num_warps": 4} if shape["N"] * shape["K"] >= 2**20 else {"BLOCK_B": 16, "num_warps": 2}


def _bench_shapes(phase, gpu):
    return [{"N": 8192, "K": 7168}, {"N": 7168, "K": 2048}] if gpu else [{"N": 24, "K": 96}]


def _register(name: str, make_inputs, run, reference, reference_name: str) -> registry.KernelSpec:
    """The two load-time kernels share space, defaults, shapes, exact comparison and cost (both move 2.53 bytes
    per weight: bf16 one way, 4.25-bit MXFP4 the other); the float64 oracle is also the baseline."""
    return registry.register(registry.KernelSpec(
        name=name,
        phases=("load",),
        space=_SPACE,
        default=_default,
        fixed_dims=("K",),
        bucketed_dims=("N",),
        make_inputs=make_inputs,
        run=run,
        reference=reference,
        compare=_compare_exact,
        cost=lambda phase, shape: Cost(bytes=shape["N"] * shape["K"] * (2 + 0.5 + 1 / BLOCK)),
        bench_shapes=_bench_shapes,
        baseline=reference,
        baseline_name=f"{reference_name} (float64 torch ops)",
        source_modules=(sys.modules[__name__], mxfp4_reference),
    ))


QUANTIZE = _register(
    "mxfp4_quantize",
    make_inputs=lambda phase, shape, device, seed: {"w": random_weights(shape["N"], shape["K"], device, seed)},
    run=lambda inputs, config: quantize_launch(inputs["w"], config),  # the op adds a finiteness scan (a sync)
    reference=lambda inputs: mxfp4_quantize_torch(inputs["w"]),
    reference_name="mxfp4_quantize_torch",
)

DEQUANTIZE = _register(
    "mxfp4_dequantize",
    make_inputs=lambda phase, shape, device, seed: dict(zip(("blocks", "scales"), random_mxfp4((shape["N"],), shape["K"], device, seed, spread=40))),
    run=lambda inputs, config: dequantize_launch(inputs["blocks"], inputs["scales"], torch.bfloat16, config),
    reference=lambda inputs: mxfp4_dequantize_torch(inputs["blocks"], inputs["scales"], torch.bfloat16),
    reference_name="mxfp4_dequantize_torch",
)
