"""DeepSeek-V4's config, read from a ``config.json`` as transformers' ``DeepseekV4Config`` writes or reads it.

Read (absent keys take transformers' defaults, those of V4-Flash: :data:`DEFAULTS`):

- trunk: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``rms_norm_eps``, ``tie_word_embeddings``,
  ``max_position_embeddings``; ``hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps`` (mHC residual streams);
- attention: ``num_attention_heads`` query heads over one shared K=V head (``num_key_value_heads`` 1) of
  ``head_dim``, its last ``head_dim x partial_rotary_factor`` dims rotated (legacy ``qk_rope_head_dim``);
  ``q_lora_rank``; ``o_groups`` x ``o_lora_rank`` (grouped output projection); ``sliding_window``;
- ``layer_types`` per layer: "sliding_attention", "compressed_sparse_attention" (CSA) or
  "heavily_compressed_attention" (HCA) (legacy ``compress_ratios`` 0 / 4 / 128); ``compress_rates`` per type
  (legacy ``compress_rate_csa`` / ``compress_rate_hca``); the CSA indexer's ``index_n_heads``, ``index_head_dim``,
  ``index_topk``;
- RoPE: ``rope_theta`` (sliding layers, plain) and ``compress_rope_theta`` (CSA / HCA layers and their compressors,
  with the YaRN fields of ``rope_parameters`` / ``rope_scaling``, ``attention_factor`` 1 unless given), or
  ``rope_parameters`` nested as ``{"main": ..., "compress": ...}``; the correction range is always truncated
  (transformers reads ``truncate`` from the outer dict, where V4 has none);
- MoE (every layer): ``mlp_layer_types`` per layer "hash_moe" (experts by token id: ``tid2eid``) or "moe" (top-k of
  ``scoring_func`` scores + correction bias) (legacy ``num_hash_layers``); ``n_routed_experts``,
  ``num_experts_per_tok``, ``moe_intermediate_size`` (also the shared expert's), ``routed_scaling_factor``,
  ``swiglu_limit`` (routed and shared experts' gate clipped above, up both ways);
- ``quantization_config``: ``fp8`` (e4m3 with 128 x 128 block scales) with ``expert_dtype`` "fp4" (experts e2m1
  with one E8M0 scale per 32: MXFP4) or "fp8" (the top-level ``expert_dtype`` folds in, as in transformers);
- ``num_nextn_predict_layers``: multi-token-prediction layers (their tensors are skipped).

Checked to the value implemented: ``n_shared_experts`` 1 and ``norm_topk_prob`` true (transformers builds one shared
expert and always renormalizes), ``topk_method`` noaux_tc, ``hidden_act`` silu, no attention or MLP bias. Every
other key is an error naming it unless listed without effect.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ...config import RopeConfig, check_keys, parse_quantization
from ...errors import RunnerError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # legacy compress_ratios
HASH_MOE, MOE = "hash_moe", "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
EXPERT_DTYPES = ("fp4", "fp8")
DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                num_attention_heads=64, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256,
                scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=1048576,
                rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
                swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
                index_head_dim=128, index_topk=512, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
NO_EFFECT = {"architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
             "initializer_range", "attention_dropout", "use_cache", "output_router_logits", "bos_token_id",
             "pad_token_id", "eos_token_id", "router_aux_loss_coef", "router_jitter_noise"}
CHECKED = {
    "num_key_value_heads": (lambda v, c: v == 1, "1 (one shared K=V head)"),
    "n_shared_experts": (lambda v, c: v == 1, "1"),
    "norm_topk_prob": (lambda v, c: v is True, "true"),
    "hidden_act": (lambda v, c: v == "silu", "'silu'"),
    "attention_bias": (lambda v, c: v is False, "false"),
    "mlp_bias": (lambda v, c: v is False, "false"),
    "topk_method": (lambda v, c: v == "noaux_tc", "'noaux_tc' (top-k of scores + correction bias)"),
}
LEGACY = {"compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
          "expert_dtype", "partial_rotary_factor", "compress_rates", "rope_theta", "compress_rope_theta",
          "rope_parameters", "rope_scaling", "quantization_config"}


@dataclass(frozen=True)
class DeepseekV4Config:
    model_type: ClassVar[str] = "deepseek_v4"
    architecture: ClassVar[str] = "DeepseekV4ForCausalLM"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope: RopeConfig  # sliding layers
    compress_rope: RopeConfig  # CSA / HCA layers, their compressors and the indexer
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    quantization: str | None = None  # None or "fp8"
    expert_dtype: str = "fp4"  # with fp8: the experts' format ("fp4": MXFP4)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise RunnerError(f"config: {f.name} must be an integer >= 0, got {value!r}")
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            bad = [t for t in types if t not in allowed]
            if bad:
                raise RunnerError(f"config: {name} entry {bad[0]!r} is not implemented ({', '.join(allowed)})")
            if len(types) != n:
                raise RunnerError(f"config: {name} must name a type for each of the {n} layers, got {len(types)}")
        if self.scoring_func not in SCORING_FUNCS:
            raise RunnerError(f"config: scoring_func {self.scoring_func!r} is not implemented "
                              f"({', '.join(SCORING_FUNCS)})")
        if self.quantization not in (None, "fp8"):
            raise RunnerError(f"config: quantization {self.quantization!r} is not implemented (fp8)")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise RunnerError(f"config: expert_dtype {self.expert_dtype!r} is not implemented "
                              f"({', '.join(EXPERT_DTYPES)})")
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise RunnerError(f"config: {name} must be a multiple of 32 (the K of an MXFP4 expert GEMM), "
                                  f"got {getattr(self, name)}")
        rope = self.qk_rope_head_dim
        if rope % 2 or not 0 < rope <= min(self.head_dim, self.index_head_dim):
            raise RunnerError(f"config: the rotated dims (head_dim x partial_rotary_factor) must be even and in "
                              f"(0, min(head_dim, index_head_dim)], got {rope}")
        if (self.num_attention_heads * self.head_dim) % max(self.o_groups, 1) or self.o_groups < 1:
            raise RunnerError(f"config: o_groups must divide num_attention_heads x head_dim, got {self.o_groups}")
        for name in ("csa_rate", "hca_rate", "sliding_window", "index_topk", "num_experts_per_tok", "hc_mult"):
            if getattr(self, name) < 1:
                raise RunnerError(f"config: {name} must be at least 1, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise RunnerError(f"config: num_experts_per_tok must be at most n_routed_experts = "
                              f"{self.n_routed_experts}, got {self.num_experts_per_tok}")

    def is_moe_layer(self, layer: int) -> bool:
        return True  # every V4 layer is MoE (hash-routed or top-k routed)

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0: a sliding-window layer, no compressor)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    @classmethod
    def from_dict(cls, values: dict) -> "DeepseekV4Config":
        """Parse a ``config.json`` dict: every key is read, checked or listed as without effect (else an error)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "compress_rope", "quantization", "csa_rate",
                                                             "hca_rate", "qk_rope_head_dim", "expert_dtype"}
        check_keys(values, cls.model_type, [], CHECKED, names | NO_EFFECT | LEGACY)
        v = {**DEFAULTS, **values}
        n = v["num_hidden_layers"]
        rates = {**DEFAULT_RATES, **(v.get("compress_rates") or {})}
        unknown = sorted(set(rates) - {CSA, HCA})
        if unknown:
            raise RunnerError(f"config: compress_rates key {unknown[0]!r} is not implemented ({CSA}, {HCA})")
        rates[CSA], rates[HCA] = v.get("compress_rate_csa", rates[CSA]), v.get("compress_rate_hca", rates[HCA])
        layer_types = v.get("layer_types")
        if layer_types is None and v.get("compress_ratios") is not None:
            bad = [r for r in v["compress_ratios"] if r not in RATIO_TO_TYPE]
            if bad:
                raise RunnerError(f"config: compress_ratios entry {bad[0]!r} is not implemented (0, 4, 128)")
            layer_types = [RATIO_TO_TYPE[r] for r in v["compress_ratios"]]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = v.get("mlp_layer_types")
        if mlp_types is None:
            hashed = v.get("num_hash_layers", DEFAULT_HASH_LAYERS)
            mlp_types = [HASH_MOE] * min(n, hashed) + [MOE] * max(n - hashed, 0)
        head_dim = v["head_dim"]
        factor = v.get("partial_rotary_factor")
        rope_dims = (int(head_dim * factor) if factor is not None else v.get("qk_rope_head_dim", 64))
        quantization = parse_quantization(v.get("quantization_config"), extra_keys={"expert_dtype"})
        expert_dtype = (v.get("quantization_config") or {}).get("expert_dtype", v.get("expert_dtype", "fp4"))
        main, compress = rope_configs(v)
        fields = {k: v[k] for k in names if k in v}
        return cls(**{**fields, "layer_types": tuple(layer_types[:n]), "mlp_layer_types": tuple(mlp_types[:n])},
                   csa_rate=rates[CSA], hca_rate=rates[HCA], qk_rope_head_dim=rope_dims, rope=main,
                   compress_rope=compress, quantization=quantization, expert_dtype=expert_dtype)

    def to_dict(self) -> dict:
        """transformers' form (nested ``rope_parameters``; ``quantization_config`` for FP8 weights)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("rope", "compress_rope", "quantization", "csa_rate", "hca_rate",
                                    "qk_rope_head_dim", "expert_dtype")}
        factor = self.qk_rope_head_dim / self.head_dim
        values.update(layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_layer_types),
                      compress_rates={CSA: self.csa_rate, HCA: self.hca_rate}, partial_rotary_factor=factor,
                      rope_theta=self.rope.theta, compress_rope_theta=self.compress_rope.theta,
                      rope_parameters={"main": {**self.rope.to_parameters(), "partial_rotary_factor": factor},
                                       "compress": {**self.compress_rope.to_parameters(),
                                                    "partial_rotary_factor": factor}},
                      model_type=self.model_type, architectures=[self.architecture], hidden_act="silu",
                      num_key_value_heads=1, n_shared_experts=1, norm_topk_prob=True)
        if self.quantization == "fp8":
            values["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                                             "expert_dtype": self.expert_dtype}
        return values


def rope_configs(values: dict) -> tuple[RopeConfig, RopeConfig]:
    """The sliding layers' RoPE (plain, ``rope_theta``) and the compressed layers' (``compress_rope_theta`` with the
    YaRN fields, ``attention_factor`` 1 unless given), from a config.json dict with transformers' defaults."""
    if values.get("rope_parameters") and values.get("rope_scaling"):
        raise RunnerError("config: both rope_parameters and rope_scaling are given (one RoPE form, please)")
    params = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": values["rope_theta"]}
        compress = {**{k: v for k, v in params.items() if k not in ("main", "compress")},
                    "rope_theta": values["compress_rope_theta"]}
        if compress.get("rope_type", compress.get("type", "default")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    out = []
    for part in (main, compress):
        part.pop("partial_rotary_factor", None)
        part.pop("truncate", None)  # transformers reads it from the outer dict: always truncated
        out.append(RopeConfig.from_config({"rope_parameters": part,
                                           "max_position_embeddings": values["max_position_embeddings"]}))
    return out[0], out[1]


def tiny_config(**overrides) -> DeepseekV4Config:
    """A V4 small enough for the Triton interpreter with every layer type: 4 layers (sliding, CSA, HCA, CSA; the
    first hash-routed), 4 heads of 64 (16 rotated), CSA 4:1 with an indexer of 4 heads x 32 keeping 3 entries, HCA
    8:1, window 8, 2 residual streams, 6 experts top-2: a prompt of a few dozen tokens makes every compressor emit
    entries and the indexer keep fewer than it scores."""
    values = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
                  qk_rope_head_dim=16, q_lora_rank=48, o_groups=2, o_lora_rank=32, sliding_window=8,
                  layer_types=(SLIDING, CSA, HCA, CSA), csa_rate=4, hca_rate=8, index_n_heads=4, index_head_dim=32,
                  index_topk=3, mlp_layer_types=(HASH_MOE, MOE, MOE, MOE), n_routed_experts=6, num_experts_per_tok=2,
                  moe_intermediate_size=32, routed_scaling_factor=1.5, swiglu_limit=10.0, scoring_func="sqrtsoftplus",
                  hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, rope=RopeConfig(10000.0),
                  compress_rope=RopeConfig(160000.0, "yarn", factor=4.0, original_max_position_embeddings=64,
                                           beta_fast=32, beta_slow=1, attention_factor=1.0),
                  max_position_embeddings=256)
    return DeepseekV4Config(**{**values, **overrides})
