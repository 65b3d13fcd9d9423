"""Random weights at a config's full widths, drawn on the device (no checkpoint file): for benchmarks and for a new
model's first tokens before its weights exist (``python -m model_runner generate --random-weights``). Each family
draws its own (names and formats of its loader): dense tensors by :func:`.random_draws.random_tensor`'s rule
(projections ~ N(0, 1/fan_in), norms near 1, biases near 0) in the activation dtype, what its loader keeps in fp32
in fp32; routed experts as random MXFP4 bytes (:func:`.random_draws.random_mxfp4`): a layer of E experts holds
``E x 3 x hidden x inter x 0.53`` bytes (384 experts of 6144 x 2048: 7.7 GB), so they are drawn straight on the
device.
"""
from __future__ import annotations

import torch

from .families import family_of


def reduced(config, layers: int):
    """``config`` with ``layers`` layers at every width (which layer types it keeps: its family's ``reduced``)."""
    return family_of(config).reduced(config, layers)


def random_weights(config, dtype: torch.dtype, device, seed: int = 0, experts: range | None = None) -> dict:
    """Every weight ``config``'s model takes, drawn on ``device`` from ``seed`` (``experts``: only these experts of
    each MoE layer, as a rank of expert parallel holds them)."""
    return family_of(config).random_weights(config, dtype, device, seed, experts)
