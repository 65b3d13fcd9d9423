"""Registry entries of the MXFP4 load-time kernels (:func:`~dsa_triton.mxfp4_quantize`,
:func:`~dsa_triton.mxfp4_dequantize`), and the random MXFP4 inputs other specs and tests draw from
(:func:`random_mxfp4`, :func:`realistic_mxfp4`). Shape: ``N`` rows (every leading dimension flattened, bucketed),
``K`` elements per row (exact).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..checks import exact_mismatch
from ..registry import Cost
from . import formats, mxfp4, mxfp4_kernels, mxfp4_reference
from .formats import BLOCK
from .mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch


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


def _bench_shapes(phase, gpu):
    return [{"N": 8192, "K": 7168}, {"N": 7168, "K": 2048}] if gpu else [{"N": 24, "K": 96}]


def _register(launch, make_inputs, run, reference, reference_name: str) -> registry.KernelSpec:
    """The two load-time kernels share space, defaults, shapes, exact comparison and cost (both move 2.53 bytes
    per weight: bf16 one way, 4.25-bit MXFP4 the other); the float64 oracle is also the baseline."""
    return registry.register(registry.KernelSpec(
        launch=launch,
        make_inputs=make_inputs,
        run=run,
        reference=reference,
        compare=_compare_exact,
        cost=lambda phase, shape: Cost(bytes=shape["N"] * shape["K"] * (2 + 0.5 + 1 / BLOCK)),
        bench_shapes=_bench_shapes,
        baseline=reference,
        baseline_name=f"{reference_name} (float64 torch ops)",
        source_modules=(mxfp4, mxfp4_kernels, sys.modules[__name__], mxfp4_reference, formats),
        model_dims=lambda m: [{"N": g["N"], "K": g["K"]} for g in m.expert_gemms()],
    ))


QUANTIZE = _register(
    mxfp4.QUANTIZE,
    make_inputs=lambda phase, shape, device, seed: {"w": random_weights(shape["N"], shape["K"], device, seed)},
    run=lambda inputs, config: mxfp4.quantize_launch(inputs["w"], config),  # the op adds a finiteness scan (a sync)
    reference=lambda inputs: mxfp4_quantize_torch(inputs["w"]),
    reference_name="mxfp4_quantize_torch",
)

DEQUANTIZE = _register(
    mxfp4.DEQUANTIZE,
    make_inputs=lambda phase, shape, device, seed: dict(zip(("blocks", "scales"), random_mxfp4((shape["N"],), shape["K"], device, seed, spread=40))),
    run=lambda inputs, config: mxfp4.dequantize_launch(inputs["blocks"], inputs["scales"], torch.bfloat16, config),
    reference=lambda inputs: mxfp4_dequantize_torch(inputs["blocks"], inputs["scales"], torch.bfloat16),
    reference_name="mxfp4_dequantize_torch",
)
