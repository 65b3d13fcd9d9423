"""DeepSeek-V3.2 (``model_type`` "deepseek_v32"): the config :class:`..config.ModelConfig`, the weights
:mod:`.mla_dsa`, the layer blocks :mod:`..model` (MLA in the absorbed form over the paged latent cache, the DSA
indexer, DeepSeek MoE)."""
from __future__ import annotations

from ..config import ModelConfig, tiny_config
from ..latent_cache import latent_layout
from ..model import INDEX_PRECISIONS, Model
from .family import Family
from .mla_dsa import load_weights, random_tensors, random_weights, reduced

FAMILY = Family(config=ModelConfig, tiny_config=tiny_config, load_weights=load_weights, random_tensors=random_tensors,
                random_weights=random_weights, reduced=reduced, build_model=Model, cache_layout=latent_layout,
                index_precisions=INDEX_PRECISIONS)
