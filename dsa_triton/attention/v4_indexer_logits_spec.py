"""Registry entry of :func:`~dsa_triton.v4_indexer_logits` (DeepSeek-V4's indexer over compressed keys).

Shapes as :mod:`.indexer_logits_spec`'s: ``B`` sequences, ``Q`` query rows per sequence, ``L`` compressed entries per
sequence, ``P`` page size, ``H`` heads, ``DK`` head dim; problem-only ``M`` the ratio (tokens an entry): a sequence's
rows are its last ``Q`` tokens of ``L M``, row ``j`` scoring the ``(L M - Q + 1 + j) // M`` entries closed before it.
The tuner lays context lengths (tokens) over ``L``, which counts entries: its jobs stand for contexts ``M`` times
longer.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..registry import Cost, KernelSpec
from . import indexer_logits, indexer_logits_kernels, v4_indexer_logits, v4_indexer_logits_reference
from .indexer_logits_spec import compare_logits
from .sparse_attention_spec import random_paged_cache
from .v4_indexer_logits_reference import v4_indexer_logits_torch


def _limits(shape, device) -> torch.Tensor:
    B, Q, L, M = (shape[n] for n in ("B", "Q", "L", "M"))
    return ((L * M - Q + 1 + torch.arange(Q, device=device)).clamp_min(0) // M).repeat(B).int()


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    B, Q, L, P, H, DK = (shape[n] for n in ("B", "Q", "L", "P", "H", "DK"))
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16
    k, table = random_paged_cache(B, L, P, DK, dtype, g)
    return {"q": torch.randn(B * Q, H, DK, generator=g, device=device).to(dtype),
            "weights": torch.randn(B * Q, H, generator=g, device=device) * H ** -0.5, "k": k, "limits": _limits(
                shape, device), "block_table": table, "seq_lens": torch.full((B,), L, dtype=torch.int32, device=device),
            "softmax_scale": DK ** -0.5, "num_cols": L, "max_q": Q,
            "cu_seqlens_q": torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=device)}


def _run(inputs: dict, config: dict) -> torch.Tensor:
    """As a decode loop calls it: sizes given, value checks off (the inputs are valid)."""
    args = [inputs[n] for n in ("q", "weights", "k", "limits", "block_table", "seq_lens", "softmax_scale")]
    return v4_indexer_logits.v4_indexer_logits(*args, cu_seqlens_q=inputs["cu_seqlens_q"], num_cols=inputs["num_cols"],
                                               max_q=inputs["max_q"], check_values=False, config=config)


def _reference(inputs: dict) -> torch.Tensor:
    args = [inputs[n] for n in ("q", "weights", "k", "limits", "block_table", "softmax_scale", "num_cols")]
    return v4_indexer_logits_torch(*args, cu_seqlens_q=inputs["cu_seqlens_q"])


def _cost(phase: str, shape) -> Cost:
    B, Q, L, H, DK = (shape[n] for n in ("B", "Q", "L", "H", "DK"))
    pairs = int(_limits(shape, "cpu")[:Q].sum()) * B  # valid (row, entry) pairs
    return Cost(bytes=B * L * (2 * DK + 4) + B * Q * H * (2 * DK + 4) + B * Q * L * 4, flops=2.0 * pairs * H * DK)


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    """DeepSeek-V4's indexer (64 heads x 128) over 128K tokens' entries on the GPU; odd sizes and pages of 4 on the
    CPU."""
    if gpu:
        if phase == "decode":
            return [{"B": 64, "Q": 1, "L": 32768, "P": 64, "H": 64, "DK": 128, "M": 4}]
        return [{"B": 1, "Q": 4096, "L": 32768, "P": 64, "H": 64, "DK": 128, "M": 4}]
    if phase == "decode":
        return [{"B": 3, "Q": 1, "L": 21, "P": 4, "H": 6, "DK": 32, "M": 4}]
    return [{"B": 2, "Q": 9, "L": 13, "P": 8, "H": 6, "DK": 32, "M": 4}]


SPEC = registry.register(KernelSpec(
    launch=v4_indexer_logits.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_logits,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_reference,
    baseline_name="torch gather + fp32 einsum per sequence (the runner's reference)",
    model_dims=lambda m: [{"P": m.page, "H": m.index_heads, "DK": m.index_dim, "M": m.compress_rate(
        "compressed_sparse_attention")}] if m.v4 else [],
    count_roles={"B": "batch", "Q": "tokens", "L": "context"},
    source_modules=(v4_indexer_logits_reference, indexer_logits_kernels, indexer_logits, v4_indexer_logits,
                    sys.modules[__name__]),
))
