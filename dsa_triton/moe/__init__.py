"""MXFP4 mixture-of-experts: format, online MXFP4->FP8 conversion, shared FP8 workspace, grouped GEMMs, routing.

The ops are ``dt.<op>`` (or ``dsa_triton.moe.<op>.<op>``); importing the package registers their kernels.
"""
from . import (fp8_grouped_gemm_spec, fused_moe_gemm_spec, moe_forward_spec, mxfp4_spec,  # noqa: F401  (registers them)
               mxfp4_to_fp8_spec, route_topk_spec, sort_and_align_spec)
