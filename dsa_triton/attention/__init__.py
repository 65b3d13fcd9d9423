"""DSA index selection and attention: paged caches, indexer scoring (token and block level), top-k, sparse attention."""
from .cache import PageAllocator, PagedCache, append_tokens  # noqa: F401
from .cache_reference import fp8_latent_bytes, fp8_latent_dequantize, fp8_latent_quantize, fp8_quantize_rows  # noqa: F401
from .indexer import indexer_logits  # noqa: F401
from .block_scores import block_indexer_logits, block_scores, selected_page_logits  # noqa: F401
from .page_select import select_pages  # noqa: F401
from .sparse_attention import sparse_attention_decode, sparse_attention_prefill  # noqa: F401
from .topk import topk_indices  # noqa: F401
