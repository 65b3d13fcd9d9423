from .cache import PageAllocator, PagedCache, append_tokens, fp8_quantize_rows  # noqa: F401
from .sparse_attention import sparse_attention_decode, sparse_attention_prefill  # noqa: F401
from . import sparse_attention_spec  # noqa: F401  (registers the kernels and the latency report)
from .topk import topk_indices  # noqa: F401
