"""DeepSeek-V4 (``model_type`` "deepseek_v4", transformers' ``DeepseekV4ForCausalLM``): config :mod:`.config`,
weights :mod:`.weights`, caches :mod:`.cache`, layer blocks :mod:`.attention`, :mod:`.hyper`, :mod:`.moe`, model
:mod:`.model`."""
from __future__ import annotations

from ..family import Family
from .cache import layout
from .config import DeepseekV4Config, tiny_config
from .model import INDEX_PRECISIONS, Model
from .weights import load_weights, random_tensors, random_weights, reduced

FAMILY = Family(config=DeepseekV4Config, tiny_config=tiny_config, load_weights=load_weights,
                random_tensors=random_tensors, random_weights=random_weights, reduced=reduced, build_model=Model,
                cache_layout=layout, index_precisions=INDEX_PRECISIONS)
