"""The rules random weights follow (random checkpoints and ``--random-weights``): dense tensors by name, MXFP4
experts as random bytes with one scale that makes them about N(0, 1/fan_in)."""
from __future__ import annotations

import math

import torch

E2M1_RMS = 2.9  # rms of the 16 E2M1 values drawn uniformly


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One dense tensor on ``generator``'s device: norms near 1 (``1 + 0.1 N(0, 1)``), biases near 0 (``0.1 N(0, 1)``),
    the embedding N(0, 1), projections N(0, 1/fan_in); bf16, fp32 for the router's correction bias."""
    t = torch.randn(shape, generator=generator, device=generator.device)
    if name.endswith("norm.weight"):
        t = 1 + 0.1 * t
    elif name.endswith("bias"):
        t = 0.1 * t
    elif name != "model.embed_tokens.weight":
        t = t * shape[-1] ** -0.5
    return t.to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[..., N, K]`` as MXFP4 ``blocks [..., N, K/32, 16]`` (random bytes: every E2M1 code, rms about 2.9)
    and ``scales [..., N, K/32]`` (one E8M0 value, ``2^(s - 127) ~ (K x 2.9^2)^-0.5``), uint8 on ``generator``'s
    device."""
    *lead, n, k = shape
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), generator=generator, device=generator.device,
                           dtype=torch.uint8)
    exponent = 127 - round(math.log2(k * E2M1_RMS ** 2) / 2)
    return blocks, torch.full((*lead, n, k // 32), exponent, dtype=torch.uint8, device=generator.device)
