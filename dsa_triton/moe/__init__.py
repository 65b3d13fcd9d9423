"""MXFP4 mixture-of-experts: format, online MXFP4->FP8 conversion, shared FP8 workspace, grouped GEMMs, routing."""
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize  # first: later ops' specs draw inputs from its spec
from .mxfp4_to_fp8 import mxfp4_to_fp8
from .routing import RoutingConfig, deepseek_topk, route, softmax_topk
from .route_topk import route_topk
from .permute import ExpertSort, sort_by_expert
from .sort_and_align import sort_and_align
from .fused_moe import fused_moe_gemm
from .activation import swiglu
from .layer import moe_forward
from .workspace import FP8Workspace, shared_workspace
from .fp8_grouped_gemm import fp8_grouped_gemm

__all__ = ["mxfp4_quantize", "mxfp4_dequantize", "mxfp4_to_fp8"]
__all__ += ["RoutingConfig", "deepseek_topk", "softmax_topk", "route", "route_topk", "ExpertSort", "sort_by_expert",
            "sort_and_align", "fused_moe_gemm", "swiglu", "moe_forward"]
__all__ += ["FP8Workspace", "shared_workspace", "fp8_grouped_gemm"]
