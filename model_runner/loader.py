"""Checkpoints: sharded safetensors with ``model.safetensors.index.json`` (its ``weight_map``: tensor -> shard).

Tensor names (Hugging Face DeepSeek-V3.2; ``L = model.layers.{i}``):

- ``model.embed_tokens.weight [V, D]``, ``model.norm.weight [D]``, ``lm_head.weight [V, D]``;
- ``L.input_layernorm.weight``, ``L.post_attention_layernorm.weight`` ``[D]``;
- ``L.self_attn.``: ``q_a_proj [q_lora, D]``, ``q_a_layernorm [q_lora]``, ``q_b_proj [H * (nope + rope), q_lora]``,
  ``kv_a_proj_with_mqa [kv_lora + rope, D]``, ``kv_a_layernorm [kv_lora]``, ``kv_b_proj [H * (nope + v), kv_lora]``,
  ``o_proj [D, H * v]`` (each ``.weight``);
- ``L.self_attn.indexer.``: ``wq_b [IH * ID, q_lora]``, ``wk [ID, D]``, ``k_norm`` (LayerNorm ``.weight``, ``.bias``
  ``[ID]``), ``weights_proj [IH, D]``;
- dense layers: ``L.mlp.{gate,up,down}_proj.weight``;
- MoE layers: ``L.mlp.gate.weight [E, D]``, ``L.mlp.gate.e_score_correction_bias [E]``,
  ``L.mlp.shared_experts.{gate,up,down}_proj.weight``, and the experts either bf16,
  ``L.mlp.experts.{e}.{gate,up,down}_proj.weight``, or MXFP4 stacked over experts,
  ``L.mlp.experts.gate_up_proj_blocks [E, 2I, D/32, 16]`` + ``_scales [E, 2I, D/32]`` (gate rows, then up rows:
  not interleaved) and ``L.mlp.experts.down_proj_blocks [E, D, I/32, 16]`` + ``_scales``.

:func:`load_checkpoint` returns the weights the model uses: dense tensors in the activation dtype, the router in
fp32, and MXFP4 experts (bf16 experts are quantized to MXFP4 at load with ``dt.mxfp4_quantize``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dsa_triton as dt
from dsa_triton.moe.mxfp4_reference import mxfp4_quantize_torch, validate_mxfp4

from .config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def dense_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint except the routed experts, with its shape."""
    c = config
    H, D = c.num_attention_heads, c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,),
              "lm_head.weight": (c.vocab_size, D)}
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            a + "q_a_proj.weight": (c.q_lora_rank, D), a + "q_a_layernorm.weight": (c.q_lora_rank,),
            a + "q_b_proj.weight": (H * c.qk_head_dim, c.q_lora_rank),
            a + "kv_a_proj_with_mqa.weight": (c.latent_dim, D), a + "kv_a_layernorm.weight": (c.kv_lora_rank,),
            a + "kv_b_proj.weight": (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            a + "o_proj.weight": (D, H * c.v_head_dim),
            a + "indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
            a + "indexer.wk.weight": (c.index_head_dim, D), a + "indexer.k_norm.weight": (c.index_head_dim,),
            a + "indexer.k_norm.bias": (c.index_head_dim,), a + "indexer.weights_proj.weight": (c.index_n_heads, D),
        })
        if c.is_moe_layer(i):
            shapes.update({p + "mlp.gate.weight": (c.n_routed_experts, D),
                           p + "mlp.gate.e_score_correction_bias": (c.n_routed_experts,)})
            shapes.update(mlp_shapes(p + "mlp.shared_experts.", D, c.n_shared_experts * c.moe_intermediate_size))
        else:
            shapes.update(mlp_shapes(p + "mlp.", D, c.intermediate_size))
    return shapes


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def mxfp4_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Stacked MXFP4 expert tensors of one MoE layer: name -> shape."""
    E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    p = f"model.layers.{layer}.mlp.experts."
    return {p + "gate_up_proj_blocks": (E, 2 * I, D // 32, 16), p + "gate_up_proj_scales": (E, 2 * I, D // 32),
            p + "down_proj_blocks": (E, D, I // 32, 16), p + "down_proj_scales": (E, D, I // 32)}


def bf16_expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for e in range(config.n_routed_experts):
        shapes.update(mlp_shapes(f"model.layers.{layer}.mlp.experts.{e}.", config.hidden_size,
                                 config.moe_intermediate_size))
    return shapes


class Shards:
    """A checkpoint's tensors by name, read on demand from the shard the index's ``weight_map`` names."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index_path = self.folder / INDEX_FILE
        if not index_path.exists():
            raise ValueError(f"checkpoint: {index_path} not found")
        self.weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self.folder / self.weight_map[name]), framework="pt") as f:
            if name not in f.keys():
                raise ValueError(f"checkpoint: tensor {name} is in the weight_map but not in {self.weight_map[name]}")
            return f.get_tensor(name)


def _take(tensors: Shards, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint: tensor {name} is missing")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"checkpoint: tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    return t


def stack_experts(config: ModelConfig, layer: int, get) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's bf16 experts stacked: ``gate_up [E, 2I, D]`` (gate rows, then up rows), ``down [E, D, I]``;
    ``get(name)`` returns the tensor of a checkpoint name."""
    p = f"model.layers.{layer}.mlp.experts."
    experts = range(config.n_routed_experts)
    gate_up = torch.stack([torch.cat([get(f"{p}{e}.gate_proj.weight"), get(f"{p}{e}.up_proj.weight")])
                           for e in experts])
    return gate_up, torch.stack([get(f"{p}{e}.down_proj.weight") for e in experts])


def _experts(config: ModelConfig, layer: int, tensors: Shards, device) -> dict[str, torch.Tensor]:
    """One MoE layer's experts as MXFP4 (``gate_up_blocks`` ... ``down_scales``): validated, or quantized at load."""
    stacked = mxfp4_shapes(config, layer)
    out = {}
    if not any(name in tensors for name in stacked):
        shapes = bf16_expert_shapes(config, layer)
        for proj, w in zip(("gate_up", "down"), stack_experts(config, layer, lambda n: _take(tensors, n, shapes[n]))):
            out[proj + "_blocks"], out[proj + "_scales"] = dt.mxfp4_quantize(w.to(device))
        return out
    for proj in ("gate_up", "down"):
        name = f"model.layers.{layer}.mlp.experts.{proj}_proj"
        blocks = _take(tensors, name + "_blocks", stacked[name + "_blocks"])
        scales = _take(tensors, name + "_scales", stacked[name + "_scales"])
        validate_mxfp4(name, blocks, scales)  # a 0xFF scale names the tensor and the block
        out[proj + "_blocks"], out[proj + "_scales"] = blocks.to(device), scales.to(device)
    return out


def load_checkpoint(folder: str | Path, config: ModelConfig, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Read a checkpoint folder; returns name -> tensor on ``device``: dense tensors in ``dtype`` (routers fp32),
    and per MoE layer ``model.layers.{i}.mlp.experts.{gate_up,down}_{blocks,scales}`` MXFP4."""
    tensors = Shards(folder)
    weights = {}
    for name, shape in dense_shapes(config).items():
        t = _take(tensors, name, shape)
        router = name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")
        weights[name] = t.to(device, torch.float32 if router else dtype)
    for i in range(config.first_k_dense_replace, config.num_hidden_layers):
        for key, t in _experts(config, i, tensors, device).items():
            weights[f"model.layers.{i}.mlp.experts.{key}"] = t
    return weights


def random_tensors(config: ModelConfig, mxfp4: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the checkpoint layout: bf16 projections ~ N(0, 1/fan_in), norms near 1, bias near 0."""
    g = torch.Generator().manual_seed(seed)
    shapes = dict(dense_shapes(config))
    for i in range(config.first_k_dense_replace, config.num_hidden_layers):
        shapes.update(bf16_expert_shapes(config, i))
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        elif name != "model.embed_tokens.weight":
            t = t * shape[-1] ** -0.5
        tensors[name] = t.to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
    if mxfp4:
        for i in range(config.first_k_dense_replace, config.num_hidden_layers):
            for proj, w in zip(("gate_up", "down"), stack_experts(config, i, tensors.pop)):
                p = f"model.layers.{i}.mlp.experts.{proj}_proj"
                tensors[p + "_blocks"], tensors[p + "_scales"] = mxfp4_quantize_torch(w.float())
    return tensors


def save_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig, folder: str | Path, shards: int = 2) -> None:
    """Write ``config.json``, ``shards`` safetensors files and the index with its ``weight_map``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.to_json(folder / "config.json")
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(folder / shard))
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def save_random_checkpoint(config: ModelConfig, folder: str | Path, mxfp4: bool = True, shards: int = 2,
                           seed: int = 0) -> None:
    """A random checkpoint of ``config`` in the layout above (experts MXFP4 or bf16): for tests and the CLI."""
    save_checkpoint(random_tensors(config, mxfp4, seed), config, folder, shards)
