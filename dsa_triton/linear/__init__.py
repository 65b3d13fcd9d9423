"""Dense GEMMs on quantized weights: blockwise-FP8 (DeepSeek-V3 / V3.2 checkpoints)."""
from .fp8_linear import fp8_blockwise_linear  # noqa: F401
