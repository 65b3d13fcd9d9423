"""Pure-PyTorch sparse paged attention: the oracle (fp32) and the baseline a user would run (bf16 gather + einsum).

Shapes (MQA form of DeepSeek-V3.2's MLA): every query row attends to ``k`` cache rows of width ``D``
(576 = 512 latent + 64 rope) picked by index; the values are the first ``d_v`` dims of the same rows.

- ``slots_from_indices``: logical positions + block table -> physical slots (-1 stays -1);
- ``sparse_attention_torch``: ``q[R, M, D]`` (M query rows share each row's index set) -> out, lse (fp32);
- ``sparse_attention_decode_torch`` / ``sparse_attention_prefill_torch``: the public ops' signatures;
- ``gather_einsum``: index_select, einsum, softmax, einsum in the input dtype (the benchmark baseline).

A uint8 cache is FP8 (:mod:`.formats`): with ``d_v < D`` the FP8 latent cache (``d_v`` latent values a row), whose
gathered rows ``fp8_latent_dequantize`` dequantizes; with ``d_v == D`` MODEL1 pages, whose gathered tokens
``model1_gather`` dequantizes (the oracle in fp32, the baseline into q's dtype); then as rows in a float dtype.

DeepSeek-V4's arguments: ``topk_length`` turns the indices past a row's length into -1; a second index set
(``extra_kv_cache``, ``extra_indices``, ...) is gathered from its own cache and joins the first in one softmax;
``attn_sink`` multiplies out (not lse) by ``exp(lse) / (exp(lse) + exp(sink[h]))`` (an empty row stays 0).
"""
from __future__ import annotations

import torch

from .formats import fp8_latent_dequantize, model1_gather, model1_rope

# Rows per chunk of the oracle: bounds the gathered [rows, k, D] fp32 tensor at long prefill.
ORACLE_GATHER_BYTES = 1 << 29


def slots_from_indices(indices: torch.Tensor, block_table: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """Physical slots ``[R, ..., k]`` int64: ``block_table[r, i // P] * P + i % P`` for ``i >= 0``, else -1.

    ``indices``: ``[R, k]`` (or ``[R, S, k]``: S index sets a row); ``block_table``: ``[R, max_pages]`` or ``None``
    (indices are slots already).
    """
    idx = indices.long()
    if block_table is None:
        return torch.where(idx >= 0, idx, -1)
    valid = idx >= 0
    page = torch.where(valid, idx // page_size, 0)
    phys = block_table.long().gather(1, page.flatten(1)).view_as(page)
    return torch.where(valid, phys * page_size + idx % page_size, -1)


def gather_rows(kv: torch.Tensor, slots: torch.Tensor, d: int, d_v: int) -> torch.Tensor:
    """fp32 rows ``[..., d]`` of ``kv`` at ``slots`` (each in range): rows ``[num_slots, d]`` of a float dtype or
    uint8 FP8 latent rows (``d_v < d``), or MODEL1 pages ``[num_pages, P, bytes]`` (``d_v == d``)."""
    if kv.dtype == torch.uint8 and d_v == d:
        return model1_gather(kv, slots, model1_rope(d, kv.shape[-1]))
    rows = kv.reshape(-1, kv.shape[-1])[slots]
    return fp8_latent_dequantize(rows, d_v) if kv.dtype == torch.uint8 else rows.float()


def sparse_attention_torch(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                           d_v: int, magnitude: bool = False, attn_sink: torch.Tensor | None = None,
                           extra_kv: torch.Tensor | None = None,
                           extra_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """fp32 oracle. ``q[R, M, D]``, ``kv`` (as :func:`gather_rows` takes it), ``slots[R, k]`` (-1 skipped) ->
    ``out[R, M, d_v]`` fp32, ``lse[R, M]`` fp32 natural log (a slot past the cache skipped like -1, as the kernels
    skip it); a row without a valid slot gives out 0 and lse -inf.
    Chunked over R. ``extra_kv``, ``extra_slots[R, k2]``: a second set, in the same softmax; ``attn_sink[H]``:
    the sink of query row m's head ``m % H``.
    Non-finite scores as the kernels: a -inf score is a probability of 0 (a row of only -inf scores gives out 0 and
    lse -inf), a +inf score makes the row's out and lse NaN (the online softmax's ``inf - inf``), as does a NaN.
    ``magnitude``: also ``sum_j p_j |v_j|`` ``[R, M, d_v]``, what rounding the probabilities to the cache dtype
    (as the kernels do before the value dot) can move an output by, times the dtype's unit roundoff."""
    R, M, D = q.shape
    sets = [(kv, slots)] + ([(extra_kv, extra_slots)] if extra_slots is not None else [])
    k = sum(s.shape[1] for _, s in sets)
    out = torch.zeros(R, M, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((R, M), float("-inf"), dtype=torch.float32, device=q.device)
    mag = torch.zeros_like(out) if magnitude else None
    step = max(1, ORACLE_GATHER_BYTES // max(1, k * D * 4))
    for r0 in range(0, R, step):
        valid = torch.cat([(c[r0:r0 + step] >= 0) & (c[r0:r0 + step] < cache.shape[:-1].numel()) for cache, c in sets],
                          dim=1)  # (a slot past the cache: skipped, as the kernels do)
        rows = torch.cat([gather_rows(cache, torch.where(v, c[r0:r0 + step], 0), D, d_v)
                          for (cache, c), v in zip(sets, valid.split([c.shape[1] for _, c in sets], dim=1))], dim=1)
        rows = torch.where(valid[..., None], rows, 0.0)  # [r, k, D]; invalid rows never enter
        scores = torch.einsum("rmd,rkd->rmk", q[r0:r0 + step].float(), rows) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
        row_lse = row_lse.masked_fill(row_lse == float("inf"), float("nan"))  # a +inf score: inf - inf, as the kernels
        p = torch.exp(scores - row_lse.masked_fill(row_lse == float("-inf"), 0)[..., None])
        if attn_sink is not None:  # exp(lse) / (exp(lse) + exp(sink)); an empty row stays 0
            sink = attn_sink.float().repeat(M // attn_sink.shape[0])
            factor = torch.where(row_lse == float("-inf"), 0.0, torch.sigmoid(row_lse - sink))
            p = p * factor[..., None]
        out[r0:r0 + step] = torch.einsum("rmk,rkv->rmv", p, rows[..., :d_v])
        lse[r0:r0 + step] = row_lse
        if magnitude:
            mag[r0:r0 + step] = torch.einsum("rmk,rkv->rmv", p, rows[..., :d_v].abs())
    return (out, lse, mag) if magnitude else (out, lse)


def length_masked(slots: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``slots[R, k]`` with the columns at or past ``lengths[r]`` (``[R]``; None: none) made -1."""
    if lengths is None:
        return slots
    return torch.where(torch.arange(slots.shape[1], device=slots.device) < lengths.long()[:, None], slots, -1)


def sparse_attention_decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                  d_v: int = 512, block_table: torch.Tensor | None = None, magnitude: bool = False,
                                  *, attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                                  extra_kv_cache: torch.Tensor | None = None, extra_indices: torch.Tensor | None = None,
                                  extra_topk_length: torch.Tensor | None = None,
                                  extra_block_table: torch.Tensor | None = None):
    """Oracle of :func:`dsa_triton.sparse_attention_decode` (same arguments; out fp32; ``magnitude`` as in
    :func:`sparse_attention_torch`, shaped as out).

    ``q[B, Hq, D]`` or ``[B, S, Hq, D]``; ``indices[B, k]`` (shared by the S tokens) or ``[B, S, k]``.
    """
    squeeze = q.dim() == 3
    q4 = q[:, None] if squeeze else q
    B, S, H, D = q4.shape
    per_token = indices.dim() == 3  # one index set per token: B*S sequences of one token
    rows, repeat = (B * S, S) if per_token else (B, 1)

    def slots_of(cache, idx, table, lengths):
        P = cache.shape[1] if cache.dim() == 3 else 1
        table = None if table is None else table.repeat_interleave(repeat, dim=0)
        if lengths is not None:  # [B] (per sequence) or one per index row
            lengths = lengths.repeat_interleave(repeat) if lengths.numel() * repeat == rows else lengths.reshape(-1)
        return length_masked(slots_from_indices(idx.reshape(rows, -1), table, P), lengths)

    slots = slots_of(kv_cache, indices, block_table, topk_length)
    extra = {}
    if extra_indices is not None:
        extra = {"extra_kv": extra_kv_cache,
                 "extra_slots": slots_of(extra_kv_cache, extra_indices, extra_block_table, extra_topk_length)}
    results = sparse_attention_torch(q4.reshape(rows, -1, D), kv_cache, slots, sm_scale, d_v, magnitude, attn_sink,
                                     **extra)
    results = [x.reshape(B, S, H, *x.shape[2:]) for x in results]  # out [B, S, H, d_v], lse [B, S, H], ...
    return tuple(x[:, 0] for x in results) if squeeze else tuple(results)


def sparse_attention_prefill_torch(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                   d_v: int = 512, block_table: torch.Tensor | None = None, magnitude: bool = False,
                                   *, attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                                   extra_kv_cache: torch.Tensor | None = None,
                                   extra_indices: torch.Tensor | None = None,
                                   extra_topk_length: torch.Tensor | None = None,
                                   extra_block_table: torch.Tensor | None = None):
    """Oracle of :func:`dsa_triton.sparse_attention_prefill`: ``q[T, Hq, D]``, ``indices[T, k]`` -> fp32 out, lse
    (and the ``magnitude`` of :func:`sparse_attention_torch`)."""
    T = q.shape[0]

    def slots_of(cache, idx, table, lengths):
        P = cache.shape[1] if cache.dim() == 3 else 1
        return length_masked(slots_from_indices(idx, None if table is None else table.expand(T, -1), P), lengths)

    extra = {}
    if extra_indices is not None:
        extra = {"extra_kv": extra_kv_cache,
                 "extra_slots": slots_of(extra_kv_cache, extra_indices, extra_block_table, extra_topk_length)}
    return sparse_attention_torch(q, kv_cache, slots_of(kv_cache, indices, block_table, topk_length), sm_scale, d_v,
                                  magnitude, attn_sink, **extra)


def gather_einsum(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float, d_v: int,
                  max_gather_bytes: int = 1 << 30, attn_sink: torch.Tensor | None = None,
                  extra_kv: torch.Tensor | None = None, extra_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The baseline: gather the rows (``index_select``; FP8 rows: then dequantize them), einsum scores, softmax,
    einsum values, all in ``q.dtype``; a second set and a sink as in :func:`sparse_attention_torch` (the sink as a
    softmax column whose probability is dropped).

    ``q[R, M, D]``, ``kv[num_slots, D]`` (or an FP8 cache), ``slots[R, k]`` (-1 masked) -> ``out[R, M, d_v]``;
    chunked over R so the gathered rows stay under ``max_gather_bytes`` (what a user would do at long prefill).
    """
    R, M, D = q.shape
    sets = [(kv, slots)] + ([(extra_kv, extra_slots)] if extra_slots is not None else [])
    k = sum(s.shape[1] for _, s in sets)
    out = torch.empty(R, M, d_v, dtype=q.dtype, device=q.device)
    step = max(1, max_gather_bytes // max(1, k * D * q.element_size()))
    for r0 in range(0, R, step):
        s = torch.cat([c[r0:r0 + step] for _, c in sets], dim=1)
        rows = torch.cat([_gather(cache, c[r0:r0 + step], D, d_v, q.dtype) for cache, c in sets], dim=1)
        scores = torch.einsum("rmd,rkd->rmk", q[r0:r0 + step], rows) * sm_scale
        scores = scores.masked_fill((s < 0)[:, None, :], float("-inf"))
        if attn_sink is not None:
            sink = attn_sink.to(q.dtype).repeat(M // attn_sink.shape[0]).expand(scores.shape[0], M)
            scores = torch.cat([scores, sink[..., None]], dim=-1)
        out[r0:r0 + step] = torch.einsum("rmk,rkv->rmv", scores.softmax(dim=-1)[..., :rows.shape[1]], rows[..., :d_v])
    return out


def _gather(kv: torch.Tensor, slots: torch.Tensor, d: int, d_v: int, dtype: torch.dtype) -> torch.Tensor:
    """The baseline's gather: rows ``[r, k, d]`` in ``dtype`` (an index_select of rows in it when they are)."""
    if kv.dtype == torch.uint8:
        return gather_rows(kv, slots.clamp_min(0), d, d_v).to(dtype)
    flat = kv.reshape(-1, kv.shape[-1])
    return flat.index_select(0, slots.clamp_min(0).flatten()).view(*slots.shape, d)
