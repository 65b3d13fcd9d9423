"""Pure-PyTorch oracle of DeepSeek-V4's compressors (transformers' ``DeepseekV4HCACompressor``,
``DeepseekV4CSACompressor`` and the CSA indexer's own): the math of :func:`dsa_triton.compress_entries`, which the
runner's reference mode runs (one oracle).

Window ``w`` of ``m`` = ``ratio`` tokens (tokens ``[w m, (w + 1) m)``) closes once its last token is in; its entry is

    entry_w = rotate(rms_norm(sum_s softmax_s(gate_s + ape_s) kv_s), row w of cos / sin)

over ``c m`` slots (``c`` = 2 with CSA's overlap, else 1): without the overlap the window's tokens, each its
``kv``, ``gate`` row ``[D]``; with it the previous window's tokens' first halves (``Ca``: columns ``[0, D)``) and
this window's tokens' second halves (``Cb``: ``[D, 2D)``), window 0's ``Ca`` slots empty (weight 0). The softmax is
per column, in fp32 (``gate`` in the activation dtype plus the fp32 ``ape``); its weights are cast to the
activation dtype before multiplying ``kv`` and the products are summed in it, as transformers does. The norm is in
fp32 with the fp32 weight, cast back; the rotation (interleaved pairs on the last dims) in fp32, cast back.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, in fp32, cast to ``x``'s dtype (transformers' DeepSeek-V4 norm)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last ``2 x cos.shape[-1]`` dims of ``x[T, ..., d]`` as interleaved pairs, in fp32 (layout kept);
    ``cos``, ``sin`` ``[T, r / 2]`` (their values as given: DeepSeek-V4 rounds them to ``x``'s dtype)."""
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c, s = (t.repeat_interleave(2, dim=-1).view(shape).float() for t in (cos, sin))
    rope = x[..., -r:].float()
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], (rope * c + half * s).to(x.dtype)], dim=-1)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, overlap: bool, lead: int) -> torch.Tensor:
    """Pooled rows ``[n, D]`` (not normed) of ``n`` windows from their tokens' ``kv``, ``gate`` ``[n + lead, m, c D]``
    (activation dtype) and ``ape [m, c D]`` fp32; with the overlap, ``lead`` 1 when the first window has one before
    it (its tokens lead the inputs), 0 for window 0."""
    D = kv.shape[-1] // (2 if overlap else 1)
    m = kv.shape[1]
    gate = gate.float() + ape
    if overlap:
        n = kv.shape[0] - lead
        slots_kv = kv.new_zeros(n, 2 * m, D)
        slots_gate = gate.new_full((n, 2 * m, D), float("-inf"))
        slots_kv[:, m:], slots_gate[:, m:] = kv[lead:, :, D:], gate[lead:, :, D:]  # each window's Cb
        slots_kv[1 - lead:, :m], slots_gate[1 - lead:, :m] = kv[:-1, :, :D], gate[:-1, :, :D]  # the Ca before
        kv, gate = slots_kv, slots_gate
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def paged_slots(table: torch.Tensor, entries: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical rows ``[n]`` int64 of a sequence's ``entries [n]`` (logical indices) through its block-table row."""
    return table[entries // page_size].long() * page_size + entries % page_size


def compress_entries_torch(kv: torch.Tensor, gate: torch.Tensor, kv_window: torch.Tensor, gate_window: torch.Tensor,
                           window_table: torch.Tensor, entries: torch.Tensor, entry_table: torch.Tensor,
                           cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, ape: torch.Tensor,
                           norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, ratio: int,
                           overlap: bool, eps: float) -> None:
    """Oracle of :func:`dsa_triton.compress_entries` (same arguments; writes ``entries`` in place).

    Sequence ``b`` (rows ``cu[b] .. cu[b + 1]`` of ``kv``, ``gate``: its tokens ``start .. seq_lens[b] - 1``) closes
    windows ``start // m .. seq_lens[b] // m - 1``; their tokens before ``start`` come from the window stream
    (``kv_window``, ``gate_window`` through ``window_table``), the others from ``kv``, ``gate``.
    """
    m, width = ratio, kv.shape[-1]
    kv_rows, gate_rows = kv_window.reshape(-1, width), gate_window.reshape(-1, width)
    out = entries.view(-1, entries.shape[-1])
    Pw, Pc = kv_window.shape[1], entries.shape[1]
    cu, lens = cu_seqlens.tolist(), seq_lens.tolist()
    for b in range(len(cu) - 1):
        end = lens[b]
        start = end - (cu[b + 1] - cu[b])
        first, last = start // m, end // m
        if first == last:
            continue
        lead = 1 if overlap and first > 0 else 0
        pos = torch.arange((first - lead) * m, last * m, device=kv.device)
        old = pos < start
        window = paged_slots(window_table[b], pos[old], Pw)
        new = cu[b] + pos[~old] - start
        tokens = [torch.cat([cached[window], rows[new]]).view(-1, m, width)
                  for cached, rows in ((kv_rows, kv), (gate_rows, gate))]
        normed = rms_norm(pool_windows(*tokens, ape, overlap, lead), norm_weight, eps)
        windows = torch.arange(first, last, device=kv.device)
        out[paged_slots(entry_table[b], windows, Pc)] = rotate(normed, cos[windows], sin[windows])
