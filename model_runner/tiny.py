"""Small random checkpoints in the Hugging Face layout (``python -m model_runner make-tiny``, tests): config.json,
generation_config.json, a byte-level BPE tokenizer.json, and the weights in one ``model.safetensors`` or shards
with ``model.safetensors.index.json``.

Weights: projections ~ N(0, 1/fan_in), norms near 1, biases near 0, drawn in bf16 in one fixed order whatever the
formats, so every format of one seed holds the same values up to its rounding. Experts: ``mxfp4`` (stacked blocks
and scales), ``bf16`` or ``fp8`` (one by one). Dense: ``bf16``, or ``fp8``: every projection in the layers but the
router and the indexer's ``weights_proj`` as e4m3 with power-of-two 128 x 128 block scales (DeepSeek-V3.2's
``ue8m0``), so that its dequantized bf16 twin is exact.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsa_triton.linear.formats import quantize_fp8_blockwise
from dsa_triton.moe.mxfp4_reference import mxfp4_quantize_torch

from .config import ModelConfig, tiny_config
from .loader import INDEX_FILE, SINGLE_FILE, dense_shapes, expert_shapes, scale_name

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOKENIZER_VOCAB = 258  # BOS, EOS and the 256 bytes
EXPERT_FORMATS = ("mxfp4", "bf16", "fp8")
DENSE_FORMATS = ("bf16", "fp8")


def random_tensors(config: ModelConfig, experts: str = "mxfp4", dense: str = "bf16",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights of a random checkpoint of ``config`` in the given formats (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    shapes = dict(dense_shapes(config))
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    for i in moe_layers:
        for e in range(config.n_routed_experts):
            shapes.update(expert_shapes(config, i, e))
    tensors = {name: random_tensor(name, shape, g) for name, shape in shapes.items()}
    fp8_names = [n for n in tensors if n.startswith("model.layers.") and tensors[n].dim() == 2
                 and not n.endswith(("mlp.gate.weight", "indexer.weights_proj.weight"))
                 and (".experts." in n and experts == "fp8" or ".experts." not in n and dense == "fp8")]
    for name in fp8_names:
        tensors[name], tensors[scale_name(name)] = quantize_fp8_blockwise(tensors[name], power_of_two=True)
    if experts == "mxfp4":
        for i in moe_layers:
            p = f"model.layers.{i}.mlp.experts."
            for proj, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
                w = torch.stack([torch.cat([tensors.pop(f"{p}{e}.{part}.weight") for part in parts])
                                 for e in range(config.n_routed_experts)])
                tensors[f"{p}{proj}_proj_blocks"], tensors[f"{p}{proj}_proj_scales"] = mxfp4_quantize_torch(w.float())
    return tensors


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One dense tensor by the rule of the module docstring, on ``generator``'s device."""
    t = torch.randn(shape, generator=generator, device=generator.device)
    if name.endswith("norm.weight"):
        t = 1 + 0.1 * t
    elif name.endswith("bias"):
        t = 0.1 * t
    elif name != "model.embed_tokens.weight":
        t = t * shape[-1] ** -0.5
    return t.to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)


def save_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig, folder: str | Path, shards: int = 1) -> None:
    """Write ``config.json`` and the tensors: one ``model.safetensors``, or ``shards`` files and their index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.to_json(folder / "config.json")
    if shards == 1:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / SINGLE_FILE))
        return
    names, weight_map = list(tensors), {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def save_random_checkpoint(config: ModelConfig, folder: str | Path, experts: str = "mxfp4", dense: str = "bf16",
                           shards: int = 1, seed: int = 0) -> None:
    """A random checkpoint of ``config`` (weights only, with config.json); ``dense="fp8"`` sets its
    ``quantization_config``."""
    if experts not in EXPERT_FORMATS or dense not in DENSE_FORMATS:
        raise ValueError(f"experts / dense: must be one of {EXPERT_FORMATS} / {DENSE_FORMATS}, got {experts}, {dense}")
    fp8 = "fp8" in (experts, dense)
    config = dataclasses.replace(config, quantization="fp8" if fp8 else None)
    save_checkpoint(random_tensors(config, experts, dense, seed), config, folder, shards)


def write_tokenizer(folder: str | Path) -> None:
    """A byte-level BPE ``tokenizer.json`` without merges: ids 0 (BOS) and 1 (EOS), then the 256 bytes; encoding
    prepends BOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {BOS: 0, EOS: 1, **{ch: i + 2 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tokenizer.save(str(Path(folder) / "tokenizer.json"))


def make_tiny(folder: str | Path, experts: str = "mxfp4", dense: str = "bf16", shards: int = 1, seed: int = 0,
              **overrides) -> None:
    """:func:`.config.tiny_config` (its vocabulary the tokenizer's) as a full checkpoint folder."""
    config = tiny_config(vocab_size=TOKENIZER_VOCAB, **overrides)
    save_random_checkpoint(config, folder, experts, dense, shards, seed)
    write_tokenizer(folder)
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (Path(folder) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
