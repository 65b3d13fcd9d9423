"""DeepSeek-V4's weight-name map, its load procedure, random checkpoints and random weights.

Tensor names as transformers' ``save_pretrained`` writes them (``L = model.layers.{i}``; DeepSeek's own names are
read too: the same without ``model.``, ``embed.weight``, ``norm.weight``, ``hc_head_{fn,base,scale}``):

- ``model.embed_tokens.weight [V, D]``, ``head.weight [V, D]`` (absent when tied), ``model.norm.weight [D]``,
  ``model.hc_head.{hc_fn [hc, hc D], hc_base [hc], hc_scale [1]}`` (the hyper head);
- ``L.attn_norm.weight``, ``L.ffn_norm.weight`` ``[D]``; ``L.hc_{attn,ffn}_{fn [(2 + hc) hc, hc D], base
  [(2 + hc) hc], scale [3]}`` (mHC);
- ``L.attn.``: ``wq_a [q_lora, D]``, ``q_norm [q_lora]``, ``wq_b [H hd, q_lora]``, ``wkv [hd, D]``, ``norm [hd]``
  (the K=V head's), ``wo_a [G o_lora, H hd / G]`` (one block per group), ``wo_b [D, G o_lora]``, ``attn_sink [H]``;
- CSA / HCA layers, ``L.attn.compressor.``: ``wkv``, ``wgate`` ``[c hd, D]``, ``ape [m, c hd]``, ``norm [hd]`` (``c``
  2 with CSA's overlap, 1 with HCA; ``m`` the layer's compress rate); CSA layers also
  ``L.attn.indexer.compressor.`` (the same at ``index_head_dim``), ``L.attn.indexer.wq_b [IH ID, q_lora]``,
  ``L.attn.indexer.weights_proj [IH, D]``;
- ``L.ffn.gate.weight [E, D]`` and ``L.ffn.gate.tid2eid [V, k]`` (hash layers, int) or ``L.ffn.gate.bias [E]``;
  ``L.ffn.shared_experts.w{1,2,3}.weight``; the routed experts ``L.ffn.experts.{e}.w{1,2,3}.weight`` (w1 gate, w3
  up ``[I, D]``, w2 down ``[D, I]``).

Formats: any float dtype; FP8 (e4m3 + 128 x 128 block scales, ``weight_scale_inv`` or DeepSeek's ``scale``) kept for
the attention and shared-expert projections (``wo_a`` when ``o_lora_rank`` is a multiple of 128, so each group is
whole blocks), dequantized elsewhere; FP4 experts (``[N, K/2]`` bytes, E8M0 ``scale [N, K/32]``) are MXFP4 as read
(:func:`..loader.mxfp4_view`), float and FP8 experts are quantized to MXFP4 at load (noted). Multi-token-prediction
tensors (``mtp.{j}.*``) are skipped with a note.

:func:`load_weights` returns the names above (transformers' form) with the routed experts stacked per layer as
``L.ffn.experts.{gate_up,down}_{blocks,scales}`` (gate rows, then up rows) and fp32 where transformers keeps fp32
(norms, mHC, sinks, ``ape``, the router and its bias).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from dsa_triton.linear.formats import dequantize_fp8_blockwise, quantize_fp8_blockwise
from dsa_triton.moe.mxfp4_reference import mxfp4_quantize_torch

from ...errors import RunnerError
from ...loader import (Checkpoint, MXFP4Stack, Reader, TensorFiles, conversion_notes, finish, load_dense, mxfp4_view,
                       scale_name, tally_conversion)
from ...ops import FP8Weight
from ...random_draws import random_mxfp4, random_tensor
from .config import CSA, HASH_MOE, LAYER_TYPES, MOE, SLIDING, DeepseekV4Config

FP8_PROJECTIONS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b|(indexer\.)?compressor\.(wkv|wgate))"
                             r"|ffn\.shared_experts\.w[123])\.weight$")
FP32_NAME = re.compile(r"(norm\.weight|hc_\w+|hc_head\.\w+|attn_sink|\.ape|ffn\.gate\.(weight|bias))$")
ORIGINAL_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
                "hc_head_scale": "model.hc_head.hc_scale"}
MTP = r"(?:model\.)?mtp\.(\d+)\."


def dense_shapes(c: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint but the routed experts and ``tid2eid``, with its shape."""
    D, H, hd, hc = c.hidden_size, c.num_attention_heads, c.head_dim, c.hc_mult
    shapes = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,),
              "model.hc_head.hc_fn": (hc, hc * D), "model.hc_head.hc_base": (hc,), "model.hc_head.hc_scale": (1,)}
    if not c.tie_word_embeddings:
        shapes["head.weight"] = (c.vocab_size, D)
    mix = (2 + hc) * hc
    for i in range(c.num_hidden_layers):
        L = f"model.layers.{i}."
        a, f = L + "attn.", L + "ffn."
        shapes.update({L + "attn_norm.weight": (D,), L + "ffn_norm.weight": (D,)})
        for site in ("attn", "ffn"):
            shapes.update({f"{L}hc_{site}_fn": (mix, hc * D), f"{L}hc_{site}_base": (mix,),
                           f"{L}hc_{site}_scale": (3,)})
        shapes.update({a + "wq_a.weight": (c.q_lora_rank, D), a + "q_norm.weight": (c.q_lora_rank,),
                       a + "wq_b.weight": (H * hd, c.q_lora_rank), a + "wkv.weight": (hd, D), a + "norm.weight": (hd,),
                       a + "wo_a.weight": (c.o_groups * c.o_lora_rank, H * hd // c.o_groups),
                       a + "wo_b.weight": (D, c.o_groups * c.o_lora_rank), a + "attn_sink": (H,)})
        if c.layer_types[i] != SLIDING:
            overlap = 2 if c.layer_types[i] == CSA else 1
            shapes.update(compressor_shapes(a + "compressor.", D, hd, c.compress_rate(i), overlap))
        if c.layer_types[i] == CSA:
            shapes.update(compressor_shapes(a + "indexer.compressor.", D, c.index_head_dim, c.csa_rate, 2))
            shapes.update({a + "indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                           a + "indexer.weights_proj.weight": (c.index_n_heads, D)})
        shapes[f + "gate.weight"] = (c.n_routed_experts, D)
        if c.mlp_layer_types[i] != HASH_MOE:
            shapes[f + "gate.bias"] = (c.n_routed_experts,)
        shapes.update(expert_shapes(f + "shared_experts.", D, c.moe_intermediate_size))
    return shapes


def compressor_shapes(prefix: str, hidden: int, dim: int, rate: int, overlap: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "wkv.weight": (overlap * dim, hidden), prefix + "wgate.weight": (overlap * dim, hidden),
            prefix + "ape": (rate, overlap * dim), prefix + "norm.weight": (dim,)}


def expert_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    """One expert's (or the shared expert's) projections: w1 gate and w3 up ``[I, D]``, w2 down ``[D, I]``."""
    return {prefix + "w1.weight": (inter, hidden), prefix + "w3.weight": (inter, hidden),
            prefix + "w2.weight": (hidden, inter)}


def keep_fp8(config: DeepseekV4Config):
    """Which FP8 tensors stay FP8 (``(name, shape) -> bool``): the projections of :data:`FP8_PROJECTIONS`, and
    ``wo_a`` when each group is whole 128-row blocks."""
    grouped_ok = config.o_lora_rank % 128 == 0
    return lambda name, shape: bool(FP8_PROJECTIONS.search(name)) or (grouped_ok and name.endswith("attn.wo_a.weight"))


def is_fp32(name: str) -> bool:
    return bool(FP32_NAME.search(name))


class SavedNames:
    """A checkpoint of DeepSeek's own names seen under transformers' saved names (:class:`..loader.TensorFiles`'s
    reading methods)."""

    def __init__(self, files: TensorFiles):
        self.files = files
        self.actual = {saved_name(n): n for n in files.weight_map}
        self.weight_map = {name: files.weight_map[n] for name, n in self.actual.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.actual

    def get(self, name: str) -> torch.Tensor:
        return self.files.get(self.actual[name])

    def get_rows(self, name: str, rows: range):
        return self.files.get_rows(self.actual[name], rows)

    def dtype(self, name: str) -> str:
        return self.files.dtype(self.actual[name])


def saved_name(name: str) -> str:
    """transformers' saved name of a DeepSeek name (``layers.3.attn.wq_a.weight`` -> ``model.layers.3...``)."""
    if name in ORIGINAL_TOP:
        return ORIGINAL_TOP[name]
    return "model." + name if name.startswith("layers.") else name


def load_weights(folder: str | Path, config: DeepseekV4Config, dtype: torch.dtype, device, *,
                 dequantize_fp8: bool = False, experts: range | None = None) -> Checkpoint:
    """Read a checkpoint folder (names and formats: the module docstring) onto ``device``; ``experts``: only these
    experts of each layer (default all)."""
    files = TensorFiles(folder)
    reader = Reader(SavedNames(files) if "embed.weight" in files else files, config.quantization == "fp8")
    out = Checkpoint()
    out.notes += load_dense(reader, dense_shapes(config), out.weights, dtype, device, keep_fp8=keep_fp8(config),
                            fp32=is_fp32, dequantize_fp8=dequantize_fp8)
    if config.tie_word_embeddings:
        out.weights["head.weight"] = out.weights["model.embed_tokens.weight"]
    converted: dict[str, list[int]] = {}
    for i in range(config.num_hidden_layers):
        f = f"model.layers.{i}.ffn."
        if config.mlp_layer_types[i] == HASH_MOE:
            ids = reader.take(f + "gate.tid2eid", (config.vocab_size, config.num_experts_per_tok))
            if ids.is_floating_point() or not bool(((ids >= 0) & (ids < config.n_routed_experts)).all()):
                raise RunnerError(f"checkpoint: tensor {f}gate.tid2eid must hold expert ids in "
                                  f"[0, {config.n_routed_experts})")
            out.weights[f + "gate.tid2eid"] = ids.to(device, torch.int64)
        tally_conversion(converted, *_experts(config, i, reader, device, out.weights, experts))
    out.notes += conversion_notes(converted)
    finish(reader, range(config.num_nextn_predict_layers), out.notes, layer_pattern=MTP)
    return out


def _experts(config: DeepseekV4Config, layer: int, reader: Reader, device, weights: dict,
             owned: range | None) -> tuple[str, int, int]:
    """One layer's routed experts ``owned`` (None: all) into ``weights`` as stacked MXFP4; -> (source format, lossy
    32-blocks, 32-blocks)."""
    f = f"model.layers.{layer}.ffn.experts."
    owned = range(config.n_routed_experts) if owned is None else owned
    stacks = {proj: MXFP4Stack(device, f"{f}*.{proj}") for proj in ("gate_up", "down")}
    fmt = "mxfp4"
    for e in range(config.n_routed_experts):
        shapes = expert_shapes(f"{f}{e}.", config.hidden_size, config.moe_intermediate_size)
        if e not in owned:  # another rank's: not read here
            for name in shapes:
                reader.skip(name)
            continue
        w = {}
        for name, shape in shapes.items():
            fp4 = mxfp4_view(reader, name, shape)
            if fp4 is None:
                t = reader.take_weight(name, shape)
                fmt = "fp8" if isinstance(t, FP8Weight) else str(t.dtype).replace("torch.", "")
                fp4 = dequantize_fp8_blockwise(*t) if isinstance(t, FP8Weight) else t.float()
            w[name.rsplit(".", 2)[-2]] = fp4
        gate_up = (tuple(torch.cat(parts) for parts in zip(w["w1"], w["w3"])) if isinstance(w["w1"], tuple)
                   else torch.cat([w["w1"], w["w3"]]))
        stacks["gate_up"].add(gate_up)
        stacks["down"].add(w["w2"])
    for proj, stack in stacks.items():
        weights[f"{f}{proj}_blocks"], weights[f"{f}{proj}_scales"] = stack.tensors()
    return fmt, sum(s.lossy for s in stacks.values()), sum(s.total for s in stacks.values())


def random_tid2eid(config: DeepseekV4Config, generator: torch.Generator) -> torch.Tensor:
    """``[V, k]`` int64: each token's ``k`` distinct experts, drawn on ``generator``'s device."""
    keys = torch.rand(config.vocab_size, config.n_routed_experts, generator=generator, device=generator.device)
    return keys.argsort(dim=1)[:, :config.num_experts_per_tok]


def random_tensors(config: DeepseekV4Config, experts: str = "mxfp4", dense: str = "bf16",
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a random checkpoint of ``config`` (names as transformers saves them): dense tensors by
    :func:`..random_draws.random_tensor`'s rule in bf16, one fixed order whatever the formats; experts ``mxfp4`` (FP4
    as DeepSeek ships them: ``[N, K/2]`` int8 + E8M0 ``scale``), ``bf16`` or ``fp8``; dense ``fp8``: the projections
    :func:`keep_fp8` keeps as e4m3 with power-of-two 128 x 128 block scales (exact bf16 twin)."""
    g = torch.Generator().manual_seed(seed)
    shapes = dense_shapes(config)
    for i in range(config.num_hidden_layers):
        for e in range(config.n_routed_experts):
            shapes.update(expert_shapes(f"model.layers.{i}.ffn.experts.{e}.", config.hidden_size,
                                        config.moe_intermediate_size))
    tensors = {name: random_tensor(name, shape, g) for name, shape in shapes.items()}
    for i in range(config.num_hidden_layers):
        if config.mlp_layer_types[i] == HASH_MOE:
            tensors[f"model.layers.{i}.ffn.gate.tid2eid"] = random_tid2eid(config, g)
    kept = keep_fp8(config)
    for name in list(tensors):
        if ".experts." in name and experts != "bf16" and ".shared_experts." not in name:
            if experts == "fp8":
                tensors[name], tensors[scale_name(name)] = quantize_fp8_blockwise(tensors[name], power_of_two=True)
            else:
                blocks, scales = mxfp4_quantize_torch(tensors[name].float())
                tensors[name] = blocks.view(torch.int8).flatten(-2)
                tensors[name[: -len("weight")] + "scale"] = scales.view(torch.float8_e8m0fnu)
        elif dense == "fp8" and kept(name, tensors[name].shape):
            tensors[name], tensors[scale_name(name)] = quantize_fp8_blockwise(tensors[name], power_of_two=True)
    return tensors


def reduced(config: DeepseekV4Config, layers: int) -> DeepseekV4Config:
    """``config`` with ``layers`` layers at every width, every layer type present from 3 layers on: sliding, CSA,
    HCA, repeated; the first layer hash-routed (when the config has hash layers), the rest top-k routed."""
    if layers < 1:
        raise RunnerError(f"layers: must be at least 1, got {layers}")
    hashed = [HASH_MOE] * min(layers, config.mlp_layer_types.count(HASH_MOE), 1)
    return dataclasses.replace(config, num_hidden_layers=layers,
                               layer_types=tuple(LAYER_TYPES[i % len(LAYER_TYPES)] for i in range(layers)),
                               mlp_layer_types=tuple(hashed + [MOE] * (layers - len(hashed))))


def random_weights(config: DeepseekV4Config, dtype: torch.dtype, device, seed: int = 0,
                   experts: range | None = None) -> dict[str, torch.Tensor]:
    """Every weight the V4 model takes for ``config`` (names and formats of :func:`load_weights`), drawn on
    ``device`` from ``seed``; ``experts``: only these of each layer."""
    g = torch.Generator(device).manual_seed(seed)
    weights = {name: random_tensor(name, shape, g).to(torch.float32 if is_fp32(name) else dtype)
               for name, shape in dense_shapes(config).items()}
    if config.tie_word_embeddings:
        weights["head.weight"] = weights["model.embed_tokens.weight"]
    count = config.n_routed_experts if experts is None else len(experts)
    D, I = config.hidden_size, config.moe_intermediate_size
    for i in range(config.num_hidden_layers):
        f = f"model.layers.{i}.ffn."
        if config.mlp_layer_types[i] == HASH_MOE:
            weights[f + "gate.tid2eid"] = random_tid2eid(config, g)
        for proj, shape in (("gate_up", (count, 2 * I, D)), ("down", (count, D, I))):
            weights[f"{f}experts.{proj}_blocks"], weights[f"{f}experts.{proj}_scales"] = random_mxfp4(shape, g)
    return weights
