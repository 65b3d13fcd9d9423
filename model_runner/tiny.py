"""Small random checkpoints in the Hugging Face layout of any family (``python -m model_runner make-tiny``, tests):
config.json, generation_config.json, a byte-level BPE tokenizer.json, and the weights in one ``model.safetensors``
or shards with ``model.safetensors.index.json``.

Weights: the family's ``random_tensors`` (projections ~ N(0, 1/fan_in), norms near 1, biases near 0, drawn in bf16
in one fixed order whatever the formats, so every format of one seed holds the same values up to its rounding).
Experts: ``mxfp4`` (as the family ships MXFP4 / FP4 experts), ``bf16`` or ``fp8``; dense: ``bf16``, or ``fp8``:
the projections as e4m3 with power-of-two 128 x 128 block scales (DeepSeek's ``ue8m0``), so that the dequantized
bf16 twin is exact.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .checkpoint_writer import TOKENIZER_VOCAB, save_checkpoint, write_tokenizer
from .families import FAMILIES, family, family_of

EXPERT_FORMATS = ("mxfp4", "bf16", "fp8")
DENSE_FORMATS = ("bf16", "fp8")
ARCHS = tuple(FAMILIES)  # make-tiny --arch
DEFAULT_ARCH = "deepseek_v32"


def random_tensors(config, experts: str = "mxfp4", dense: str = "bf16", seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights of a random checkpoint of ``config`` in the given formats (module docstring)."""
    return family_of(config).random_tensors(config, experts, dense, seed)


def save_random_checkpoint(config, folder: str | Path, experts: str = "mxfp4", dense: str = "bf16",
                           shards: int = 1, seed: int = 0) -> None:
    """A random checkpoint of ``config`` (weights only, with config.json); an FP8 format sets its
    ``quantization_config``."""
    if experts not in EXPERT_FORMATS or dense not in DENSE_FORMATS:
        raise ValueError(f"experts / dense: must be one of {EXPERT_FORMATS} / {DENSE_FORMATS}, got {experts}, {dense}")
    fp8 = "fp8" in (experts, dense)
    config = dataclasses.replace(config, quantization="fp8" if fp8 else None)
    save_checkpoint(random_tensors(config, experts, dense, seed), config, folder, shards)


def make_tiny(folder: str | Path, experts: str = "mxfp4", dense: str = "bf16", shards: int = 1, seed: int = 0,
              arch: str = DEFAULT_ARCH, **overrides) -> None:
    """The ``arch`` family's tiny config (its vocabulary the tokenizer's) as a full checkpoint folder."""
    config = family(arch).tiny_config(vocab_size=TOKENIZER_VOCAB, **overrides)
    save_random_checkpoint(config, folder, experts, dense, shards, seed)
    write_tokenizer(folder)
