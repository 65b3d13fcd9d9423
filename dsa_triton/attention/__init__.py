"""DSA index selection and attention: paged caches, indexer scoring (token and block level), top-k, sparse attention;
DeepSeek-V4's compressors and indexer over compressed entries.

The ops are ``dt.<op>`` (or ``dsa_triton.attention.<op>.<op>``); importing the package registers their kernels.
"""
from . import (append_tokens_spec, block_indexer_logits_spec, compress_entries_spec,  # noqa: F401  (registers them)
               indexer_logits_spec, select_pages_spec, sparse_attention_spec, topk_indices_spec,
               v4_indexer_logits_spec)
