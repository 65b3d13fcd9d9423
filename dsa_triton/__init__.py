"""dsa-triton: Triton kernels for DeepSeek-style sparse attention and MXFP4 mixture-of-experts.

``import dsa_triton as dt``; ``dt.registry.kernels()`` lists the registered (tunable) kernels, whose launch configs
come from the tuning database the registry opens on first use (:func:`dt.registry.use_database` picks another).
Without a GPU, kernels run on CPU tensors in the Triton interpreter (set up by :mod:`.runtime`).
"""
from . import runtime  # noqa: F401  (first: sets TRITON_INTERPRET=1 when there is no GPU)
from . import registry
from .registry import ConfigError

# attention: paged caches, indexer scoring (token and block level), top-k, sparse attention, V4's compressors
from .attention.append_tokens import append_tokens
from .attention.block_indexer_logits import block_indexer_logits, block_scores, indexer_path, selected_page_logits
from .attention.cache import PageAllocator, PagedCache
from .attention.compress_entries import compress_entries
from .attention.formats import (fp8_latent_bytes, fp8_latent_dequantize, fp8_latent_quantize, fp8_quantize_rows,
                                model1_bytes, model1_cache, model1_dequantize, model1_quantize)
from .attention.indexer_logits import indexer_logits
from .attention.select_pages import select_pages
from .attention.sparse_attention import sparse_attention_decode, sparse_attention_prefill
from .attention.topk_indices import topk_indices
from .attention.v4_indexer_logits import v4_indexer_logits
# linear: dense layers on blockwise-FP8 weights
from .linear.fp8_blockwise_linear import fp8_blockwise_linear
# moe: MXFP4 format and conversion, workspace, routing, grouped GEMMs, the layer
from .moe.activation import swiglu
from .moe.fp8_grouped_gemm import fp8_grouped_gemm
from .moe.fused_moe_gemm import fused_moe_gemm
from .moe.moe_forward import moe_forward
from .moe.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .moe.mxfp4_to_fp8 import mxfp4_to_fp8
from .moe.permute import ExpertSort, sort_by_expert
from .moe.route_topk import route_topk
from .moe.routing import RoutingConfig, deepseek_topk, route, softmax_topk
from .moe.sort_and_align import sort_and_align
from .moe.workspace import FP8Workspace, shared_workspace
# the registry entries (the *_spec modules, imported by each subpackage); the op modules above registered their
# custom ops under torch.ops.dsa (dt.library: OPS and what the custom ops share)
from . import attention, linear, moe  # noqa: E402,F401
from . import library  # noqa: E402,F401

__all__ = [
    "registry", "ConfigError",
    # attention
    "PageAllocator", "PagedCache", "append_tokens", "fp8_latent_bytes", "fp8_latent_dequantize",
    "fp8_latent_quantize", "fp8_quantize_rows", "model1_bytes", "model1_cache", "model1_dequantize",
    "model1_quantize", "indexer_logits", "block_scores", "select_pages",
    "selected_page_logits", "block_indexer_logits", "indexer_path", "sparse_attention_decode",
    "sparse_attention_prefill", "topk_indices", "compress_entries", "v4_indexer_logits",
    # linear
    "fp8_blockwise_linear",
    # moe
    "mxfp4_quantize", "mxfp4_dequantize", "mxfp4_to_fp8", "FP8Workspace", "shared_workspace", "fp8_grouped_gemm",
    "RoutingConfig", "deepseek_topk", "softmax_topk", "route", "route_topk", "ExpertSort", "sort_by_expert",
    "sort_and_align", "fused_moe_gemm", "swiglu", "moe_forward",
]
