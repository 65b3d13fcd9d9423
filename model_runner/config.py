"""The model's sizes, read from a DeepSeek-V3.2-style ``config.json`` (Hugging Face field names).

Fields read (all required unless a default is shown):

- trunk: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``first_k_dense_replace`` (leading dense layers),
  ``intermediate_size`` (their MLP), ``rms_norm_eps``, ``rope_theta``;
- MLA: ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``;
- MoE: ``n_routed_experts``, ``n_shared_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_group``,
  ``topk_group``, ``routed_scaling_factor``, ``norm_topk_prob`` (sigmoid scores + correction bias, ``noaux_tc``);
- DSA indexer: ``index_n_heads``, ``index_head_dim``, ``index_topk``.

Not read: ``rope_scaling`` (YaRN: plain RoPE with ``rope_theta`` and softmax scale ``qk_head_dim^-0.5`` here),
the FP8 ``quantization_config`` of the released weights, and tokenizer fields.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
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
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{f.name}: must be an integer >= 0, got {value!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace: must be in [0, num_hidden_layers = {self.num_hidden_layers}]")
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name}: must be a multiple of 32 (the K of an MXFP4 expert GEMM), "
                                 f"got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim: must be even and at most index_head_dim, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row: ``kv_lora_rank + qk_rope_head_dim`` (576 in DeepSeek-V3.2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in values)
        if missing:
            raise ValueError(f"config: missing field(s) {', '.join(missing)}")
        if values.get("scoring_func", "sigmoid") != "sigmoid" or values.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError("config: only scoring_func 'sigmoid' with topk_method 'noaux_tc' is supported")
        return cls(**{k: v for k, v in values.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


def tiny_config(**overrides) -> ModelConfig:
    """A tiny model that runs in the Triton interpreter: 3 layers (1 dense), 4 heads, 6 experts top-2,
    indexer 8 heads x 32 with top-k 8 (so a prompt of more than 8 tokens really drops some)."""
    values = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
                  num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                  v_head_dim=16, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2,
                  moe_intermediate_size=32, n_group=3, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  index_n_heads=8, index_head_dim=32, index_topk=8, rms_norm_eps=1e-6, rope_theta=10000.0)
    return ModelConfig(**{**values, **overrides})
