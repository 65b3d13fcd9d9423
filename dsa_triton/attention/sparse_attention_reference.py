"""Pure-PyTorch sparse paged attention: the oracle (fp32) and the baseline a user would run (bf16 gather + einsum).

Shapes (MQA form of DeepSeek-V3.2's MLA): every query row attends to ``k`` cache rows of width ``D``
(576 = 512 latent + 64 rope) picked by index; the values are the first ``d_v`` dims of the same rows.

- ``slots_from_indices``: logical positions + block table -> physical slots (-1 stays -1);
- ``sparse_attention_torch``: ``q[R, M, D]`` (M query rows share each row's index set) -> out, lse (fp32);
- ``sparse_attention_decode_torch`` / ``sparse_attention_prefill_torch``: the public ops' signatures;
- ``gather_einsum``: index_select, einsum, softmax, einsum in the input dtype (the benchmark baseline).

A uint8 cache is the FP8 latent cache (:mod:`.formats`, ``d_v`` latent values a row): every function here
dequantizes the rows it gathers with ``fp8_latent_dequantize`` (the oracle in fp32, the baseline into q's dtype),
then goes on as with rows in a float dtype.
"""
from __future__ import annotations

import torch

from .formats import fp8_latent_dequantize

# Rows per chunk of the oracle: bounds the gathered [rows, k, D] fp32 tensor at long prefill.
ORACLE_GATHER_BYTES = 1 << 29


def slots_from_indices(indices: torch.Tensor, block_table: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """Physical slots ``[R, k]`` int64: ``block_table[r, i // P] * P + i % P`` for ``i >= 0``, else -1.

    ``indices``: ``[R, k]``; ``block_table``: ``[R, max_pages]`` or ``None`` (indices are slots already).
    """
    idx = indices.long()
    if block_table is None:
        return torch.where(idx >= 0, idx, -1)
    valid = idx >= 0
    page = torch.where(valid, idx // page_size, 0)
    phys = block_table.long().gather(1, page)
    return torch.where(valid, phys * page_size + idx % page_size, -1)


def sparse_attention_torch(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float,
                           d_v: int, magnitude: bool = False) -> tuple[torch.Tensor, ...]:
    """fp32 oracle. ``q[R, M, D]``, ``kv[num_slots, D]``, ``slots[R, k]`` (-1 skipped) -> ``out[R, M, d_v]`` fp32,
    ``lse[R, M]`` fp32 natural log; a row without a valid slot gives out 0 and lse -inf. Chunked over R.
    Non-finite scores as the kernels: a -inf score is a probability of 0 (a row of only -inf scores gives out 0 and
    lse -inf), a +inf score makes the row's out and lse NaN (the online softmax's ``inf - inf``), as does a NaN.
    ``magnitude``: also ``sum_j p_j |v_j|`` ``[R, M, d_v]``, what rounding the probabilities to the cache dtype
    (as the kernels do before the value dot) can move an output by, times the dtype's unit roundoff."""
    R, M, D = q.shape
    k = slots.shape[1]
    out = torch.zeros(R, M, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((R, M), float("-inf"), dtype=torch.float32, device=q.device)
    mag = torch.zeros_like(out) if magnitude else None
    step = max(1, ORACLE_GATHER_BYTES // max(1, k * D * 4))
    for r0 in range(0, R, step):
        s = slots[r0:r0 + step]
        valid = s >= 0
        rows = kv[s.clamp_min(0)]
        rows = fp8_latent_dequantize(rows, d_v) if kv.dtype == torch.uint8 else rows.float()
        rows = torch.where(valid[..., None], rows, 0.0)  # [r, k, D]; invalid rows never enter
        scores = torch.einsum("rmd,rkd->rmk", q[r0:r0 + step].float(), rows) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
        row_lse = row_lse.masked_fill(row_lse == float("inf"), float("nan"))  # a +inf score: inf - inf, as the kernels
        p = torch.exp(scores - row_lse.masked_fill(row_lse == float("-inf"), 0)[..., None])
        out[r0:r0 + step] = torch.einsum("rmk,rkv->rmv", p, rows[..., :d_v])
        lse[r0:r0 + step] = row_lse
        if magnitude:
            mag[r0:r0 + step] = torch.einsum("rmk,rkv->rmv", p, rows[..., :d_v].abs())
    return (out, lse, mag) if magnitude else (out, lse)


def sparse_attention_decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                  d_v: int = 512, block_table: torch.Tensor | None = None, magnitude: bool = False):
    """Oracle of :func:`dsa_triton.sparse_attention_decode` (same arguments; out fp32; ``magnitude`` as in
    :func:`sparse_attention_torch`, shaped as out).

    ``q[B, Hq, D]`` or ``[B, S, Hq, D]``; ``indices[B, k]`` (shared by the S tokens) or ``[B, S, k]``.
    """
    squeeze = q.dim() == 3
    q4 = q[:, None] if squeeze else q
    B, S, H, D = q4.shape
    kv = kv_cache.reshape(-1, kv_cache.shape[-1])
    P = kv_cache.shape[1] if kv_cache.dim() == 3 else 1
    if indices.dim() == 3:  # one index set per token: B*S sequences of one token
        bt = None if block_table is None else block_table.repeat_interleave(S, dim=0)
        slots = slots_from_indices(indices.reshape(B * S, -1), bt, P)
        results = sparse_attention_torch(q4.reshape(B * S, H, D), kv, slots, sm_scale, d_v, magnitude)
    else:
        slots = slots_from_indices(indices, block_table, P)
        results = sparse_attention_torch(q4.reshape(B, S * H, D), kv, slots, sm_scale, d_v, magnitude)
    results = [x.reshape(B, S, H, *x.shape[2:]) for x in results]  # out [B, S, H, d_v], lse [B, S, H], ...
    return tuple(x[:, 0] for x in results) if squeeze else tuple(results)


def sparse_attention_prefill_torch(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                                   d_v: int = 512, block_table: torch.Tensor | None = None, magnitude: bool = False):
    """Oracle of :func:`dsa_triton.sparse_attention_prefill`: ``q[T, Hq, D]``, ``indices[T, k]`` -> fp32 out, lse
    (and the ``magnitude`` of :func:`sparse_attention_torch`)."""
    P = kv_cache.shape[1] if kv_cache.dim() == 3 else 1
    bt = None if block_table is None else block_table.expand(q.shape[0], -1)
    return sparse_attention_torch(q, kv_cache.reshape(-1, kv_cache.shape[-1]), slots_from_indices(indices, bt, P),
                                  sm_scale, d_v, magnitude)


def gather_einsum(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, sm_scale: float, d_v: int,
                  max_gather_bytes: int = 1 << 30) -> torch.Tensor:
    """The baseline: ``index_select`` the rows (FP8 latent rows: then dequantize them), einsum scores, softmax,
    einsum values, all in ``q.dtype``.

    ``q[R, M, D]``, ``kv[num_slots, D]`` (or uint8 FP8 rows), ``slots[R, k]`` (-1 masked) -> ``out[R, M, d_v]``;
    chunked over R so the gathered rows stay under ``max_gather_bytes`` (what a user would do at long prefill).
    """
    R, M, D = q.shape
    k = slots.shape[1]
    out = torch.empty(R, M, d_v, dtype=q.dtype, device=q.device)
    step = max(1, max_gather_bytes // max(1, k * D * q.element_size()))
    for r0 in range(0, R, step):
        s = slots[r0:r0 + step]
        rows = kv.index_select(0, s.clamp_min(0).flatten()).view(s.shape[0], k, kv.shape[-1])
        if kv.dtype == torch.uint8:
            rows = fp8_latent_dequantize(rows, d_v).to(q.dtype)
        scores = torch.einsum("rmd,rkd->rmk", q[r0:r0 + step], rows) * sm_scale
        scores = scores.masked_fill((s < 0)[:, None, :], float("-inf"))
        out[r0:r0 + step] = torch.einsum("rmk,rkv->rmv", scores.softmax(dim=-1), rows[..., :d_v])
    return out
