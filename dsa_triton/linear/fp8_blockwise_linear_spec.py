"""Registry entry of :func:`~dsa_triton.fp8_blockwise_linear`. Shape: ``M`` rows (tokens, bucketed), ``N`` x ``K``
the weight (exact)."""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..registry import Cost, KernelSpec
from . import fp8_blockwise_linear, fp8_blockwise_linear_kernels, fp8_blockwise_linear_reference, formats
from .fp8_blockwise_linear_reference import fp8_blockwise_linear_torch
from .formats import dequantize_fp8_blockwise, quantize_fp8_blockwise

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
    launch=fp8_blockwise_linear.LAUNCH,
    make_inputs=_make_inputs,
    run=lambda inputs, config: fp8_blockwise_linear.fp8_blockwise_linear(*_args(inputs), config=config,
                                                                         check_values=False),
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=lambda inputs: inputs["x"] @ dequantize_fp8_blockwise(inputs["weight"], inputs["weight_scale_inv"],
                                                                     inputs["x"].dtype).t(),
    baseline_name="dequantize to the activation dtype + torch.matmul",
    model_dims=lambda m: m.dense_gemms(),
    count_roles={"M": "tokens"},
    source_modules=(fp8_blockwise_linear_kernels, fp8_blockwise_linear_reference, fp8_blockwise_linear, formats,
                    sys.modules[__name__]),
))
