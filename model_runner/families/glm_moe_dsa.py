"""GLM-5 (``model_type`` "glm_moe_dsa", Hugging Face ``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's blocks, weights and
caches with two changes (transformers' ``modular_glm_moe_dsa.py``):

- the indexer rotates its rope dims as interleaved pairs (V3.2: NeoX halves);
- ``indexer_types``: a "full" layer runs its indexer, a "shared" one has none (no indexer weights, no indexer cache)
  and attends over the top-k of the last full layer (the first layer must be full). Absent, it follows
  ``index_topk_pattern`` ("F" / "S" per layer) or ``index_topk_freq`` / ``index_skip_topk_offset`` as transformers
  derives it (every layer full by default).

Absent keys take GLM-5's defaults (:data:`DEFAULTS`, transformers' ``GlmMoeDsaConfig``), so a config.json that
relies on them reads as it does in transformers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig, tiny_config as mla_tiny_config
from ..errors import RunnerError
from ..latent_cache import latent_layout
from ..model import INDEX_PRECISIONS, Model
from .family import Family
from .mla_dsa import load_weights, random_tensors, random_weights, reduced as reduced_layers

INDEXER_TYPES = ("full", "shared")
PATTERN_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
DEFAULTS = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256,
                qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                max_position_embeddings=202752, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128,
                index_n_heads=32, first_k_dense_replace=3)


def indexer_types_of(values: dict) -> list[str]:
    """transformers' per-layer indexer modes from a config.json dict: ``indexer_types``, else
    ``index_topk_pattern``, else the ``index_topk_freq`` / ``index_skip_topk_offset`` schedule."""
    layers = values.get("num_hidden_layers", DEFAULTS["num_hidden_layers"])
    if values.get("indexer_types") is not None:
        return list(values["indexer_types"])
    pattern = values.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and set(pattern) - set(letters):
            raise RunnerError(f"config: index_topk_pattern {pattern!r} must hold only F and S")
        return [letters[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(values.get("index_topk_freq", 1), 1), values.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


@dataclass(frozen=True)
class GlmMoeDsaConfig(ModelConfig):
    """:class:`..config.ModelConfig` plus ``indexer_types`` (() = every layer "full")."""
    model_type = "glm_moe_dsa"
    architecture = "GlmMoeDsaForCausalLM"
    index_rope_interleaved = True

    indexer_types: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        types = tuple(self.indexer_types) or ("full",) * self.num_hidden_layers
        if len(types) != self.num_hidden_layers or set(types) - set(INDEXER_TYPES):
            raise RunnerError(f"config: indexer_types must hold one of {INDEXER_TYPES} for each of the "
                              f"{self.num_hidden_layers} layers, got {list(types)}")
        if types[0] != "full":
            raise RunnerError("config: indexer_types[0] must be 'full' (a shared layer reuses an earlier top-k)")
        object.__setattr__(self, "indexer_types", types)

    def runs_indexer(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    @classmethod
    def from_dict(cls, values: dict) -> "GlmMoeDsaConfig":
        """A GLM-5 config.json dict (absent keys: :data:`DEFAULTS`)."""
        values = {**DEFAULTS, **{k: v for k, v in values.items() if k not in PATTERN_KEYS},
                  "indexer_types": tuple(indexer_types_of(values))}
        return super().from_dict(values)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "indexer_types": list(self.indexer_types)}


def alternating(layers: int) -> tuple[str, ...]:
    """Indexer types full, shared, full, ... for ``layers`` layers."""
    return tuple(INDEXER_TYPES[i % 2] for i in range(layers))


def tiny_config(**overrides) -> GlmMoeDsaConfig:
    """:func:`..config.tiny_config`'s sizes (3 layers) with full and shared indexer layers alternating."""
    mla = mla_tiny_config(**{k: v for k, v in overrides.items() if k != "indexer_types"})
    values = {f.name: getattr(mla, f.name) for f in dataclasses.fields(ModelConfig)}
    return GlmMoeDsaConfig(**values, indexer_types=overrides.get("indexer_types", alternating(mla.num_hidden_layers)))


def reduced(config: GlmMoeDsaConfig, layers: int) -> GlmMoeDsaConfig:
    """``config`` with ``layers`` layers at every width (:func:`.mla_dsa.reduced`), indexer types alternating."""
    return reduced_layers(config, layers, indexer_types=alternating(layers))


FAMILY = Family(config=GlmMoeDsaConfig, tiny_config=tiny_config, load_weights=load_weights,
                random_tensors=random_tensors, random_weights=random_weights, reduced=reduced, build_model=Model,
                cache_layout=latent_layout, index_precisions=INDEX_PRECISIONS)
