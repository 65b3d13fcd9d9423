from .cache import PageAllocator, PagedCache, append_tokens, fp8_quantize_rows  # noqa: F401
from .indexer import indexer_logits  # noqa: F401
from .block_scores import block_indexer_logits, block_scores, select_pages, selected_page_logits  # noqa: F401
from . import block_scores_report  # noqa: F401  (registers the report block_scores_recall)
from .sparse_attention import sparse_attention_decode, sparse_attention_prefill  # noqa: F401
from . import sparse_attention_spec  # noqa: F401  (registers the kernels and the latency report)
from .topk import topk_indices  # noqa: F401
from . import topk_report  # noqa: F401  (registers the report topk_speed)
