"""Model families: one engine, scheduler, sampler and CLI over several architectures, chosen by config.json's
``model_type``. A family (:class:`Family`) is a config adapter (names, defaults, validation: its config class's
``from_dict``), a weight-name map with its load procedure (over the shared mechanics of :mod:`..loader`) and its
layer blocks (the model it builds); every per-sequence cache its layers declare is paged and owned by the
:class:`..cache_manager.CacheManager`.

- ``deepseek_v32`` (:mod:`.deepseek_v32`): MLA + the DSA indexer + DeepSeek MoE;
- ``glm_moe_dsa`` (:mod:`.glm_moe_dsa`): GLM-5, the V3.2 blocks with indexer layers that share a top-k;
- ``deepseek_v4`` (:mod:`.deepseek_v4`): sliding-window + compressed (CSA / HCA) attention, mHC, hash MoE.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import RunnerError
from ..loader import Checkpoint
from . import deepseek_v4, deepseek_v32, glm_moe_dsa
from .family import Family


FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (deepseek_v32, glm_moe_dsa, deepseek_v4)}


def family(model_type) -> Family:
    """The family of ``model_type``; a RunnerError naming it and the known ones otherwise."""
    if model_type not in FAMILIES:
        what = "model_type is missing" if model_type is None else f"model_type {model_type!r} is not implemented"
        raise RunnerError(f"config: {what} (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type]


def family_of(config) -> Family:
    """The family of a parsed config."""
    return family(config.model_type)


def read_config(path: str | Path):
    """A config.json file -> its family's config."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RunnerError(f"config: cannot read {path}: {exc}") from None
    if not isinstance(values, dict):
        raise RunnerError(f"config: {path} does not hold a JSON object")
    return family(values.get("model_type")).config.from_dict(values)


def load_checkpoint(folder: str | Path, config, dtype, device, *, dequantize_fp8: bool = False,
                    experts: range | None = None) -> Checkpoint:
    """Read a checkpoint folder of ``config``'s family onto ``device`` (``experts``: only these of each MoE layer)."""
    return family_of(config).load_weights(folder, config, dtype, device, dequantize_fp8=dequantize_fp8,
                                          experts=experts)
