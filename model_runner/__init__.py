"""A minimal model runner on the dsa_triton ops for the model families of :mod:`.families` (DeepSeek-V3.2, GLM-5,
DeepSeek-V4, chosen by config.json's ``model_type``): config, checkpoint loader (Hugging Face layout, FP8 / MXFP4 /
bf16 weights), model (kernel or reference backend), paged cache manager and an offline batch engine (one process,
or expert parallel over a ``torch.distributed`` group: :mod:`.distributed`). ``python -m model_runner --help``."""
from .build import build_engine
from .cache_manager import CacheManager
from .config import ModelConfig, RopeConfig, tiny_config
from .cuda_graphs import DecodeGraphs
from .engine import Engine
from .errors import RunnerError
from .families import load_checkpoint, read_config
from .loader import Checkpoint
from .model import Model
from .profiling import StepProfiler
from .sampling import SamplingParams
from .tiny import make_tiny, save_random_checkpoint

__all__ = ["ModelConfig", "RopeConfig", "tiny_config", "read_config", "RunnerError", "Checkpoint", "load_checkpoint",
           "save_random_checkpoint", "make_tiny", "Model", "CacheManager", "Engine", "SamplingParams", "build_engine",
           "DecodeGraphs", "StepProfiler"]
