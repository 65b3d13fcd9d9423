"""A minimal DeepSeek-V3.2 model runner on the dsa_triton ops: config, checkpoint loader (Hugging Face layout,
FP8 / MXFP4 / bf16 weights), model (kernel or reference backend), paged cache manager and an offline batch engine
(one process, or expert parallel over a ``torch.distributed`` group: :mod:`.distributed`).
``python -m model_runner --help``."""
from .build import build_engine
from .cache_manager import CacheManager
from .config import ModelConfig, RopeConfig, tiny_config
from .cuda_graphs import DecodeGraphs
from .engine import Engine
from .errors import RunnerError
from .loader import Checkpoint, load_checkpoint
from .model import Model
from .profiling import StepProfiler
from .sampling import SamplingParams
from .tiny import make_tiny, save_random_checkpoint

__all__ = ["ModelConfig", "RopeConfig", "tiny_config", "RunnerError", "Checkpoint", "load_checkpoint",
           "save_random_checkpoint", "make_tiny", "Model", "CacheManager", "Engine", "SamplingParams", "build_engine",
           "DecodeGraphs", "StepProfiler"]
