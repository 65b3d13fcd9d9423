from .cache import PageAllocator, PagedCache, append_tokens, fp8_quantize_rows  # noqa: F401
