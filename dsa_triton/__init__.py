"""dsa-triton: Triton kernels for DeepSeek-style sparse attention and MXFP4 mixture-of-experts.

``import dsa_triton as dt``; ``dt.registry.kernels()`` lists the registered (tunable) kernels.
Without a GPU, kernels run on CPU tensors in the Triton interpreter (set up by :mod:`.runtime`).
"""
from . import runtime  # noqa: F401  (first: sets TRITON_INTERPRET=1 when there is no GPU)
from . import registry
from .registry import ConfigError

from tuning_db.database import Database, install  # noqa: E402

install(Database())  # every op reads its launch config from the tuning database ($DSA_TUNING_DB or the packaged one)

# attention: paged caches, indexer scoring (token and block level), top-k, sparse attention
from .attention.cache import PageAllocator, PagedCache, append_tokens  # noqa: E402
from .attention.cache_reference import (fp8_latent_bytes, fp8_latent_dequantize, fp8_latent_quantize,  # noqa: E402
                                        fp8_quantize_rows)
from .attention.indexer import indexer_logits  # noqa: E402
from .attention.block_scores import block_indexer_logits, block_scores, selected_page_logits  # noqa: E402
from .attention.page_select import select_pages  # noqa: E402
from .attention.sparse_attention import sparse_attention_decode, sparse_attention_prefill  # noqa: E402
from .attention.topk import topk_indices  # noqa: E402
from .linear import fp8_blockwise_linear  # noqa: E402  (dense layers on blockwise-FP8 weights)

# moe: MXFP4 format and conversion, workspace, routing, grouped GEMMs, the layer
from .moe import (FP8Workspace, RoutingConfig, deepseek_topk, fp8_grouped_gemm, fused_moe_gemm,  # noqa: E402
                  moe_forward, mxfp4_dequantize, mxfp4_quantize, mxfp4_to_fp8, route, route_topk,
                  softmax_topk, swiglu)

from . import library  # noqa: E402  (every public op as a custom op under torch.ops.dsa)

__all__ = [
    "registry", "ConfigError",
    # attention
    "PageAllocator", "PagedCache", "append_tokens", "fp8_quantize_rows",
    "indexer_logits", "block_scores", "select_pages", "selected_page_logits", "block_indexer_logits",
    "sparse_attention_decode", "sparse_attention_prefill", "topk_indices",
    # moe
    "mxfp4_quantize", "mxfp4_dequantize", "mxfp4_to_fp8", "FP8Workspace", "fp8_grouped_gemm",
    "RoutingConfig", "deepseek_topk", "softmax_topk", "route", "route_topk", "fused_moe_gemm", "swiglu",
    "moe_forward",
    # linear
    "fp8_blockwise_linear",
]
