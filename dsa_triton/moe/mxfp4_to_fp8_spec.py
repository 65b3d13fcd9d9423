"""Registry entry of the MXFP4 -> FP8 conversion, :func:`~dsa_triton.mxfp4_to_fp8`. Shape: ``G`` experts converted
per call (bucketed), ``N`` rows and ``K`` elements per row (exact).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..registry import Cost
from . import formats, mxfp4_to_fp8, mxfp4_to_fp8_kernels, mxfp4_to_fp8_reference
from .mxfp4_spec import realistic_mxfp4
from .formats import BLOCK, n_groups
from .mxfp4_to_fp8_reference import mxfp4_to_fp8_torch


def compare_conversion(out, ref) -> str | None:
    """``out = (w, scale, n_unfit)`` (an int or a one-element tensor) against ``ref = fp8_conversion_torch(...)``:
    scales and the unfit count exact, FP8 bytes exact in every block that fits (an unfit block's rounding is the
    hardware's)."""
    (w, s, n_unfit), (rw, rs, lost) = out, ref
    n_unfit = int(n_unfit)
    if w.shape != rw.shape or s.shape != rs.shape:
        return f"shapes {tuple(w.shape)}, {tuple(s.shape)}; reference {tuple(rw.shape)}, {tuple(rs.shape)}"
    if not torch.equal(s, rs):
        return f"group scales: {int((s != rs).sum())} of {s.numel()} differ"
    if n_unfit != int(lost.sum()):
        return f"unfit blocks: {n_unfit}, reference {int(lost.sum())}"
    same = (w.view(torch.uint8) == rw.view(torch.uint8)).unflatten(-1, (-1, BLOCK)).all(-1)
    bad = ~same & ~lost
    return f"fp8 weights: {int(bad.sum())} fitting blocks differ" if bool(bad.any()) else None


def _make_inputs(phase, shape, device, seed):
    """Trained-layer-like MXFP4 with a few far-below blocks (0.2 %, at least 16 expected): both kernel paths
    run and some blocks are unfit."""
    n_blocks = shape["G"] * shape["N"] * shape["K"] // BLOCK
    blocks, scales = realistic_mxfp4((shape["G"], shape["N"]), shape["K"], device, seed,
                                     outliers=max(2e-3, 16 / n_blocks))
    return {"blocks": blocks, "scales": scales}


def _run(inputs, config):
    """The conversion kernel alone: the op adds the load-time 0xFF scan and reads the unfit count (two syncs)."""
    blocks, scales = inputs["blocks"], inputs["scales"]
    g, n, kb = scales.shape
    w = torch.empty(g, n, kb * BLOCK, dtype=torch.float8_e4m3fn, device=blocks.device)
    s = torch.empty(g, n, n_groups(kb * BLOCK), dtype=torch.float32, device=blocks.device)
    return w, s, mxfp4_to_fp8.convert_all(blocks, scales, w, s, config)


def _cost(phase, shape) -> Cost:
    g, n, k = shape["G"], shape["N"], shape["K"]
    return Cost(bytes=g * n * k * (0.5 + 1 / BLOCK + 1) + g * n * n_groups(k) * 4)


SPEC = registry.register(registry.KernelSpec(
    launch=mxfp4_to_fp8.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=lambda inputs: mxfp4_to_fp8_reference.fp8_conversion_torch(inputs["blocks"], inputs["scales"]),
    compare=compare_conversion,
    cost=_cost,
    bench_shapes=lambda phase, gpu: ([{"G": 8, "N": 4096, "K": 7168}, {"G": 8, "N": 7168, "K": 2048}] if gpu
                                     else [{"G": 3, "N": 20, "K": 160}]),
    baseline=lambda inputs: mxfp4_to_fp8_torch(inputs["blocks"], inputs["scales"]),
    baseline_name="mxfp4_to_fp8_torch (float64 torch ops)",
    model_dims=lambda m: [{"N": g["N"], "K": g["K"]} for g in m.expert_gemms()],
    source_modules=(mxfp4_to_fp8, mxfp4_to_fp8_kernels, sys.modules[__name__], mxfp4_to_fp8_reference, formats),
))
