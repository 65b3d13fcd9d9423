"""The config of the MLA + DSA families (DeepSeek-V3.2; GLM-5 extends it: :mod:`.families.glm_moe_dsa`), read from
a ``config.json`` (Hugging Face field names), and what every family's config reading shares (:class:`RopeConfig`,
:func:`check_keys`, :func:`parse_quantization`).

Read (required unless a default is shown in :class:`ModelConfig`):

- trunk: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``intermediate_size`` (dense MLPs),
  ``mlp_layer_types`` ("dense" / "sparse" per layer; default ``first_k_dense_replace`` dense layers, then MoE),
  ``rms_norm_eps``, ``tie_word_embeddings``, ``max_position_embeddings``;
- MLA: ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``, ``attention_bias`` (biases of q_a_proj, kv_a_proj_with_mqa and o_proj);
- RoPE, in either form: v5 ``rope_parameters`` {``rope_type``, ``rope_theta``, YaRN fields} or top-level
  ``rope_theta`` + ``rope_scaling`` {``type``: "yarn", ...} (:class:`RopeConfig`);
- MoE: ``n_routed_experts``, ``n_shared_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_group``,
  ``topk_group``, ``routed_scaling_factor``, ``norm_topk_prob`` (sigmoid scores + correction bias, ``noaux_tc``);
- DSA indexer: ``index_n_heads``, ``index_head_dim``, ``index_topk``;
- ``quantization_config``: ``fp8`` (e4m3 weights with 128 x 128 ``weight_scale_inv`` blocks; activations are not
  quantized here, whatever ``activation_scheme`` says) or ``mxfp4`` (experts as ``*_blocks`` / ``*_scales``);
- ``num_nextn_predict_layers``: multi-token-prediction layers after the last layer (their tensors are skipped).

Every other key is an error naming it, unless :data:`NO_EFFECT` lists it (metadata, training-only settings) or
:data:`CHECKED` accepts its value (the one the runner implements); ``model_type`` must be the class's.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .errors import RunnerError

NO_EFFECT = {  # keys that do not change inference
    "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "initializer_range",
    "attention_dropout", "use_cache", "output_router_logits", "bos_token_id", "pad_token_id",
    "eos_token_id",  # read by .tokenizer: generation stops there
    "aux_loss_alpha", "seq_aux", "router_aux_loss_coef", "ep_size",
    "head_dim",  # Hugging Face sets it to qk_rope_head_dim whatever the file says
}
CHECKED = {  # key -> (test of its value, what the runner implements)
    "hidden_act": (lambda v, c: v == "silu", "'silu' (SwiGLU experts and MLPs)"),
    "scoring_func": (lambda v, c: v == "sigmoid", "'sigmoid'"),
    "topk_method": (lambda v, c: v == "noaux_tc", "'noaux_tc'"),
    "mlp_bias": (lambda v, c: v is False, "false"),
    "rope_interleave": (lambda v, c: v is True, "true (interleaved MLA RoPE)"),
    "moe_layer_freq": (lambda v, c: v == 1, "1"),
    "layer_types": (lambda v, c: all(t == "indexed_attention" for t in v), "'indexed_attention' for every layer"),
    "num_key_value_heads": (lambda v, c: v == c["num_attention_heads"], "num_attention_heads (MLA)"),
    "qk_head_dim": (lambda v, c: v == c["qk_nope_head_dim"] + c["qk_rope_head_dim"], "qk_nope + qk_rope head dims"),
}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
FP8_BLOCK = [128, 128]
QUANTIZATION_KEYS = {
    "fp8": {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "modules_to_not_convert"},
    "mxfp4": {"quant_method", "modules_to_not_convert"},
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """RoPE over ``qk_rope_head_dim`` dims, plain (``type`` "default") or YaRN, as Hugging Face computes it.

    YaRN: frequencies blended between ``theta`` and ``theta`` x ``factor`` over the dims whose wavelength lies
    between ``beta_fast`` and ``beta_slow`` rotations of ``original_max_position_embeddings``; cos / sin times
    :attr:`attention_factor`; the attention's softmax scale times :attr:`softmax_mscale`. ``None`` means absent
    from the config (Hugging Face treats absent and 0 alike for ``mscale`` / ``mscale_all_dim``).
    """
    theta: float = 10000.0
    type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.type not in ("default", "yarn"):
            raise RunnerError(f"config: rope type {self.type!r} is not implemented (default, yarn)")
        if self.type == "yarn" and not (self.factor and self.factor >= 1):
            raise RunnerError(f"config: YaRN rope needs factor >= 1, got {self.factor!r}")
        if self.type == "yarn" and not self.original_max_position_embeddings:
            raise RunnerError("config: YaRN rope needs original_max_position_embeddings (or max_position_embeddings)")

    @classmethod
    def from_config(cls, values: dict) -> "RopeConfig":
        """From ``rope_parameters`` (v5) or top-level ``rope_theta`` + ``rope_scaling``; ``rope_theta`` inside
        ``rope_parameters`` wins over a top-level one."""
        if values.get("rope_parameters") and values.get("rope_scaling"):
            raise RunnerError("config: both rope_parameters and rope_scaling are given (one RoPE form, please)")
        params = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
        unknown = sorted(set(params) - ROPE_KEYS)
        if unknown:
            raise RunnerError(f"config: rope parameter {unknown[0]!r} is not implemented")
        theta = params.get("rope_theta", values.get("rope_theta"))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "yarn":
            params.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
            if params.get("factor") is None and params["original_max_position_embeddings"]:
                params["factor"] = values["max_position_embeddings"] / params["original_max_position_embeddings"]
        fields = {k: params[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                         "mscale", "mscale_all_dim", "attention_factor", "truncate") if k in params}
        return cls(theta=float(theta if theta is not None else 10000.0), type=rope_type, **fields)

    def to_parameters(self) -> dict:
        """The v5 ``rope_parameters`` dict."""
        out = {"rope_type": self.type, "rope_theta": self.theta}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("theta", "type") and getattr(self, f.name) not in (None, f.default)})
        return out

    @property
    def attention_factor_value(self) -> float:
        """What cos and sin are multiplied by (1 without YaRN)."""
        if self.type == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The attention's softmax scale correction: ``yarn_mscale(factor, mscale_all_dim)^2`` (1 without YaRN)."""
        if self.type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True)
class ModelConfig:
    model_type: ClassVar[str] = "deepseek_v32"
    architecture: ClassVar[str] = "DeepseekV32ForCausalLM"
    index_rope_interleaved: ClassVar[bool] = False  # the indexer's RoPE: NeoX halves (V3.2) or interleaved pairs

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    first_k_dense_replace: int = 3
    mlp_layer_types: tuple[str, ...] = ()  # () = from first_k_dense_replace
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 163840
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    quantization: str | None = None  # quantization_config's method: None, "fp8" or "mxfp4"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise RunnerError(f"config: {f.name} must be an integer >= 0, got {value!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise RunnerError(f"config: first_k_dense_replace must be in [0, num_hidden_layers = "
                              f"{self.num_hidden_layers}], got {self.first_k_dense_replace}")
        types = tuple(self.mlp_layer_types) or (("dense",) * self.first_k_dense_replace
                                                 + ("sparse",) * (self.num_hidden_layers - self.first_k_dense_replace))
        if len(types) != self.num_hidden_layers or set(types) - {"dense", "sparse"}:
            raise RunnerError(f"config: mlp_layer_types must hold 'dense' or 'sparse' for each of the "
                              f"{self.num_hidden_layers} layers, got {list(types)}")
        object.__setattr__(self, "mlp_layer_types", types)
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise RunnerError(f"config: {name} must be a multiple of 32 (the K of an MXFP4 expert GEMM), "
                                  f"got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise RunnerError(f"config: qk_rope_head_dim must be even and at most index_head_dim, "
                              f"got {self.qk_rope_head_dim}")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise RunnerError(f"config: n_group must divide n_routed_experts = {self.n_routed_experts}, "
                              f"got {self.n_group}")
        if self.quantization not in (None, "fp8", "mxfp4"):
            raise RunnerError(f"config: quantization {self.quantization!r} is not implemented (fp8, mxfp4)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank + qk_rope_head_dim`` (576 in DeepSeek-V3.2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times YaRN's mscale^2 (DeepSeek-V3.2: 192^-0.5 x 1.3690^2 = 0.1352)."""
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def runs_indexer(self, layer: int) -> bool:
        """Whether ``layer`` scores its own top-k (every layer here; GLM-5's "shared" layers reuse the previous)."""
        return True

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """Parse a ``config.json`` dict: every key is read, checked or listed as without effect (else an error)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "quantization"}
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in values]
        check_keys(values, cls.model_type, missing, CHECKED,
                   names | NO_EFFECT | {"rope_theta", "rope_scaling", "rope_parameters", "quantization_config"})
        fields = {k: v for k, v in values.items() if k in names}
        if "mlp_layer_types" in fields:
            fields["mlp_layer_types"] = tuple(fields["mlp_layer_types"] or ())
        return cls(**fields, rope=RopeConfig.from_config(values),
                   quantization=parse_quantization(values.get("quantization_config")))

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise RunnerError(f"config: cannot read {path}: {exc}") from None
        return cls.from_dict(values)

    def to_dict(self) -> dict:
        """The Hugging Face v5 form (``rope_parameters``; ``quantization_config`` for FP8 weights)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("rope", "quantization")}
        values.update(mlp_layer_types=list(self.mlp_layer_types), rope_parameters=self.rope.to_parameters(),
                      model_type=self.model_type, architectures=[self.architecture], hidden_act="silu",
                      num_key_value_heads=self.num_attention_heads)
        if self.quantization == "fp8":
            values["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": FP8_BLOCK, "scale_fmt": "ue8m0"}
        elif self.quantization == "mxfp4":
            values["quantization_config"] = {"quant_method": "mxfp4"}
        return values

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def check_keys(values: dict, model_type: str, missing: list[str], checked: dict, known: set[str]) -> None:
    """A config.json dict against a family's keys: its ``model_type``, no ``missing`` required field, every key
    either ``checked`` (key -> (test(value, values), what is implemented)) or ``known``; else a one-line
    :class:`.errors.RunnerError` naming the first offender."""
    if values.get("model_type", model_type) != model_type:
        raise RunnerError(f"config: model_type {values['model_type']!r} is not {model_type!r}")
    if missing:
        raise RunnerError(f"config: missing field {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                    if len(missing) > 1 else ""))
    for key, value in values.items():
        if key in checked:
            test, implemented = checked[key]
            if not test(value, values):
                raise RunnerError(f"config: {key} = {json.dumps(value)} is not implemented (the runner supports "
                                  f"{implemented})")
        elif key not in known | {"model_type"}:
            raise RunnerError(f"config: key {key!r} is not implemented by the runner")


def parse_quantization(q: dict | None, extra_keys: set[str] = frozenset()) -> str | None:
    """``quantization_config`` -> its method; an unknown method, key (but ``extra_keys``, which the caller reads) or
    value is an error naming it."""
    if q is None:
        return None
    method = q.get("quant_method")
    if method not in QUANTIZATION_KEYS:
        raise RunnerError(f"config: quantization_config.quant_method {method!r} is not implemented (fp8, mxfp4)")
    unknown = sorted(set(q) - QUANTIZATION_KEYS[method] - extra_keys)
    if unknown:
        raise RunnerError(f"config: quantization_config.{unknown[0]} is not implemented")
    if method == "fp8":
        for key, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("scale_fmt", ("ue8m0",))):
            if q.get(key) not in (None, *allowed):
                raise RunnerError(f"config: quantization_config.{key} = {q[key]!r} is not implemented ({allowed[0]})")
        if list(q.get("weight_block_size") or FP8_BLOCK) != FP8_BLOCK:
            raise RunnerError(f"config: quantization_config.weight_block_size = {q['weight_block_size']} is not "
                              f"implemented ({FP8_BLOCK})")
    return method


def tiny_config(**overrides) -> ModelConfig:
    """A tiny model that runs in the Triton interpreter: 3 layers (1 dense), 4 heads, 6 experts top-2,
    indexer 8 heads x 32 with top-k 8 (so a prompt of more than 8 tokens really drops some)."""
    values = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
                  num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                  v_head_dim=16, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2,
                  moe_intermediate_size=32, n_group=3, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  index_n_heads=8, index_head_dim=32, index_topk=8, rms_norm_eps=1e-6, max_position_embeddings=4096)
    return ModelConfig(**{**values, **overrides})
