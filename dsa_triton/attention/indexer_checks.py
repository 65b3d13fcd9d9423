"""Argument checks of the indexer ops: shapes, dtypes and devices on the host; values (lengths, limits,
block-table entries) on the device, fetched in one transfer, so a call waits on the device once,
not once per check. Every failure is a ``ValueError`` naming the argument, raised before any launch.

``check_values=False`` (hot loops, CUDA graphs) skips the value checks; then a call needs no transfer
at all when the caller also gives the host-side sizes (``max_q``, ``num_cols`` / ``max_len``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from ..checks import INT32_MAX, check_int32, check_kernel_device, check_tensor
from .cache import PAGE_SIZES, SUMMARY_DTYPES



class DeviceChecks:
    """Conditions and values on the device, brought to the host together by :meth:`run`."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._parts: list[tuple[str, torch.Tensor]] = []

    def fail_if(self, bad: Callable[[], torch.Tensor], message: str) -> None:
        """Raise ``ValueError(message)`` at :meth:`run` if any element of ``bad()`` (a bool tensor) is set.
        ``bad`` is only evaluated when the checks are enabled."""
        if self.enabled:
            self._parts.append((message, bad().any().reshape(1).long()))

    def fetch(self, name: str, values: torch.Tensor) -> None:
        """Bring ``values`` (integers) to the host; :meth:`run` returns them under ``name``."""
        self._parts.append(("=" + name, values.reshape(-1).long()))

    def run(self) -> dict[str, list[int]]:
        """One device-to-host copy; raises the first failed condition in the order they were added."""
        if not self._parts:
            return {}
        flat = torch.cat([t for _, t in self._parts]).tolist()
        out, i = {}, 0
        for key, t in self._parts:
            values, i = flat[i:i + t.numel()], i + t.numel()
            if key.startswith("="):
                out[key[1:]] = values
            elif values[0]:
                raise ValueError(key)
        return out


@dataclass
class QueryRows:
    """Validated query rows: ``T`` rows of ``H`` heads x ``DK``, packed by sequence (``B`` of them)."""

    device: torch.device
    T: int
    H: int
    DK: int
    cu: torch.Tensor  # [B + 1] int32
    checks: DeviceChecks
    max_q: int | None = None  # the most rows of one sequence (fetched by finish() when not given)
    max_limit: int | None = None  # max(limits) (fetched by finish() when asked for)

    @property
    def B(self) -> int:
        return self.cu.shape[0] - 1

    @cached_property
    def row_seq(self) -> torch.Tensor:
        """``[T]`` int64 sequence of each row (clamped into range; meaningful once ``cu`` checks pass)."""
        rows = torch.arange(self.T, dtype=torch.int32, device=self.device)
        return torch.searchsorted(self.cu[1:], rows, right=True).clamp_max(self.B - 1)

    def finish(self, limits: torch.Tensor, need_max_limit: bool) -> None:
        """Run the device checks and fetch ``max_q`` / ``max_limit`` when unknown, in one transfer."""
        if self.max_q is None:
            self.checks.fetch("max_q", (self.cu[1:] - self.cu[:-1]).max())
        if need_max_limit and self.T:
            self.checks.fetch("max_limit", limits.max())
        host = self.checks.run()
        self.max_q = max(0, host["max_q"][0]) if "max_q" in host else self.max_q
        self.max_limit = host["max_limit"][0] if "max_limit" in host else 0


def check_queries(q, weights, limits, cu_seqlens_q, max_q: int | None = None, check_values: bool = True) -> QueryRows:
    """q ``[T, H, DK]`` e4m3 without NaN, weights ``[T, H]`` fp32, limits ``[T]`` int32 (>= 0), cu ``[B + 1]`` int32
    rising from 0 to T (default: one sequence holding every row); ``max_q`` the most rows of a sequence."""
    check_tensor("q", q, dtype=torch.float8_e4m3fn, ndim=3)
    device = check_kernel_device("q", q)
    T, H, DK = q.shape
    if H > 1 and q.stride(1) < DK:  # (one head: its stride is never used)
        raise ValueError(f"q: heads must be dense rows of DK elements, got strides {q.stride()}")
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=device)
    check_tensor("limits", limits, dtype=torch.int32, shape=(T,), device=device)
    if not limits.is_contiguous():
        raise ValueError(f"limits: must be contiguous, got strides {limits.stride()}")
    one_sequence = cu_seqlens_q is None
    if one_sequence:
        cu_seqlens_q = torch.tensor([0, T], dtype=torch.int32, device=device)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1, device=device)
    if cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q: needs B + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
    check_size("max_q", max_q)
    cu = cu_seqlens_q.contiguous()
    rows = QueryRows(device, T, H, DK, cu, DeviceChecks(check_values), T if one_sequence else max_q)
    rows.checks.fail_if(lambda: (cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any(),
                        f"cu_seqlens_q: must rise from 0 to T = {T}")
    if max_q is not None:
        rows.checks.fail_if(lambda: (cu[1:] - cu[:-1]) > max_q, f"max_q: a sequence has more than {max_q} rows")
    rows.checks.fail_if(lambda: limits < 0, "limits: must be >= 0")
    # e4m3 NaN is (byte & 0x7F) == 0x7F (the interpreter reads it as +-480: the check is the one guard there)
    rows.checks.fail_if(lambda: (q.view(torch.uint8) & 0x7F) == 0x7F, "q: holds NaN (an e4m3 byte 0x7F or 0xFF)")
    return rows


def check_block_table(rows: QueryRows, block_table, seq_lens, limits, num_pages: int, P: int) -> None:
    """block_table ``[>= B, max_pages]`` int32 with every used entry in ``[0, num_pages)``; seq_lens
    ``[>= B]`` int32 within the table; no row's limit beyond its sequence's length."""
    B = rows.B
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=rows.device)
    if block_table.shape[0] < B:
        raise ValueError(f"block_table: {block_table.shape[0]} rows for {B} sequences")
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=rows.device)
    if seq_lens.shape[0] < B:
        raise ValueError(f"seq_lens: {seq_lens.shape[0]} entries for {B} sequences")

    def lens():  # a device op only when the value checks run
        return seq_lens[:B].long()

    capacity = block_table.shape[1] * P
    rows.checks.fail_if(lambda: (lens() < 0) | (lens() > capacity),
                        f"seq_lens: must lie in [0, {capacity}] (table width x page size)")
    rows.checks.fail_if(lambda: limits.long() > lens()[rows.row_seq],
                        "limits: a row's limit exceeds its sequence's length in seq_lens")

    def bad_entries():
        used = torch.arange(block_table.shape[1], device=rows.device)[None, :] * P < lens()[:, None]
        return ((block_table[:B] < 0) | (block_table[:B] >= num_pages)) & used
    rows.checks.fail_if(bad_entries, f"block_table: an entry of a used page lies outside [0, {num_pages})")


def check_paged_keys(rows: QueryRows, k, k_scale, block_table, seq_lens, limits) -> int:
    """Paged FP8 keys ``k[num_pages, P, DK]`` (P in 16..128) and ``k_scale[num_pages, P]`` fp32, both
    contiguous; then the block table. Returns ``P``."""
    check_tensor("k", k, dtype=torch.float8_e4m3fn, ndim=3, device=rows.device)
    num_pages, P, DK = k.shape
    if P not in PAGE_SIZES:
        raise ValueError(f"k: page size (dimension 1) must be one of {PAGE_SIZES}, got {P}")
    if DK != rows.DK:
        raise ValueError(f"k: last dimension must be DK = {rows.DK}, got shape {tuple(k.shape)}")
    if not k.is_contiguous():
        raise ValueError(f"k: must be contiguous, got strides {k.stride()}")
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(num_pages, P), device=rows.device)
    if not k_scale.is_contiguous():
        raise ValueError(f"k_scale: must be contiguous, got strides {k_scale.stride()}")
    check_block_table(rows, block_table, seq_lens, limits, num_pages, P)
    return P


def check_contiguous_keys(rows: QueryRows, k, k_scale, key_starts, limits) -> torch.Tensor:
    """Contiguous FP8 keys ``k[S, DK]``, ``k_scale[S]`` fp32, ``key_starts[B]`` int32 (default 0) with
    ``key_starts + limits`` inside the ``S`` keys for every row. Returns ``key_starts``."""
    check_tensor("k", k, dtype=torch.float8_e4m3fn, ndim=2, device=rows.device)
    S = k.shape[0]
    if k.shape[1] != rows.DK:
        raise ValueError(f"k: last dimension must be DK = {rows.DK}, got shape {tuple(k.shape)}")
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(S,), device=rows.device)
    if not k_scale.is_contiguous():
        raise ValueError(f"k_scale: must be contiguous, got strides {k_scale.stride()}")
    if key_starts is None:
        key_starts = torch.zeros(rows.B, dtype=torch.int32, device=rows.device)
    check_tensor("key_starts", key_starts, dtype=torch.int32, shape=(rows.B,), device=rows.device)

    def starts():
        return key_starts.long()

    rows.checks.fail_if(lambda: (starts() < 0) | (starts() > S), f"key_starts: must lie in [0, {S}]")
    rows.checks.fail_if(lambda: starts()[rows.row_seq] + limits.long() > S,
                        f"limits: key_starts + limits must stay within the {S} keys")
    return key_starts.contiguous()


def check_summaries(rows: QueryRows, pmax, pmin) -> None:
    """pmax / pmin ``[num_pages, DK]`` bf16 or fp32 (one dtype) with equal strides (views into one
    summaries buffer or not), rows of contiguous elements."""
    check_tensor("pmax", pmax, dtype=SUMMARY_DTYPES, ndim=2, device=rows.device)
    if pmax.shape[1] != rows.DK:
        raise ValueError(f"pmax: dimension 1 must be DK = {rows.DK}, got shape {tuple(pmax.shape)}")
    if pmax.stride(1) != 1:
        raise ValueError(f"pmax: rows must be contiguous, got strides {pmax.stride()}")
    check_tensor("pmin", pmin, dtype=pmax.dtype, shape=tuple(pmax.shape), device=rows.device)
    if pmin.stride() != pmax.stride():
        raise ValueError(f"pmin: strides {pmin.stride()} must equal pmax's {pmax.stride()}")


def check_pages(rows: QueryRows, pages, seq_lens, P: int) -> None:
    """pages ``[T, n_sel]`` int32: -1 or a logical page inside the row's sequence."""
    check_tensor("pages", pages, dtype=torch.int32, ndim=2, device=rows.device)
    if pages.shape[0] != rows.T:
        raise ValueError(f"pages: {pages.shape[0]} rows for {rows.T} query rows")
    if not pages.is_contiguous():
        raise ValueError(f"pages: must be contiguous, got strides {pages.stride()}")
    rows.checks.fail_if(lambda: (pages < -1) | (pages.long() * P >= seq_lens[: rows.B].long()[rows.row_seq, None]),
                        "pages: entries must be -1 or pages inside the row's sequence")


def check_size(name: str, value, default: int | None = None) -> int | None:
    """An optional size: ``default`` for ``None``, else an ``int`` in ``[0, 2^31 - 1]`` (not a bool: sizes index
    int32 positions and columns)."""
    if value is None:
        return default
    return check_int32(name, value, 0, INT32_MAX)
