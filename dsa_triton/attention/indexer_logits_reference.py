"""Pure-PyTorch oracle for the DSA indexer logits (token level).

``score(t, s) = sum_h w[t, h] * relu(q[t, h] . k8[s]) * k_scale[s]`` for logical key positions
``s < limit[t]`` of row ``t``'s sequence, ``-inf`` elsewhere. ``q`` is FP8 e4m3 with its scales folded
into ``w``; keys come from the paged FP8 cache (through the block table) or a contiguous FP8 tensor.
"""
from __future__ import annotations

import contextlib

import torch

from .formats import fp8_rows


@contextlib.contextmanager
def exact_fp8_matmul():
    """Allow TF32 for fp32 matmuls: exact when the operands are FP8 values (3 mantissa bits, fit TF32's
    10) or such values times powers of two, with fp32 accumulation; many times faster on a GPU."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def sequence_keys(k: torch.Tensor, k_scale: torch.Tensor, b: int, n: int, *,
                  block_table: torch.Tensor | None = None, key_starts: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` keys of sequence ``b``: ``(k8[n, DK], scale[n])``, paged or contiguous."""
    pos = torch.arange(n, device=k.device)
    if block_table is not None:
        P = k.shape[1]
        slots = block_table[b].long()[pos // P] * P + pos % P
        return fp8_rows(k.reshape(-1, k.shape[-1]), slots), k_scale.reshape(-1)[slots]
    start = 0 if key_starts is None else int(key_starts[b])
    return k[start:start + n], k_scale[start:start + n]


def head_sum_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor | None,
                    compute_dtype: torch.dtype = torch.float32, row_chunk: int = 64) -> torch.Tensor:
    """``sum_h w[t, h] * relu(q[t, h] . keys[s]) * key_scale[s]`` -> ``[T, S]`` fp32 (rows in chunks)."""
    kt = keys.to(compute_dtype).t()
    out = torch.empty(q.shape[0], keys.shape[0], dtype=torch.float32, device=q.device)
    for r in range(0, q.shape[0], row_chunk):
        qc = q[r:r + row_chunk].to(compute_dtype)  # [t, H, DK]
        with exact_fp8_matmul():
            s = torch.relu(qc @ kt).float()  # [t, H, S]
        out[r:r + row_chunk] = torch.einsum("th,ths->ts", w[r:r + row_chunk].float(), s)
    return out if key_scale is None else out * key_scale.float()[None, :]


def indexer_logits_torch(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    limits: torch.Tensor,
    num_cols: int,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    key_starts: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Token-level logits ``[T, num_cols]`` fp32; shapes as in :func:`dsa_triton.indexer_logits`.

    ``compute_dtype=torch.bfloat16`` is the baseline a user would write (dequantize + bf16 matmul).
    """
    T = q.shape[0]
    cu = [0, T] if cu_seqlens_q is None else cu_seqlens_q.tolist()
    out = torch.full((T, num_cols), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu) - 1):
        r0, r1 = cu[b], cu[b + 1]
        if r0 == r1:
            continue
        n = min(num_cols, int(limits[r0:r1].max()))
        if n <= 0:
            continue
        keys, scale = sequence_keys(k, k_scale, b, n, block_table=block_table, key_starts=key_starts)
        logits = head_sum_logits(q[r0:r1], weights[r0:r1], keys, scale, compute_dtype)
        valid = torch.arange(n, device=q.device)[None, :] < limits[r0:r1, None]
        out[r0:r1, :n] = logits.where(valid, float("-inf"))
    return out
