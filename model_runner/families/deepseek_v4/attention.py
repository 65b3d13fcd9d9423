"""DeepSeek-V4's attention, following transformers' ``DeepseekV4Attention``, on the ops of the backend (``ops``):
the projections through ``ops.linear`` (FP8 weights take the blockwise-FP8 GEMM in kernel mode), the compressors
through ``ops.compress_entries``, the indexer through ``ops.v4_indexer_logits`` and ``ops.topk_entries``, the attention
through ``ops.v4_attention`` (kernel mode: dt.compress_entries, dt.v4_indexer_logits, dt.topk_indices,
dt.sparse_attention_decode / _prefill; reference mode: their PyTorch oracles). The indexer's top-k takes the lower
entry among equal scores in both modes (transformers' ``torch.topk`` may take another of exactly equal scores).

One layer, for the ``T`` new tokens of a step (packed by sequence; caches: :mod:`.cache`):

    q = RMSNorm_unweighted(wq_b(q_norm(wq_a(x)))) per head [T, H, hd]; kv = norm(wkv(x)) [T, hd] (one K=V head);
    both rotated on their last ``rope`` dims (interleaved pairs; the main RoPE in sliding layers, the compress RoPE
    (YaRN) in CSA / HCA layers)
    keys = the sliding window: positions (t - sliding_window, t] of the kv rows (window stream)
         + CSA: the compressed entries the Lightning indexer picks (its top-k of the entries whose window closed at
           or before t: j < (t + 1) // m), HCA: every such entry
    out = softmax([q . keys * hd^-0.5 | sink_h]) without the sink column @ keys  (K = V; per-head sink logit)
    out's rope dims rotated back (-sin) at the query's position; grouped output: o_groups blocks of wo_a, then wo_b.

A compressor (:class:`Compressor`) closes window ``w`` (tokens ``[w m, (w + 1) m)``) once its last token is cached:
``entry_w = norm(sum_s softmax_s(gate_s + ape_s) kv_s)`` over the window's ``m`` tokens (HCA), or over ``2m``
slots with CSA's overlap: the previous window's first halves (``Ca``) and this window's second halves (``Cb``);
window 0 has no previous one. The entry is rotated at position ``w m`` (compress RoPE; the math:
:mod:`dsa_triton.attention.compress_entries_reference`). The CSA indexer runs its own compressor at
``index_head_dim`` (keys), queries ``wq_b(q_latent)`` rotated at the token's position, and scores
``sum_h w[t, h] relu(q[t, h] . k[j]) index_head_dim^-0.5`` with ``w = weights_proj(x) index_n_heads^-0.5``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsa_triton.attention.compress_entries_reference import rotate

from ...cache_manager import PagedBatch
from ...ops import FP8Weight
from .config import CSA, SLIDING, DeepseekV4Config
from .norms import rms_norm, unweighted_rms_norm


def paged(rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """A layer's storage array ``[pages x P, width]`` as pages ``[pages, P, width]`` (a view)."""
    return rows.view(-1, page_size, rows.shape[-1])


class Compressor:
    """One compressor: ``wkv``, ``wgate`` ``[c dim, D]``, ``ape [m, c dim]`` fp32, ``norm [dim]`` (``c`` 2 with the
    overlap, 1 without)."""

    def __init__(self, w: dict, prefix: str, dim: int, rate: int, overlap: bool, eps: float):
        self.wkv, self.wgate = w[prefix + "wkv.weight"], w[prefix + "wgate.weight"]
        self.ape, self.norm = w[prefix + "ape"], w[prefix + "norm.weight"]
        self.dim, self.rate, self.overlap, self.eps = dim, rate, overlap, eps

    def project(self, x: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of ``x[T, D]``'s tokens: ``kv``, ``gate`` ``[T, c dim]`` (kept in the window stream)."""
        return ops.linear(x, self.wkv), ops.linear(x, self.wgate)

    def append(self, inputs: tuple[torch.Tensor, torch.Tensor], names: tuple[str, str, str], storage: dict,
               batch: PagedBatch, rope, page_size: int, stream: str, ops) -> None:
        """Write this step's ``inputs`` (``kv``, ``gate`` ``[T, c dim]``) to the window stream, and the entries of every
        window that closes in this step to ``stream`` (``names``: the storage's kv, gate and entry arrays; ``rope``:
        ratio -> the entries' rope tables, row ``w`` at position ``w x ratio``)."""
        kv_rows, gate_rows, entries = (storage[n] for n in names)
        kv_rows[batch.slots], gate_rows[batch.slots] = inputs
        ops.compress_entries(*inputs, paged(kv_rows, page_size), paged(gate_rows, page_size), batch.tables["window"],
                             paged(entries, page_size), batch.tables[stream], batch, self.ape, self.norm,
                             *rope(self.rate), ratio=self.rate, overlap=self.overlap, eps=self.eps)


class Indexer:
    """CSA's Lightning indexer: its compressor (keys at ``index_head_dim``), ``wq_b [IH ID, q_lora]``,
    ``weights_proj [IH, D]``."""

    def __init__(self, c: DeepseekV4Config, w: dict, prefix: str):
        self.c = c
        self.compressor = Compressor(w, prefix + "compressor.", c.index_head_dim, c.csa_rate, True, c.rms_norm_eps)
        self.wq_b, self.weights_proj = w[prefix + "wq_b.weight"], w[prefix + "weights_proj.weight"]

    def select(self, x, q_latent, tables: dict, batch: PagedBatch, storage: dict, page_size: int,
               ops) -> torch.Tensor | None:
        """Append this step's keys; -> the picked entries ``[T, k]`` (logical; -1: none), ``k`` = min(index_topk,
        the entries of ``batch.num_cols`` tokens: the longest sequence, the cache's capacity in a padded decode
        step), or None while no sequence can have an entry."""
        c, m = self.c, self.c.csa_rate
        self.compressor.append(self.compressor.project(x, ops), ("idx_kv", "idx_gate", "index_keys"), storage, batch,
                               tables["entries"], page_size, "csa", ops)
        entries = batch.num_cols // m
        if entries == 0:
            return None
        T = x.shape[0]
        q = rotate(ops.linear(q_latent, self.wq_b).view(T, c.index_n_heads, c.index_head_dim), *tables["compress"])
        weights = F.linear(x, self.weights_proj).float() * c.index_n_heads ** -0.5
        limits = ((batch.positions + 1) // m).int()  # the entries whose window closed at or before the token
        logits = ops.v4_indexer_logits(q, weights, paged(storage["index_keys"], page_size), limits,
                                       batch.tables["csa"], batch.seq_lens // m, c.index_head_dim ** -0.5, entries,
                                       batch)
        return ops.topk_entries(logits, min(c.index_topk, entries), limits, batch)


class Attention:
    """One V4 attention layer (the module docstring) with its compressor and indexer (CSA) or compressor (HCA)."""

    def __init__(self, c: DeepseekV4Config, w: dict, prefix: str, layer: int):
        self.c, self.kind = c, c.layer_types[layer]
        take = lambda name: w[prefix + name]  # noqa: E731
        self.wq_a, self.q_norm, self.wq_b = take("wq_a.weight"), take("q_norm.weight"), take("wq_b.weight")
        self.wkv, self.kv_norm, self.sinks = take("wkv.weight"), take("norm.weight"), take("attn_sink")
        self.wo_a, self.wo_b = self.groups(take("wo_a.weight")), take("wo_b.weight")
        rate = c.compress_rate(layer)
        self.compressor = (None if self.kind == SLIDING else
                           Compressor(w, prefix + "compressor.", c.head_dim, rate, self.kind == CSA, c.rms_norm_eps))
        self.indexer = Indexer(c, w, prefix + "indexer.") if self.kind == CSA else None

    def groups(self, wo_a) -> list:
        """``wo_a [G o_lora, H hd / G]`` as one weight per group (FP8: its rows and block scales)."""
        o = self.c.o_lora_rank
        if isinstance(wo_a, FP8Weight):
            return [FP8Weight(wo_a.weight[g * o:(g + 1) * o], wo_a.scale_inv[g * o // 128:(g + 1) * o // 128])
                    for g in range(self.c.o_groups)]
        return list(wo_a.split(o))

    def __call__(self, x, tables: dict, batch: PagedBatch, storage: dict, page_size: int, ops) -> torch.Tensor:
        """``x[T, D]`` (normed) -> ``[T, D]``; ``tables``: ``{"main" | "compress": (cos, sin)}`` of the tokens'
        positions and ``"entries"``: ratio -> the compress RoPE's tables of the compressed entries."""
        c, T = self.c, x.shape[0]
        cos, sin = tables["main" if self.kind == SLIDING else "compress"]
        q_latent = rms_norm(ops.linear(x, self.wq_a), self.q_norm, c.rms_norm_eps)
        q = unweighted_rms_norm(ops.linear(q_latent, self.wq_b).view(T, c.num_attention_heads, c.head_dim),
                                c.rms_norm_eps)
        q = rotate(q, cos, sin)
        storage["kv"][batch.slots] = rotate(rms_norm(ops.linear(x, self.wkv), self.kv_norm, c.rms_norm_eps), cos, sin)
        picks = None
        if self.compressor is not None:
            self.compressor.append(self.compressor.project(x, ops), ("comp_kv", "comp_gate", "entries"), storage,
                                   batch, tables["entries"], page_size, self.stream, ops)
        if self.indexer is not None:
            picks = self.indexer.select(x, q_latent, tables, batch, storage, page_size, ops)
        out = ops.v4_attention(q, self.index_sets(batch, storage, page_size, picks), self.sinks, c.head_dim ** -0.5,
                               batch)
        out = rotate(out, cos, -sin)  # undo the rotation the values carried
        grouped = out.view(T, c.o_groups, -1)
        mixed = torch.cat([ops.linear(grouped[:, g], w) for g, w in enumerate(self.wo_a)], dim=-1)
        return ops.linear(mixed, self.wo_b)

    @property
    def stream(self) -> str:
        """The cache stream of the layer's compressed entries."""
        return "csa" if self.kind == CSA else "hca"

    def index_sets(self, batch: PagedBatch, storage: dict, page_size: int, picks: torch.Tensor | None) -> list[tuple]:
        """``(cache rows [slots, hd], physical slots [T, k] (-1: none))`` of the sliding window (positions
        ``(t - sliding_window, t]``) and, in CSA / HCA layers, of the compressed entries: the indexer's ``picks``
        (CSA), else every entry whose window closed at or before the token (``batch.num_cols // rate`` wide); with the
        count of a token's leading valid entries, ``[T]`` int32 (a graph step's width follows the cache's capacity,
        the count is what the kernel walks)."""
        t, rows = batch.positions[:, None], batch.row_to_seq.long()[:, None]

        def slots(stream: str, logical: torch.Tensor) -> torch.Tensor:  # through the token's block-table row
            pages = batch.tables[stream][rows, logical.clamp_min(0) // page_size].long()
            return (pages * page_size + logical % page_size).where(logical >= 0, -1)

        window = t - torch.arange(self.c.sliding_window - 1, -1, -1, device=t.device)
        sets = [(storage["kv"], slots("window", window))]
        if self.compressor is not None:
            rate = self.compressor.rate
            closed = (t + 1) // rate  # [T, 1]: the entries closed at or before each token
            if picks is None:
                picks = torch.arange(max(batch.num_cols // rate, 1), device=t.device).expand(t.shape[0], -1)
                picks = picks.where(picks < closed, -1)
            # (the indexer's top-k holds min(k, closed) picks first, then -1, as HCA's leading entries)
            sets.append((storage["entries"], slots(self.stream, picks), closed[:, 0].clamp(max=picks.shape[1]).int()))
        return sets
