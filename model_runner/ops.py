"""The DSA / MoE ops the model calls, in two interchangeable backends with the same methods:

- :class:`KernelOps`: the dsa_triton ops (Triton kernels; the interpreter on a CPU);
- :class:`ReferenceOps`: the pure-PyTorch ``*_torch`` references beside those kernels (outputs cast to the
  activation dtype, as the kernels return them).

Shapes: ``q8[T, IH, ID]`` e4m3 indexer queries with ``w[T, IH]`` fp32 head weights; ``scores[T, L]`` fp32;
``slots[T, k]`` int32 physical cache rows (-1 unused); ``block_topk``: the block-level indexer path
(:mod:`.index_path`) from query to slots, ``n_select`` pages a token; attention ``q[T, H, kv_lora + rope]`` ->
``[T, H, kv_lora]`` over latent rows in the activation dtype or in the FP8 layout (both backends dequantize uint8
rows themselves);
``linear(x[T, K], w)``: ``w`` a ``[N, K]`` tensor in ``x``'s dtype or an :class:`FP8Weight`.
Expert parallel (:mod:`.distributed`): ``route(logits[T, E] fp32, routing, bias)`` -> ``(weights [T, top_k] fp32,
ids [T, top_k])``; ``experts(rows[N, H], ids[N] local expert of each row, *experts)`` -> ``[N, H]`` fp32, unweighted.
``routed_experts(x[T, H], ids[T, k], weights[T, k] fp32, experts, swiglu_limit)`` -> ``[T, H]`` fp32: the MXFP4
experts after a routing of the caller's, their gate clipped to ``<= limit`` and up to ``[-limit, limit]`` before the
SwiGLU (DeepSeek-V4); the kernel backend composes the fused MXFP4 GEMMs with the clip between them (dt.moe_experts
has no clip).

DeepSeek-V4 (caches in the activation dtype; the compressors and the indexer read pages ``[pages, P, width]`` through
each stream's block table): ``compress_entries`` writes the entries of the windows closing in the step (``dt.compress_entries``'s
arguments, the sequences' from ``batch``); ``v4_indexer_logits(q[T, IH, ID], w[T, IH] fp32, keys, limits[T],
table, counts[B], scale, num_cols, batch)`` -> ``[T, num_cols]`` fp32; ``topk_entries(logits, k, limits, batch)`` ->
``[T, k]`` logical entries (-1: none; among equal scores the lower entry, in both backends: transformers'
``torch.topk`` may take another one of exactly equal scores, such as the zeros of entries every head's relu cuts);
``v4_attention(q[T, H, hd], sets, sinks[H] fp32, sm_scale, batch)`` -> ``[T, H, hd]`` over the union of the index
sets ``[(cache rows [slots, hd], physical slots [T, k] (-1: none))]`` (the window, then the compressed entries) with
a sink per head.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

import dsa_triton as dt
from dsa_triton.attention.append_tokens_reference import append_torch
from dsa_triton.attention.block_indexer_logits_reference import gather_selected_torch, page_bounds_torch
from dsa_triton.attention.compress_entries_reference import compress_entries_torch
from dsa_triton.attention.indexer_logits_reference import indexer_logits_torch
from dsa_triton.attention.select_pages_reference import select_pages_torch
from dsa_triton.attention.sparse_attention_reference import (sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)
from dsa_triton.attention.topk_indices_reference import topk_indices_torch
from dsa_triton.attention.v4_indexer_logits_reference import v4_indexer_logits_torch
from dsa_triton.linear.fp8_blockwise_linear_reference import fp8_blockwise_linear_torch
from dsa_triton.moe.activation_reference import swiglu_torch
from dsa_triton.moe.moe_forward import moe_experts
from dsa_triton.moe.moe_forward_reference import moe_experts_torch, moe_forward_torch
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch
from dsa_triton.moe.permute import combine_rows
from dsa_triton.moe.routing_reference import route_torch

from .cache_manager import PagedBatch
from .index_path import positions_to_slots


class FP8Weight(NamedTuple):
    """A checkpoint's blockwise-FP8 projection: ``weight[N, K]`` e4m3 and ``scale_inv[ceil(N/128), ceil(K/128)]``."""
    weight: torch.Tensor
    scale_inv: torch.Tensor


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def union_args(sets: list) -> dict:
    """The sparse-attention keywords of a second index set ``(cache rows, slots[, lengths])`` (none for one set):
    ``lengths [T]`` int32, where given, counts each row's leading slots that can be valid (the rest are -1 and are not
    walked)."""
    if len(sets) < 2:
        return {}
    rows, slots, *lengths = sets[1]
    return {"extra_kv_cache": rows, "extra_indices": slots, **({"extra_topk_length": lengths[0]} if lengths else {})}


def clip_gate_up(h: torch.Tensor, limit: float) -> torch.Tensor:
    """``h[M, 2I]`` (gate | up) with gate clipped to ``<= limit`` and up to ``[-limit, limit]``."""
    gate, up = h.chunk(2, dim=-1)
    return torch.cat([gate.clamp(max=limit), up.clamp(-limit, limit)], dim=-1)


class KernelOps:
    """``check_values=False`` skips the ops' value checks (lengths, block-table entries, index ranges: a host sync
    per call); the runner builds those inputs itself, so on a GPU they are known good."""
    name = "kernel"

    def __init__(self, check_values: bool = True):
        self.check_values = check_values

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, FP8Weight):
            return _add_bias(dt.fp8_blockwise_linear(x, *w, check_values=self.check_values), bias)
        return F.linear(x, w, bias)

    @staticmethod
    def swiglu(h: torch.Tensor) -> torch.Tensor:
        return dt.swiglu(h)

    def append(self, cache: dt.PagedCache, kv: torch.Tensor, index_k: torch.Tensor, batch: PagedBatch) -> None:
        dt.append_tokens(cache.kv, cache.ik, cache.ik_scale, cache.summaries, kv, index_k, batch.items,
                         rope_dim=cache.rope_dim, check_values=self.check_values)

    def indexer_logits(self, q8, w, cache: dt.PagedCache, batch: PagedBatch) -> torch.Tensor:
        return dt.indexer_logits(q8, w, cache.ik, cache.ik_scale, batch.limits, cu_seqlens_q=batch.cu_seqlens,
                                 block_table=batch.block_table, seq_lens=batch.seq_lens, num_cols=batch.num_cols,
                                 max_q=batch.max_q, check_values=self.check_values)

    def topk(self, scores, k: int, page_size: int, batch: PagedBatch) -> torch.Tensor:
        return dt.topk_indices(scores, k, batch.limits, block_table=batch.block_table, page_size=page_size,
                               row_to_seq=batch.row_to_seq, check_values=self.check_values)

    def block_topk(self, q8, w, cache: dt.PagedCache, batch: PagedBatch, k: int, n_select: int) -> torch.Tensor:
        logits, positions = dt.block_indexer_logits(
            q8, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, batch.block_table, batch.seq_lens, batch.limits,
            n_select, cu_seqlens_q=batch.cu_seqlens, max_len=batch.num_cols, max_q=batch.max_q,
            check_values=self.check_values)
        columns = dt.topk_indices(logits, k, check_values=self.check_values)
        return positions_to_slots(columns, positions, batch, cache.page_size)

    def attention(self, q, kv_cache, slots, sm_scale: float, d_v: int, decode: bool) -> torch.Tensor:
        op = dt.sparse_attention_decode if decode else dt.sparse_attention_prefill
        return op(q, kv_cache, slots, sm_scale, d_v, check_values=self.check_values)[0]

    def compress_entries(self, kv, gate, kv_window, gate_window, window_table, entries, entry_table,
                         batch: PagedBatch, *args, **kwargs) -> None:
        dt.compress_entries(kv, gate, kv_window, gate_window, window_table, entries, entry_table, batch.cu_seqlens,
                            batch.seq_lens, *args, **kwargs, max_q=batch.max_q, check_values=self.check_values)

    def v4_indexer_logits(self, q, w, keys, limits, table, counts, scale: float, num_cols: int,
                          batch: PagedBatch) -> torch.Tensor:
        return dt.v4_indexer_logits(q, w, keys, limits, table, counts, scale, cu_seqlens_q=batch.cu_seqlens,
                                    num_cols=num_cols, max_q=batch.max_q, check_values=self.check_values)

    def topk_entries(self, logits, k: int, limits, batch: PagedBatch) -> torch.Tensor:
        return dt.topk_indices(logits, k, limits, check_values=self.check_values)

    def v4_attention(self, q, sets: list, sinks, sm_scale: float, batch: PagedBatch) -> torch.Tensor:
        op = dt.sparse_attention_decode if batch.decode else dt.sparse_attention_prefill
        return op(q, *sets[0], sm_scale, q.shape[-1], check_values=self.check_values, attn_sink=sinks,
                  **union_args(sets))[0]

    @staticmethod
    def moe(x, *args, **kwargs) -> torch.Tensor:
        return dt.moe_forward(x, *args, **kwargs)

    @staticmethod
    def route(logits, routing, bias) -> tuple[torch.Tensor, torch.Tensor]:
        return dt.route_topk(logits, routing, bias, check_values=False)  # as dt.moe_forward routes

    def experts(self, rows, ids, *experts) -> torch.Tensor:
        return moe_experts(rows, ids.view(-1, 1), None, *experts, out_dtype=torch.float32,
                           check_ids=self.check_values)

    def routed_experts(self, x, ids, weights, experts, swiglu_limit: float) -> torch.Tensor:
        gate_up_blocks, gate_up_scales, down_blocks, down_scales = experts
        sort = dt.sort_by_expert(ids, weights, gate_up_blocks.shape[0], check_ids=self.check_values)
        h = dt.fused_moe_gemm(x, sort, gate_up_blocks, gate_up_scales, gather_tokens=True, out_dtype=torch.float32)
        y = dt.fused_moe_gemm(dt.swiglu(clip_gate_up(h, swiglu_limit), x.dtype), sort, down_blocks, down_scales,
                              gather_tokens=False, out_dtype=torch.float32)
        return combine_rows(y, sort)


class ReferenceOps:
    name = "reference"

    @staticmethod
    def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, FP8Weight):
            return _add_bias(fp8_blockwise_linear_torch(x, *w), bias)
        return F.linear(x, w, bias)

    @staticmethod
    def swiglu(h: torch.Tensor) -> torch.Tensor:
        return swiglu_torch(h)

    @staticmethod
    def append(cache: dt.PagedCache, kv: torch.Tensor, index_k: torch.Tensor, batch: PagedBatch) -> None:
        append_torch(cache.kv, cache.ik, cache.ik_scale, cache.summaries, kv, index_k, batch.slots, batch.pages,
                     batch.fill, rope_dim=cache.rope_dim)

    @staticmethod
    def indexer_logits(q8, w, cache: dt.PagedCache, batch: PagedBatch) -> torch.Tensor:
        return indexer_logits_torch(q8, w, cache.ik, cache.ik_scale, batch.limits, batch.num_cols,
                                    cu_seqlens_q=batch.cu_seqlens, block_table=batch.block_table)

    @staticmethod
    def topk(scores, k: int, page_size: int, batch: PagedBatch) -> torch.Tensor:
        return topk_indices_torch(scores, k, batch.limits, block_table=batch.block_table, page_size=page_size,
                                  row_to_seq=batch.row_to_seq)

    @staticmethod
    def block_topk(q8, w, cache: dt.PagedCache, batch: PagedBatch, k: int, n_select: int) -> torch.Tensor:
        P, L = cache.page_size, batch.num_cols
        bounds = page_bounds_torch(q8, w, cache.pmax, cache.pmin, batch.block_table, batch.limits, P, -(-L // P),
                                   batch.cu_seqlens)
        dense = indexer_logits_torch(q8, w, cache.ik, cache.ik_scale, batch.limits, L, cu_seqlens_q=batch.cu_seqlens,
                                     block_table=batch.block_table)
        logits, positions = gather_selected_torch(dense, select_pages_torch(bounds, n_select), P, batch.limits)
        return positions_to_slots(topk_indices_torch(logits, k), positions, batch, P)

    @staticmethod
    def attention(q, kv_cache, slots, sm_scale: float, d_v: int, decode: bool) -> torch.Tensor:
        op = sparse_attention_decode_torch if decode else sparse_attention_prefill_torch
        return op(q, kv_cache, slots, sm_scale, d_v)[0].to(q.dtype)

    @staticmethod
    def compress_entries(kv, gate, kv_window, gate_window, window_table, entries, entry_table, batch: PagedBatch,
                         *args, **kwargs) -> None:
        compress_entries_torch(kv, gate, kv_window, gate_window, window_table, entries, entry_table,
                               batch.cu_seqlens, batch.seq_lens, *args, **kwargs)

    @staticmethod
    def v4_indexer_logits(q, w, keys, limits, table, counts, scale: float, num_cols: int,
                          batch: PagedBatch) -> torch.Tensor:
        return v4_indexer_logits_torch(q, w, keys, limits, table, scale, num_cols, cu_seqlens_q=batch.cu_seqlens)

    @staticmethod
    def topk_entries(logits, k: int, limits, batch: PagedBatch) -> torch.Tensor:
        return topk_indices_torch(logits, k, limits)

    @staticmethod
    def v4_attention(q, sets: list, sinks, sm_scale: float, batch: PagedBatch) -> torch.Tensor:
        return sparse_attention_prefill_torch(q, *sets[0], sm_scale, q.shape[-1], attn_sink=sinks,
                                              **union_args(sets))[0].to(q.dtype)

    @staticmethod
    def moe(x, *args, **kwargs) -> torch.Tensor:
        return moe_forward_torch(x, *args, **kwargs).to(x.dtype)

    @staticmethod
    def route(logits, routing, bias) -> tuple[torch.Tensor, torch.Tensor]:
        return route_torch(logits, routing, bias)

    @staticmethod
    def experts(rows, ids, *experts) -> torch.Tensor:
        return moe_experts_torch(rows, ids.view(-1, 1), None, *experts)

    @staticmethod
    def routed_experts(x, ids, weights, experts, swiglu_limit: float) -> torch.Tensor:
        """One expert at a time in ascending order (as transformers adds them), weights dequantized, fp32."""
        gate_up_blocks, gate_up_scales, down_blocks, down_scales = experts
        xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            token, choice = (ids == e).nonzero(as_tuple=True)
            h = F.linear(xf[token], mxfp4_dequantize_torch(gate_up_blocks[e], gate_up_scales[e]))
            y = F.linear(swiglu_torch(clip_gate_up(h, swiglu_limit)),
                         mxfp4_dequantize_torch(down_blocks[e], down_scales[e]))
            out.index_add_(0, token, y * weights[token, choice, None])
        return out

