"""The weight-name map of the MLA + DSA families (DeepSeek-V3.2, GLM-5), their load procedure, random checkpoints
and random weights; the layer blocks are :mod:`model_runner.model`, the config
:class:`model_runner.config.ModelConfig`.

Tensor names (Hugging Face; ``L = model.layers.{i}``):

- ``model.embed_tokens.weight [V, D]``, ``model.norm.weight [D]``, ``lm_head.weight [V, D]`` (absent when
  ``tie_word_embeddings``);
- ``L.input_layernorm.weight``, ``L.post_attention_layernorm.weight`` ``[D]``;
- ``L.self_attn.``: ``q_a_proj [q_lora, D]``, ``q_a_layernorm [q_lora]``, ``q_b_proj [H * (nope + rope), q_lora]``,
  ``kv_a_proj_with_mqa [kv_lora + rope, D]``, ``kv_a_layernorm [kv_lora]``, ``kv_b_proj [H * (nope + v), kv_lora]``,
  ``o_proj [D, H * v]`` (each ``.weight``; with ``attention_bias`` also ``.bias`` of q_a_proj, kv_a_proj_with_mqa,
  o_proj);
- ``L.self_attn.indexer.`` (layers that run their own indexer: every layer of V3.2, the "full" ones of GLM-5):
  ``wq_b [IH * ID, q_lora]``, ``wk [ID, D]``, ``k_norm`` (LayerNorm ``.weight``, ``.bias`` ``[ID]``),
  ``weights_proj [IH, D]``;
- dense layers: ``L.mlp.{gate,up,down}_proj.weight``;
- MoE layers: ``L.mlp.gate.weight [E, D]``, ``L.mlp.gate.e_score_correction_bias [E]``,
  ``L.mlp.shared_experts.{gate,up,down}_proj.weight``, and the experts either one by one,
  ``L.mlp.experts.{e}.{gate,up,down}_proj.weight``, or MXFP4 stacked over experts,
  ``L.mlp.experts.gate_up_proj_blocks [E, 2I, D/32, 16]`` + ``_scales [E, 2I, D/32]`` (gate rows, then up rows:
  not interleaved) and ``L.mlp.experts.down_proj_blocks [E, D, I/32, 16]`` + ``_scales``.

FP8 projections stay FP8 unless ``dequantize_fp8``; ``kv_b_proj`` (absorbed per head), ``weights_proj`` (fp32) and
non-projection tensors are dequantized. Experts one by one (bf16, fp32 or FP8) are quantized to MXFP4 at load
(:class:`.loader.MXFP4Stack`); MXFP4 experts are used as shipped. Multi-token-prediction layers (``L`` with
``i >= num_hidden_layers``, up to ``num_nextn_predict_layers`` of them) are skipped with a note.

Expert parallel (:mod:`model_runner.distributed`): given ``experts``, a range of expert ids, only those experts of
each MoE layer are read (stacked MXFP4 tensors: the rows of that range, read as a slice of the file; experts one
by one: only theirs; the others are not read, so not checked, on this rank).

:func:`load_weights` returns the weights the model uses (dense tensors in the activation dtype; the router, its
bias and ``weights_proj`` in fp32; per MoE layer ``L.mlp.experts.{gate_up,down}_{blocks,scales}``) and notes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dsa_triton.linear.formats import dequantize_fp8_blockwise, quantize_fp8_blockwise
from dsa_triton.moe.mxfp4_reference import mxfp4_quantize_torch

from ..config import ModelConfig
from ..errors import RunnerError
from ..loader import (Checkpoint, MXFP4Stack, Reader, TensorFiles, conversion_notes, finish, load_dense, scale_name,
                      take_mxfp4, tally_conversion)
from ..ops import FP8Weight
from ..random_draws import random_mxfp4, random_tensor

FP32_NAMES = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
DEQUANTIZED = ("kv_b_proj.weight", "indexer.weights_proj.weight", "mlp.gate.weight")  # 2-D, never kept in FP8
EXPERT_FORMATS = ("mxfp4", "bf16", "fp8")
DENSE_FORMATS = ("bf16", "fp8")


def dense_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint except the routed experts, with its shape."""
    c = config
    H, D = c.num_attention_heads, c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, D)
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            a + "q_a_proj.weight": (c.q_lora_rank, D), a + "q_a_layernorm.weight": (c.q_lora_rank,),
            a + "q_b_proj.weight": (H * c.qk_head_dim, c.q_lora_rank),
            a + "kv_a_proj_with_mqa.weight": (c.latent_dim, D), a + "kv_a_layernorm.weight": (c.kv_lora_rank,),
            a + "kv_b_proj.weight": (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            a + "o_proj.weight": (D, H * c.v_head_dim),
        })
        if c.runs_indexer(i):
            shapes.update({
                a + "indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                a + "indexer.wk.weight": (c.index_head_dim, D), a + "indexer.k_norm.weight": (c.index_head_dim,),
                a + "indexer.k_norm.bias": (c.index_head_dim,),
                a + "indexer.weights_proj.weight": (c.index_n_heads, D),
            })
        if c.attention_bias:
            shapes.update({a + "q_a_proj.bias": (c.q_lora_rank,), a + "kv_a_proj_with_mqa.bias": (c.latent_dim,),
                           a + "o_proj.bias": (D,)})
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


def expert_shapes(config: ModelConfig, layer: int, expert: int) -> dict[str, tuple[int, ...]]:
    """One expert's projections (the layout of experts one by one)."""
    return mlp_shapes(f"model.layers.{layer}.mlp.experts.{expert}.", config.hidden_size, config.moe_intermediate_size)


def keep_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 tensor stays FP8: the projections of the layers but those of :data:`DEQUANTIZED`."""
    return len(shape) == 2 and name.startswith("model.layers.") and not name.endswith(DEQUANTIZED)


def load_weights(folder: str | Path, config: ModelConfig, dtype: torch.dtype, device, *,
                 dequantize_fp8: bool = False, experts: range | None = None) -> Checkpoint:
    """Read a checkpoint folder (layout and formats: the module docstring) onto ``device``; ``experts``: only
    these experts of each MoE layer (default all)."""
    reader = Reader(TensorFiles(folder), config.quantization == "fp8")
    out = Checkpoint()
    out.notes += load_dense(reader, dense_shapes(config), out.weights, dtype, device, keep_fp8=keep_fp8,
                            fp32=lambda name: name.endswith(FP32_NAMES), dequantize_fp8=dequantize_fp8)
    if config.tie_word_embeddings:
        out.weights["lm_head.weight"] = out.weights["model.embed_tokens.weight"]
    converted: dict[str, list[int]] = {}  # source format -> [layers, lossy 32-blocks, 32-blocks]
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            tally_conversion(converted, *_experts(config, i, reader, device, out.weights, experts))
    out.notes += conversion_notes(converted)
    first_mtp = config.num_hidden_layers
    finish(reader, range(first_mtp, first_mtp + config.num_nextn_predict_layers), out.notes)
    return out


def _experts(config: ModelConfig, layer: int, reader: Reader, device, weights: dict,
             owned: range | None) -> tuple[str, int, int]:
    """One MoE layer's experts ``owned`` (None: all) into ``weights`` as MXFP4; -> (source format, lossy
    32-blocks, 32-blocks)."""
    p = f"model.layers.{layer}.mlp.experts."
    owned = range(config.n_routed_experts) if owned is None else owned
    stacked = mxfp4_shapes(config, layer)
    if any(name in reader.files for name in stacked):
        if f"{p}0.gate_proj.weight" in reader.files:
            raise RunnerError(f"checkpoint: layer {layer} holds experts both MXFP4 stacked and one by one")
        for proj in ("gate_up", "down"):
            name = f"{p}{proj}_proj"
            weights[f"{p}{proj}_blocks"], weights[f"{p}{proj}_scales"] = take_mxfp4(
                reader, name, stacked[name + "_blocks"], owned, device)
        return "mxfp4", 0, 0
    stacks = {proj: MXFP4Stack(device, f"{p}*.{proj}") for proj in ("gate_up", "down")}
    fmt = None
    for e in range(config.n_routed_experts):
        if e not in owned:  # another rank's: not read here
            for name in expert_shapes(config, layer, e):
                reader.skip(name)
            continue
        w = {}
        for name, shape in expert_shapes(config, layer, e).items():
            t = reader.take_weight(name, shape)
            fmt = "fp8" if isinstance(t, FP8Weight) else str(t.dtype).replace("torch.", "")
            w[name.rsplit(".", 2)[-2]] = (dequantize_fp8_blockwise(*t) if isinstance(t, FP8Weight) else t.float())
        stacks["gate_up"].add(torch.cat([w["gate_proj"], w["up_proj"]]))
        stacks["down"].add(w["down_proj"])
    for proj, stack in stacks.items():
        weights[f"{p}{proj}_blocks"], weights[f"{p}{proj}_scales"] = stack.tensors()
    return fmt, sum(s.lossy for s in stacks.values()), sum(s.total for s in stacks.values())


def random_tensors(config: ModelConfig, experts: str = "mxfp4", dense: str = "bf16",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights of a random checkpoint of ``config``: dense tensors by :func:`.checkpoint_writer.random_tensor`'s
    rule, drawn in bf16 in one fixed order whatever the formats (so every format of one seed holds the same values up
    to its rounding). Experts ``mxfp4`` (stacked blocks and scales), ``bf16`` or ``fp8`` (one by one); dense
    ``bf16``, or ``fp8``: every projection in the layers but the router and the indexer's ``weights_proj`` as e4m3
    with power-of-two 128 x 128 block scales (DeepSeek's ``ue8m0``), so that its dequantized bf16 twin is exact."""
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


def reduced(config: ModelConfig, layers: int, **fields) -> ModelConfig:
    """``config`` with ``layers`` layers at every width: its dense layers capped to one (none if it has none), then
    MoE layers (all dense when it has no MoE layer); ``fields``: other fields to replace with it."""
    if layers < 1:
        raise RunnerError(f"layers: must be at least 1, got {layers}")
    types = config.mlp_layer_types
    dense = min(1, types.count("dense"), layers) if "sparse" in types else layers
    return dataclasses.replace(config, num_hidden_layers=layers, first_k_dense_replace=dense, mlp_layer_types=(),
                               **fields)


def random_experts(config: ModelConfig, layer: int, generator: torch.Generator,
                   experts: range | None = None) -> dict[str, torch.Tensor]:
    """One MoE layer's MXFP4 experts ``experts`` (default all), stacked as the loader returns them:
    ``<L>.mlp.experts.{gate_up,down}_proj_{blocks [E, N, K/32, 16], scales [E, N, K/32]}`` uint8 on
    ``generator``'s device (:func:`..random_draws.random_mxfp4`)."""
    count = config.n_routed_experts if experts is None else len(experts)
    out = {}
    for name, shape in mxfp4_shapes(config, layer).items():
        if name.endswith("_blocks"):
            n, k = shape[1], shape[2] * 32
            proj = name[: -len("_blocks")]
            out[proj + "_blocks"], out[proj + "_scales"] = random_mxfp4((count, n, k), generator)
    return out


def random_weights(config: ModelConfig, dtype: torch.dtype, device, seed: int = 0,
                   experts: range | None = None) -> dict[str, torch.Tensor]:
    """Every weight :class:`model_runner.model.Model` takes for ``config`` (names and formats of
    :func:`load_weights`; ``experts``: only these experts of each MoE layer, as a rank of expert parallel holds
    them), drawn on ``device`` from ``seed``."""
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
