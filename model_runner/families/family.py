"""The interface of a model family (:mod:`model_runner.families`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    """What the shared runner asks of an architecture.

    - ``config``: the config class: ``from_dict(config.json dict)`` (a one-line RunnerError naming an unknown key,
      layer type, scoring function or quantization method), ``to_dict()``, ``model_type``, ``num_hidden_layers``,
      ``vocab_size``, ``hidden_size``, ``is_moe_layer(i)``;
    - ``tiny_config(**overrides)``: a config small enough for the Triton interpreter, every layer type present;
    - ``load_weights(folder, config, dtype, device, *, dequantize_fp8, experts)`` -> :class:`..loader.Checkpoint`;
    - ``random_tensors(config, experts, dense, seed)``: a random checkpoint's tensors (names as saved);
    - ``random_weights(config, dtype, device, seed, experts)``: what ``load_weights`` returns, drawn at random;
    - ``reduced(config, layers)``: ``config`` with ``layers`` layers at every width, every layer type kept;
    - ``build_model(config, weights, ops, *, index_precision, indexer_path, parallel)``: the model (``forward``,
      ``idle``, ``config``, ``ops``, ``parallel``, ``index_precision``; ``decode_graphs``, whether its decode steps
      can replay from CUDA graphs at all, and ``graph_obstacle()``, what keeps them out as built: :mod:`..cuda_graphs`);
    - ``cache_layout(config, *, index_precision, kv_cache, step_tokens)``: the caches its layers declare, a
      :class:`..cache_manager.CacheManager` layout (``step_tokens``: the most tokens a step runs);
    - ``index_precisions``: the indexer precisions it implements, the first its default.
    """
    config: type
    tiny_config: Callable
    load_weights: Callable
    random_tensors: Callable
    random_weights: Callable
    reduced: Callable
    build_model: Callable
    cache_layout: Callable
    index_precisions: tuple[str, ...]

    @property
    def model_type(self) -> str:
        return self.config.model_type
