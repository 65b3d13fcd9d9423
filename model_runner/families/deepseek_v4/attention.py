"""DeepSeek-V4's attention, following transformers' ``DeepseekV4Attention`` (pure PyTorch until V4 attention kernels
exist; the projections run through ``ops.linear``, so FP8 weights take the blockwise-FP8 GEMM in kernel mode).

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
window 0 has no previous one. The entry is rotated at position ``w m`` (compress RoPE). The CSA indexer runs its
own compressor at ``index_head_dim`` (keys), queries ``wq_b(q_latent)`` rotated at the token's position, and scores
``sum_h w[t, h] relu(q[t, h] . k[j]) index_head_dim^-0.5`` with ``w = weights_proj(x) index_n_heads^-0.5``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...cache_manager import PagedBatch
from ...ops import FP8Weight
from .cache import slots
from .config import CSA, SLIDING, DeepseekV4Config
from .norms import rms_norm, unweighted_rms_norm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last ``2 x cos.shape[-1]`` dims of ``x[T, ..., d]`` as interleaved pairs, in fp32 (layout kept);
    ``cos``, ``sin`` ``[T, r / 2]`` in ``x``'s dtype."""
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c, s = (t.repeat_interleave(2, dim=-1).view(shape).float() for t in (cos, sin))
    rope = x[..., -r:].float()
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], (rope * c + half * s).to(x.dtype)], dim=-1)


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

    def compress(self, kv: torch.Tensor, gate: torch.Tensor, first: int) -> torch.Tensor:
        """Entries ``[n, dim]`` of windows ``first .. first + n - 1`` from their tokens' inputs ``kv``, ``gate``
        ``[n', m, c dim]``: the ``n`` windows, led with the overlap (when ``first`` > 0) by the window before them;
        window 0 has none, its first half keeps weight 0. Not rotated yet."""
        m, d = self.rate, self.dim
        gate = gate.float() + self.ape
        if self.overlap:
            lead = 1 if first > 0 else 0
            n = kv.shape[0] - lead
            slots_kv = kv.new_zeros(n, 2 * m, d)
            slots_gate = gate.new_full((n, 2 * m, d), float("-inf"))
            slots_kv[:, m:], slots_gate[:, m:] = kv[lead:, :, d:], gate[lead:, :, d:]  # each window's Cb
            slots_kv[1 - lead:, :m], slots_gate[1 - lead:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]  # the Ca before
            kv, gate = slots_kv, slots_gate
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        return rms_norm(pooled, self.norm, self.eps)

    def append(self, inputs: tuple[torch.Tensor, torch.Tensor], names: tuple[str, str, str], storage: dict,
               batch: PagedBatch, rope, page_size: int, stream: str) -> None:
        """Write this step's ``inputs`` (``kv``, ``gate`` ``[T, c dim]``) to the window stream, then the entries of
        every window that closed in this step to ``stream`` (``names``: the storage's kv, gate and entry arrays;
        ``rope``: positions -> the compress RoPE's tables)."""
        kv_rows, gate_rows, entries = (storage[n] for n in names)
        kv_rows[batch.slots], gate_rows[batch.slots] = inputs
        m = self.rate
        for b, start in enumerate(batch.starts):
            end = start + int(batch.cu_seqlens[b + 1] - batch.cu_seqlens[b])
            first, last = start // m, end // m  # windows first .. last - 1 close in this step
            if first == last:
                continue
            lead = 1 if self.overlap and first > 0 else 0
            rows = slots(batch.tables["window"][b], torch.arange((first - lead) * m, last * m, device=kv_rows.device),
                         page_size)
            shape = (-1, m, kv_rows.shape[1])
            out = self.compress(kv_rows[rows].view(shape), gate_rows[rows].view(shape), first)
            windows = torch.arange(first, last, device=out.device)
            entries[slots(batch.tables[stream][b], windows, page_size)] = rotate(out, *rope(windows * m, out.dtype))


class Indexer:
    """CSA's Lightning indexer: its compressor (keys at ``index_head_dim``), ``wq_b [IH ID, q_lora]``,
    ``weights_proj [IH, D]``."""

    def __init__(self, c: DeepseekV4Config, w: dict, prefix: str):
        self.c = c
        self.compressor = Compressor(w, prefix + "compressor.", c.index_head_dim, c.csa_rate, True, c.rms_norm_eps)
        self.wq_b, self.weights_proj = w[prefix + "wq_b.weight"], w[prefix + "weights_proj.weight"]

    def select(self, x, q_latent, tables, batch: PagedBatch, storage: dict, rope, page_size: int,
               ops) -> list[torch.Tensor]:
        """Append this step's keys; -> per sequence the picked entries ``[T_b, k]`` int64 (-1: none), ``k`` =
        min(index_topk, entries cached)."""
        c = self.c
        self.compressor.append(self.compressor.project(x, ops), ("idx_kv", "idx_gate", "index_keys"), storage, batch,
                               rope, page_size, "csa")
        T = x.shape[0]
        q = rotate(ops.linear(q_latent, self.wq_b).view(T, c.index_n_heads, c.index_head_dim), *tables)
        weights = F.linear(x, self.weights_proj).float() * c.index_n_heads ** -0.5
        picks = []
        for b, start in enumerate(batch.starts):
            lo, hi = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
            count = (start + hi - lo) // c.csa_rate
            if count == 0:
                picks.append(torch.full((hi - lo, 0), -1, dtype=torch.long, device=x.device))
                continue
            keys = storage["index_keys"][slots(batch.tables["csa"][b], torch.arange(count, device=x.device),
                                               page_size)]
            scores = F.relu(torch.einsum("thd,jd->thj", q[lo:hi].float(), keys.float())) * c.index_head_dim ** -0.5
            scores = (scores * weights[lo:hi, :, None]).sum(dim=1)  # [T_b, entries]
            visible = (batch.positions[lo:hi, None] + 1) // c.csa_rate
            scores = scores.masked_fill(torch.arange(count, device=x.device) >= visible, float("-inf"))
            top = scores.topk(min(c.index_topk, count), dim=-1).indices
            picks.append(top.where(top < visible, -1))
        return picks


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
        positions and ``"compress_at"``: positions -> the compress RoPE's tables (compressed entries)."""
        c, T = self.c, x.shape[0]
        cos, sin = tables["main" if self.kind == SLIDING else "compress"]
        q_latent = rms_norm(ops.linear(x, self.wq_a), self.q_norm, c.rms_norm_eps)
        q = unweighted_rms_norm(ops.linear(q_latent, self.wq_b).view(T, c.num_attention_heads, c.head_dim),
                                c.rms_norm_eps)
        q = rotate(q, cos, sin)
        storage["kv"][batch.slots] = rotate(rms_norm(ops.linear(x, self.wkv), self.kv_norm, c.rms_norm_eps), cos, sin)
        picks = None
        if self.compressor is not None:
            stream = "csa" if self.kind == CSA else "hca"
            self.compressor.append(self.compressor.project(x, ops), ("comp_kv", "comp_gate", "entries"), storage,
                                   batch, tables["compress_at"], page_size, stream)
        if self.indexer is not None:
            picks = self.indexer.select(x, q_latent, tables["compress"], batch, storage, tables["compress_at"],
                                        page_size, ops)
        out = torch.cat([self.attend(q, b, batch, storage, page_size, picks) for b in range(len(batch.starts))])
        out = rotate(out, cos, -sin)  # undo the rotation the values carried
        grouped = out.view(T, c.o_groups, -1)
        mixed = torch.cat([ops.linear(grouped[:, g], w) for g, w in enumerate(self.wo_a)], dim=-1)
        return ops.linear(mixed, self.wo_b)

    def attend(self, q, b: int, batch: PagedBatch, storage: dict, page_size: int, picks) -> torch.Tensor:
        """Sequence ``b``'s attention output ``[T_b, H, hd]`` over its window and compressed entries."""
        c = self.c
        lo, hi = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
        start, device = batch.starts[b], q.device
        end = start + hi - lo
        t = batch.positions[lo:hi, None]
        window = torch.arange(max(start - c.sliding_window + 1, 0), end, device=device)
        keys = storage["kv"][slots(batch.tables["window"][b], window, page_size)]
        masks = [(window <= t) & (window > t - c.sliding_window)]
        if self.compressor is not None:
            rate = self.compressor.rate
            entries = torch.arange(end // rate, device=device)
            stream = "csa" if self.kind == CSA else "hca"
            keys = torch.cat([keys, storage["entries"][slots(batch.tables[stream][b], entries, page_size)]])
            visible = entries < (t + 1) // rate
            if picks is not None:  # CSA: the indexer's picks only
                chosen = torch.zeros(hi - lo, entries.numel() + 1, dtype=torch.bool, device=device)
                chosen.scatter_(1, picks[b].where(picks[b] >= 0, entries.numel()), True)
                visible = chosen[:, :-1]
            masks.append(visible)
        mask = torch.cat(masks, dim=1)  # [T_b, keys]
        logits = torch.einsum("thd,jd->thj", q[lo:hi], keys) * c.head_dim ** -0.5
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1).expand(hi - lo, -1, 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        return torch.einsum("thj,jd->thd", probs.to(keys.dtype), keys)
