"""Dense GEMMs on quantized weights: blockwise-FP8 (DeepSeek-V3 / V3.2 checkpoints).

The op is ``dt.fp8_blockwise_linear``; importing the package registers its kernel.
"""
from . import fp8_blockwise_linear_spec  # noqa: F401  (registers it)
