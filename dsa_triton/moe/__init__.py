"""MXFP4 mixture-of-experts: format, online MXFP4->FP8 conversion, shared FP8 workspace, grouped GEMMs, routing."""
from .convert import mxfp4_to_fp8
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize

__all__ = ["mxfp4_quantize", "mxfp4_dequantize", "mxfp4_to_fp8"]
