"""An engine from a checkpoint folder (or a config and random weights): backend, weights, model, caches, CUDA
graphs, memory plan, and the expert-parallel group when there is one."""
from __future__ import annotations

from pathlib import Path

import torch

from dsa_triton.runtime import interpreting

from .cache_manager import CacheManager
from .cuda_graphs import DecodeGraphs, unavailable_reason
from .distributed import Parallel
from .engine import Engine
from .errors import RunnerError
from .families import family_of, read_config
from .loader import Checkpoint
from .memory import memory_plan
from .ops import KernelOps, ReferenceOps
from .profiling import StepProfiler

KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # what the attention and MoE kernels take


def config_file(model: str | Path) -> Path:
    """A model's config.json: ``model`` itself when it is a file, else ``model/config.json``."""
    return Path(model) if Path(model).is_file() else Path(model) / "config.json"


def build_engine(folder: str | Path, *, mode: str = "kernel", dtype: torch.dtype, device, num_pages: int = 64,
                 page_size: int = 16, max_seqs: int = 8, max_seq_len: int = 256, max_num_batched_tokens: int = 256,
                 seed: int = 0, poison: bool = False, check_values: bool = True, index_precision: str | None = None,
                 dequantize_fp8: bool = False, kv_cache: str = "activation", indexer_path: dict[str, str] | None = None,
                 cuda_graphs: bool = True, profile: bool = False, random_layers: int | None = None,
                 parallel: Parallel | None = None) -> Engine:
    """Load the checkpoint ``folder`` (its config.json, whose ``model_type`` picks the family: :mod:`.families`)
    into a model on the ``mode`` backend ("kernel" or "reference") with its caches (the family's layout);
    ``random_layers``: no checkpoint, random weights drawn on ``device`` from ``seed`` for that many layers of the
    config at every width (:mod:`.random_weights`; ``folder`` may then be the config.json itself). ``check_values``:
    see :class:`.ops.KernelOps`; ``index_precision``: see :mod:`.model` (None: the family's default);
    ``dequantize_fp8``: FP8 projections to ``dtype`` at load instead of the FP8 GEMM; ``kv_cache``: latent cache
    rows in ``dtype`` ("activation") or DeepSeek's FP8 latent cache ("fp8", :mod:`.latent_cache`); ``indexer_path``:
    ``{"decode": ..., "prefill": ...}`` of :data:`.index_path.PATHS`; ``cuda_graphs``: replay decode steps from CUDA
    graphs where they can be captured (:mod:`.cuda_graphs`; a note says why not elsewhere); ``profile``: profile the
    first decode step and the first prefill step (:mod:`.profiling`); ``parallel``: the group of
    :func:`.distributed.setup` (None: one process): this rank reads and holds only its experts, and the engine runs
    its share of the prompts in step with the other ranks.
    The engine's ``notes`` say what loading did, its ``graphs_note`` whether decode steps replay from CUDA graphs,
    its ``memory`` is the :func:`.memory.memory_plan`."""
    if mode not in ("kernel", "reference"):
        raise RunnerError(f"mode: must be 'kernel' or 'reference', got {mode!r}")
    if mode == "kernel" and dtype not in KERNEL_DTYPES:
        raise RunnerError(f"dtype: kernel mode runs in bfloat16 or float16 (the attention and MoE kernels), got "
                          f"{str(dtype).replace('torch.', '')}; the reference mode takes float32")
    if mode == "kernel" and dtype == torch.bfloat16 and interpreting():
        raise RunnerError("dtype: bfloat16 kernels give wrong results in the Triton interpreter (its bf16 tl.dot); "
                          "use float16 there")
    config = read_config(config_file(folder))
    family = family_of(config)
    index_precision = index_precision or family.index_precisions[0]
    if index_precision not in family.index_precisions:
        raise RunnerError(f"index_precision: must be one of {family.index_precisions} ({config.model_type}), got "
                          f"{index_precision!r}")
    if random_layers is not None:
        config = family.reduced(config, random_layers)
    ops = KernelOps(check_values) if mode == "kernel" else ReferenceOps()
    owned = (parallel.owned(config.n_routed_experts) if parallel is not None
             and any(map(config.is_moe_layer, range(config.num_hidden_layers))) else None)
    if random_layers is None:
        checkpoint = family.load_weights(folder, config, dtype, device, dequantize_fp8=dequantize_fp8, experts=owned)
    else:
        moe = sum(map(config.is_moe_layer, range(config.num_hidden_layers)))
        checkpoint = Checkpoint(family.random_weights(config, dtype, device, seed, owned),
                                [f"random weights (no checkpoint): {config.num_hidden_layers - moe} dense + {moe} MoE "
                                 f"layers at the config's widths, seed {seed}"])
    try:
        model = family.build_model(config, checkpoint.weights, ops, index_precision=index_precision,
                                   indexer_path=indexer_path, parallel=parallel)
    except ValueError as exc:
        raise RunnerError(str(exc)) from None
    layout = family.cache_layout(config, index_precision=index_precision, kv_cache=kv_cache,
                                 step_tokens=max_num_batched_tokens)
    cache = CacheManager(config, num_pages, page_size, max_seqs, max_seq_len, dtype, device, poison=poison,
                         layout=layout)
    engine = Engine(model, cache, max_num_batched_tokens, seed, profiler=StepProfiler() if profile else None)
    engine.notes = checkpoint.notes
    reason = unavailable_reason(model, cache.device) if cuda_graphs else "not asked for: decode steps run eagerly"
    if reason is None:
        engine.graphs = DecodeGraphs(model, cache, max_seqs, capture=True)
        engine.graphs_note = f"decode steps replayed, batch buckets {engine.graphs.buckets}"
    else:
        engine.graphs_note = f"off ({reason})"
    engine.memory = memory_plan(checkpoint.weights, cache, model, max_num_batched_tokens)
    if owned is not None:
        engine.notes.append(f"expert parallel: rank {parallel.rank} of {parallel.world_size} holds experts "
                            f"{owned.start}..{owned.stop - 1} of {config.n_routed_experts} in each MoE layer")
        engine.memory.update(parallel.memory(config, max_num_batched_tokens, dtype))
    return engine
