"""Checkpoints in the Hugging Face layout: one ``model.safetensors`` or shards named by the ``weight_map`` of
``model.safetensors.index.json``.

Tensor names (Hugging Face DeepSeek-V3.2; ``L = model.layers.{i}``):

- ``model.embed_tokens.weight [V, D]``, ``model.norm.weight [D]``, ``lm_head.weight [V, D]`` (absent when
  ``tie_word_embeddings``);
- ``L.input_layernorm.weight``, ``L.post_attention_layernorm.weight`` ``[D]``;
- ``L.self_attn.``: ``q_a_proj [q_lora, D]``, ``q_a_layernorm [q_lora]``, ``q_b_proj [H * (nope + rope), q_lora]``,
  ``kv_a_proj_with_mqa [kv_lora + rope, D]``, ``kv_a_layernorm [kv_lora]``, ``kv_b_proj [H * (nope + v), kv_lora]``,
  ``o_proj [D, H * v]`` (each ``.weight``; with ``attention_bias`` also ``.bias`` of q_a_proj, kv_a_proj_with_mqa,
  o_proj);
- ``L.self_attn.indexer.``: ``wq_b [IH * ID, q_lora]``, ``wk [ID, D]``, ``k_norm`` (LayerNorm ``.weight``, ``.bias``
  ``[ID]``), ``weights_proj [IH, D]``;
- dense layers: ``L.mlp.{gate,up,down}_proj.weight``;
- MoE layers: ``L.mlp.gate.weight [E, D]``, ``L.mlp.gate.e_score_correction_bias [E]``,
  ``L.mlp.shared_experts.{gate,up,down}_proj.weight``, and the experts either one by one,
  ``L.mlp.experts.{e}.{gate,up,down}_proj.weight``, or MXFP4 stacked over experts,
  ``L.mlp.experts.gate_up_proj_blocks [E, 2I, D/32, 16]`` + ``_scales [E, 2I, D/32]`` (gate rows, then up rows:
  not interleaved) and ``L.mlp.experts.down_proj_blocks [E, D, I/32, 16]`` + ``_scales``.

Formats. A weight may be any float dtype, or float8_e4m3fn with ``<name>_scale_inv`` fp32
``[ceil(N/128), ceil(K/128)]`` beside it (``quantization_config`` fp8). FP8 projections stay FP8 (an
:class:`.ops.FP8Weight`, multiplied by the blockwise-FP8 GEMM) unless ``dequantize_fp8``; ``kv_b_proj`` (absorbed
per head), ``weights_proj`` (fp32) and non-projection tensors are dequantized. Experts one by one (bf16, fp32 or FP8)
are quantized to MXFP4 at load, which is lossy: the 32-blocks whose values change are counted in the notes;
MXFP4 experts are used as shipped. Multi-token-prediction layers (``L`` with ``i >= num_hidden_layers``, up to
``num_nextn_predict_layers`` of them) are skipped with a note. Any other tensor, a missing or misshaped one, an FP8
weight without its scales: a :class:`.errors.RunnerError` naming it.

Expert parallel (:mod:`.distributed`): given ``experts``, a range of expert ids, only those experts of each MoE
layer are read (stacked MXFP4 tensors: the rows of that range, read as a slice of the file; experts one by one:
only theirs; the others are not read, so not checked, on this rank).

:func:`load_checkpoint` returns the weights the model uses (dense tensors in the activation dtype; the router,
its bias and ``weights_proj`` in fp32; per MoE layer ``L.mlp.experts.{gate_up,down}_{blocks,scales}``) and notes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

import dsa_triton as dt
from dsa_triton.linear.formats import dequantize_fp8_blockwise
from dsa_triton.moe.formats import validate_mxfp4
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch

from .config import ModelConfig
from .errors import RunnerError
from .ops import FP8Weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP32_NAMES = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
DEQUANTIZED = ("kv_b_proj.weight", "indexer.weights_proj.weight", "mlp.gate.weight")  # 2-D, never kept in FP8
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
            a + "indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
            a + "indexer.wk.weight": (c.index_head_dim, D), a + "indexer.k_norm.weight": (c.index_head_dim,),
            a + "indexer.k_norm.bias": (c.index_head_dim,), a + "indexer.weights_proj.weight": (c.index_n_heads, D),
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


def scale_name(name: str) -> str:
    return name + "_scale_inv"


class TensorFiles:
    """A checkpoint's tensors by name, read on demand from the file that holds each."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise RunnerError(f"checkpoint: {index} has no readable weight_map ({exc!r})") from None
        elif single.exists():
            self.weight_map = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            raise RunnerError(f"checkpoint: {self.folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._files: dict[str, object] = {}

    def _open(self, file: str):
        path = self.folder / file
        if not path.exists():
            raise RunnerError(f"checkpoint: {path} is named by {INDEX_FILE} but does not exist")
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise RunnerError(f"checkpoint: cannot read {path} ({exc})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_rows(self, name: str, rows: range) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Rows ``rows`` of dimension 0 (only those bytes are read) and the whole tensor's shape."""
        part = self._handle(name).get_slice(name)
        return part[rows.start:rows.stop], tuple(part.get_shape())

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = self._open(file)
        handle = self._files[file]
        if name not in handle.keys():
            raise RunnerError(f"checkpoint: tensor {name} is in the weight_map but not in {file}")
        return handle


@dataclass
class Checkpoint:
    """The model's tensors by name and what loading did to them (one line each)."""
    weights: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class _Reader:
    """Takes tensors out of a :class:`TensorFiles` by expected name and shape; remembers which were taken."""

    def __init__(self, files: TensorFiles, config: ModelConfig):
        self.files, self.config, self.taken = files, config, set()

    def take(self, name: str, shape: tuple[int, ...], rows: range | None = None) -> torch.Tensor:
        """The tensor ``name`` of ``shape``, or only ``rows`` of its dimension 0."""
        if name not in self.files:
            raise RunnerError(f"checkpoint: tensor {name} is missing")
        t, full = self.files.get_rows(name, rows) if rows is not None else (self.files.get(name), None)
        if (full or tuple(t.shape)) != shape:
            raise RunnerError(f"checkpoint: tensor {name} has shape {full or tuple(t.shape)}, expected {shape}")
        self.taken.add(name)
        return t

    def take_weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | FP8Weight:
        """A float tensor, or an FP8 weight with its block scales (checked: finite, positive, no e4m3 NaN)."""
        t = self.take(name, shape)
        if t.dtype == torch.float8_e4m3fn:
            if self.config.quantization != "fp8":
                raise RunnerError(f"checkpoint: tensor {name} is float8_e4m3fn but config.json has no "
                                  f"quantization_config with quant_method fp8")
            if scale_name(name) not in self.files:
                raise RunnerError(f"checkpoint: FP8 tensor {name} has no {scale_name(name)}")
            scale = self.take(scale_name(name), tuple(-(-n // 128) for n in shape))
            if scale.dtype != torch.float32 or not bool((scale.isfinite() & (scale > 0)).all()):
                raise RunnerError(f"checkpoint: tensor {scale_name(name)} must be float32, finite and > 0")
            if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise RunnerError(f"checkpoint: tensor {name} holds an e4m3 NaN")
            return FP8Weight(t, scale)
        if scale_name(name) in self.files:
            raise RunnerError(f"checkpoint: tensor {scale_name(name)} scales {name}, which is {t.dtype}, not FP8")
        if t.dtype not in FLOAT_DTYPES:
            raise RunnerError(f"checkpoint: tensor {name} has dtype {t.dtype}, expected a float dtype or FP8")
        return t


def load_checkpoint(folder: str | Path, config: ModelConfig, dtype: torch.dtype, device, *,
                    dequantize_fp8: bool = False, experts: range | None = None) -> Checkpoint:
    """Read a checkpoint folder (layout and formats: the module docstring) onto ``device``; ``experts``: only
    these experts of each MoE layer (default all)."""
    reader = _Reader(TensorFiles(folder), config)
    out = Checkpoint()
    kept = dequantized = 0
    for name, shape in dense_shapes(config).items():
        t = reader.take_weight(name, shape)
        keep = len(shape) == 2 and name.startswith("model.layers.") and not name.endswith(DEQUANTIZED)
        if isinstance(t, FP8Weight):
            if keep and not dequantize_fp8:
                out.weights[name] = FP8Weight(t.weight.to(device), t.scale_inv.to(device))
                kept += 1
                continue
            t, dequantized = dequantize_fp8_blockwise(*t), dequantized + 1
        out.weights[name] = t.to(device, torch.float32 if name.endswith(FP32_NAMES) else dtype)
    if config.tie_word_embeddings:
        out.weights["lm_head.weight"] = out.weights["model.embed_tokens.weight"]
    if kept or dequantized:
        out.notes.append(f"dense weights: {kept} FP8 projections kept in FP8 (blockwise-FP8 GEMM), {dequantized} "
                         f"FP8 tensors dequantized to {str(dtype).replace('torch.', '')} at load")
    converted = {}  # source format -> (layers, lossy 32-blocks, 32-blocks)
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            fmt, lossy, blocks = _experts(config, i, reader, device, out.weights, experts)
            if fmt != "mxfp4":
                layers, lossy_sum, block_sum = converted.get(fmt, (0, 0, 0))
                converted[fmt] = (layers + 1, lossy_sum + lossy, block_sum + blocks)
    for fmt, (layers, lossy, blocks) in converted.items():
        out.notes.append(f"experts: {fmt} -> MXFP4 at load in {layers} layers; {lossy} of {blocks} 32-element "
                         f"blocks lossy ({100 * lossy / max(blocks, 1):.2f}%)")
    _check_rest(reader, config, out.notes)
    return out


def _experts(config: ModelConfig, layer: int, reader: _Reader, device, weights: dict,
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
            blocks = reader.take(name + "_blocks", stacked[name + "_blocks"], owned)
            scales = reader.take(name + "_scales", stacked[name + "_scales"], owned)
            try:
                validate_mxfp4(name, blocks, scales)  # a 0xFF scale names the tensor and the block
            except ValueError as exc:
                raise RunnerError(f"checkpoint: {exc}") from None
            weights[f"{p}{proj}_blocks"], weights[f"{p}{proj}_scales"] = blocks.to(device), scales.to(device)
        return "mxfp4", 0, 0
    parts = {"gate_up": ([], []), "down": ([], [])}
    lossy = total = 0
    fmt = None
    for e in range(config.n_routed_experts):
        if e not in owned:  # another rank's: not read here
            reader.taken.update(n for name in expert_shapes(config, layer, e) for n in (name, scale_name(name)))
            continue
        w = {}
        for name, shape in expert_shapes(config, layer, e).items():
            t = reader.take_weight(name, shape)
            fmt = "fp8" if isinstance(t, FP8Weight) else str(t.dtype).replace("torch.", "")
            w[name.rsplit(".", 2)[-2]] = (dequantize_fp8_blockwise(*t) if isinstance(t, FP8Weight) else t.float())
        for proj, dense in (("gate_up", torch.cat([w["gate_proj"], w["up_proj"]])), ("down", w["down_proj"])):
            dense = dense.to(device)
            blocks, scales = dt.mxfp4_quantize(dense)
            changed = mxfp4_dequantize_torch(blocks, scales) != dense
            lossy += int(changed.view(*changed.shape[:-1], -1, 32).any(-1).sum())
            total += scales.numel()
            parts[proj][0].append(blocks)
            parts[proj][1].append(scales)
    for proj, (blocks, scales) in parts.items():
        weights[f"{p}{proj}_blocks"], weights[f"{p}{proj}_scales"] = torch.stack(blocks), torch.stack(scales)
    return fmt, lossy, total


def _check_rest(reader: _Reader, config: ModelConfig, notes: list[str]) -> None:
    """Skip multi-token-prediction layers (noted); any other tensor left is an error naming it."""
    layer_of = re.compile(r"model\.layers\.(\d+)\.")
    mtp = range(config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers)
    left = sorted(set(reader.files.weight_map) - reader.taken)
    skipped = [n for n in left if (m := layer_of.match(n)) and int(m.group(1)) in mtp]
    if skipped:
        notes.append(f"multi-token-prediction layers {mtp.start}..{mtp.stop - 1} (num_nextn_predict_layers = "
                     f"{config.num_nextn_predict_layers}): {len(skipped)} tensors skipped (not used for generation)")
    unused = sorted(set(left) - set(skipped))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise RunnerError(f"checkpoint: tensor {unused[0]} is not implemented by the runner{more}")
