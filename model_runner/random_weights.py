"""Random weights at a config's full widths, drawn on the device (no checkpoint file): for benchmarks and for a new
model's first tokens before its weights exist (``python -m model_runner generate --random-weights``).

Dense tensors follow :func:`.tiny.random_tensor`'s rule (projections ~ N(0, 1/fan_in), norms near 1, biases near 0),
in the activation dtype, the router, its bias and the indexer's ``weights_proj`` in fp32 (as
:func:`.loader.load_checkpoint` returns them). Routed experts are random MXFP4 bytes (every E2M1 code, rms about
2.9) with one E8M0 scale that makes the weights about N(0, 1/fan_in)-sized: a layer of E experts holds
``E x 3 x hidden x inter x 0.53`` bytes (384 experts of 6144 x 2048: 7.7 GB), so they are drawn straight on the
device.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .config import ModelConfig
from .errors import RunnerError
from .loader import FP32_NAMES, dense_shapes, mxfp4_shapes
from .tiny import random_tensor

E2M1_RMS = 2.9  # rms of the 16 E2M1 values drawn uniformly


def reduced(config: ModelConfig, layers: int) -> ModelConfig:
    """``config`` with ``layers`` layers at every width: its dense layers capped to one (none if it has none), then
    MoE layers (all dense when it has no MoE layer)."""
    if layers < 1:
        raise RunnerError(f"layers: must be at least 1, got {layers}")
    types = config.mlp_layer_types
    dense = min(1, types.count("dense"), layers) if "sparse" in types else layers
    return dataclasses.replace(config, num_hidden_layers=layers, first_k_dense_replace=dense, mlp_layer_types=())


def random_experts(config: ModelConfig, layer: int, generator: torch.Generator,
                   experts: range | None = None) -> dict[str, torch.Tensor]:
    """One MoE layer's MXFP4 experts ``experts`` (default all), stacked as the loader returns them:
    ``<L>.mlp.experts.{gate_up,down}_proj_{blocks [E, N, K/32, 16], scales [E, N, K/32]}`` uint8 on
    ``generator``'s device."""
    device = generator.device
    count = config.n_routed_experts if experts is None else len(experts)
    out = {}
    for name, shape in mxfp4_shapes(config, layer).items():
        shape = (count, *shape[1:])
        if name.endswith("_blocks"):
            out[name] = torch.randint(0, 256, shape, generator=generator, device=device, dtype=torch.uint8)
        else:
            k = shape[-1] * 32
            exponent = 127 - round(math.log2(k * E2M1_RMS ** 2) / 2)  # 2^(e - 127) ~ (k * 2.9^2)^-0.5
            out[name] = torch.full(shape, exponent, dtype=torch.uint8, device=device)
    return out


def random_weights(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0,
                   experts: range | None = None) -> dict[str, torch.Tensor]:
    """Every weight :class:`.model.Model` takes for ``config`` (names and formats of :func:`.loader.load_checkpoint`;
    ``experts``: only these experts of each MoE layer, as a rank of expert parallel holds them), drawn on
    ``device`` from ``seed``."""
    g = torch.Generator(device).manual_seed(seed)
    weights = {name: random_tensor(name, shape, g).to(torch.float32 if name.endswith(FP32_NAMES) else dtype)
               for name, shape in dense_shapes(config).items()}
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            for name, t in random_experts(config, i, g, experts).items():
                weights[name.replace("_proj_", "_")] = t  # the loader's names: ...experts.gate_up_blocks
    return weights
