"""Benchmark reports beyond the per-kernel rows (recall, path-vs-path ratios, latency, memory).

Each report is ``fn(device, ceilings) -> rows`` (dicts, one per line of the report); ``python -m dsa_triton.bench``
runs them after the kernels and writes their rows to its results file. ``ceilings`` is ``None`` in the
interpreter, where a report uses tiny shapes.
"""
from __future__ import annotations

from typing import Any, Callable

from . import (block_scores_recall, moe_decode, moe_prefill, sparse_attention_flashmla, sparse_attention_fp8,
               sparse_attention_latency, topk_speed)

Report = Callable[..., list[dict[str, Any]]]

REPORTS: dict[str, Report] = {
    "block_scores_recall": block_scores_recall.report,
    "moe_decode": moe_decode.moe_decode_report,
    "moe_layer_decode": moe_decode.moe_layer_decode_report,
    "moe_prefill": moe_prefill.moe_prefill_report,
    "sparse_attention_decode_latency": sparse_attention_latency.decode_latency_report,
    "sparse_attention_fp8_cache": sparse_attention_fp8.fp8_cache_report,
    "sparse_attention_flashmla": sparse_attention_flashmla.flashmla_report,
    "topk_routes": topk_speed.topk_routes_report,
    "topk_speed": topk_speed.topk_speed_report,
}
