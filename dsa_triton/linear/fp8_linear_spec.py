"""Registry entry of the blockwise-FP8 linear (``fp8_blockwise_linear``).

Config space: ``BLOCK_M`` x ``BLOCK_N`` output tile per program, ``BLOCK_K`` (a divisor of the 128-wide scale
block), ``GROUP_M`` row tiles per program group (L2 reuse of weight tiles), ``num_warps``, ``num_stages``.
Shape: ``M`` rows (tokens, bucketed), ``N`` x ``K`` the weight (exact). Phase: decode up to
``DECODE_MAX_ROWS`` rows, prefill above.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import next_pow2
from ..registry import Cost, KernelSpec
from . import fp8_linear, fp8_linear_kernels, fp8_linear_reference
from .fp8_linear_reference import dequantize_fp8_blockwise, fp8_blockwise_linear_torch, quantize_fp8_blockwise

DECODE_MAX_ROWS = 64
SMEM_BYTES = 232448  # Hopper's shared memory per block (227 KiB)
ACC_REGISTERS = 128  # fp32 accumulator registers per thread at most


def linear_shape(M: int, N: int, K: int) -> tuple[str, dict[str, int]]:
    """Phase and registry shape of a call."""
    return ("decode" if M <= DECODE_MAX_ROWS else "prefill"), {"M": M, "N": N, "K": K}


def _constraint(config, shape) -> str | None:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if bm > max(16, next_pow2(shape["M"])):
        return f"BLOCK_M={bm} is taller than the {shape['M']} rows"
    if bn > max(32, next_pow2(shape["N"])):
        return f"BLOCK_N={bn} is wider than N={shape['N']}"
    if bm * bn / (32 * config["num_warps"]) > ACC_REGISTERS:
        return f"the {bm}x{bn} accumulator needs more than {ACC_REGISTERS} registers a thread: more warps"
    stage_bytes = bm * bk * 2 + bk * bn  # pipelined loads: activations (2 bytes) and e4m3 weights
    smem = config["num_stages"] * stage_bytes + bk * bn * 2  # plus one 16-bit copy of the weight tile for the dot
    if smem > SMEM_BYTES:
        return f"{config['num_stages']} stages of {stage_bytes} bytes and the converted weight tile exceed shared memory"
    return None


def _default(phase, shape) -> dict:
    """Until tuned: tiles that compile for sm_90 without register spills (ptxas, bf16 activations)."""
    if phase == "decode":
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    config["BLOCK_N"] = min(config["BLOCK_N"], max(32, next_pow2(shape["N"])))
    config["BLOCK_M"] = min(config["BLOCK_M"], max(16, next_pow2(shape["M"])))
    return config


def _make_inputs(phase, shape, device, seed) -> dict:
    """Activations ``N(0, 1)`` (bf16 on a GPU, fp16 in the interpreter) and weights ``N(0, 1/K)`` quantized with
    per-block scales that are not powers of two (DeepSeek-V3's format), one block 100x larger than the rest."""
    g = torch.Generator(device=device).manual_seed(seed)
    M, N, K = shape["M"], shape["N"], shape["K"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    w = torch.randn(N, K, generator=g, device=device) * K ** -0.5
    w[: min(N, 128), : min(K, 128)] *= 100
    weight, scale = quantize_fp8_blockwise(w)
    return {"x": torch.randn(M, K, generator=g, device=device).to(dtype), "weight": weight, "weight_scale_inv": scale}


def _args(inputs):
    return inputs["x"], inputs["weight"], inputs["weight_scale_inv"]


def _reference(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's ``y`` and the error scale ``|x| @ |W|.T`` (fp32): what the sum's rounding is relative to."""
    x, weight, scale = _args(inputs)
    return fp8_blockwise_linear_torch(x, weight, scale), x.float().abs() @ dequantize_fp8_blockwise(weight, scale).abs().t()


def _compare(out, ref) -> str | None:
    """Within 2 units of the output dtype's precision of the oracle, plus ``2^-16`` of the error scale (fp32 sums
    in another order)."""
    expected, bound = ref
    if out.shape != expected.shape or out.dtype != expected.dtype:
        return f"{out.dtype}{tuple(out.shape)} vs reference {expected.dtype}{tuple(expected.shape)}"
    err = (out.float() - expected.float()).abs()
    tol = 2 * torch.finfo(out.dtype).eps * expected.float().abs() + 2.0 ** -16 * bound
    bad = ~(err <= tol)
    return f"{int(bad.sum())} of {out.numel()} elements differ (max error {err.max().item():.3g})" if bad.any() else None


def _cost(phase, shape) -> Cost:
    M, N, K = shape["M"], shape["N"], shape["K"]
    scales = -(-N // 128) * -(-K // 128) * 4
    return Cost(bytes=M * K * 2 + N * K + scales + M * N * 2, flops=2.0 * M * N * K, flop_dtype="bf16")


def _bench_shapes(phase, gpu) -> list[dict[str, int]]:
    """GPU: DeepSeek-V3.2's q_b_proj (24576 x 1536) and o_proj (7168 x 16384); CPU: odd sizes."""
    if gpu:
        rows = (16, 64) if phase == "decode" else (4096,)
        return [{"M": m, "N": n, "K": k} for m in rows for n, k in ((24576, 1536), (7168, 16384))]
    return [{"M": 3, "N": 200, "K": 300}] if phase == "decode" else [{"M": 70, "N": 130, "K": 260}]


SPEC = registry.register(KernelSpec(
    name="fp8_blockwise_linear",
    phases=("decode", "prefill"),
    space={"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (32, 64, 128, 256), "BLOCK_K": (32, 64, 128),
           "GROUP_M": (1, 8), "num_warps": (4, 8), "num_stages": (2, 3, 4)},
    default=_default,
    fixed_dims=("N", "K"),
    bucketed_dims=("M",),
    make_inputs=_make_inputs,
    run=lambda inputs, config: fp8_linear.fp8_blockwise_linear(*_args(inputs), config=config, check_values=False),
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=lambda inputs: inputs["x"] @ dequantize_fp8_blockwise(inputs["weight"], inputs["weight_scale_inv"],
                                                                     inputs["x"].dtype).t(),
    baseline_name="dequantize to the activation dtype + torch.matmul",
    source_modules=(fp8_linear_kernels, fp8_linear_reference, fp8_linear, sys.modules[__name__]),
))
