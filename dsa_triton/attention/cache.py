"""Paged caches of one DSA layer: :class:`PagedCache` (the tensors, page tables and lengths) and its
:class:`PageAllocator`.

Layout (page size ``P`` in 16, 32, 64, 128; every size a parameter):

- latent KV cache ``kv[num_pages, P, kv_dim]`` (bf16 on GPU; 576 = 512 latent + 64 rope), or the FP8 latent
  cache ``kv[num_pages, P, bytes]`` uint8 (``kv_dtype="fp8"``: 656 bytes a token for 512 + 64, DeepSeek's layout:
  e4m3 latent values, one fp32 power-of-two scale per 128 of them, bf16 rope values; :mod:`.formats`),
  quantized on append;
- indexer K cache ``ik[num_pages, P, index_dim]`` float8_e4m3fn and ``ik_scale[num_pages, P]`` fp32,
  one power-of-two scale per token vector, quantized on append (DeepSeek-V3.2 ``act_quant``, ue8m0);
- page summaries ``summaries[num_pages, 2, index_dim]`` bf16 (or fp32): ``[:, 0]`` = ``pmax``, ``[:, 1]`` =
  ``pmin``, the element-wise max / min of the page's dequantized indexer keys, kept current by every append.
  bf16 holds them exactly (an e4m3 value times a power of two has 4 significant bits) in half the bytes;
- ``block_table[max_seqs, max_pages_per_seq]`` int32 (-1 = no page), ``seq_lens[max_seqs]`` int32.

Token ``i`` of sequence ``b`` lives at physical slot ``block_table[b, i // P] * P + i % P``.

New tokens go in through :func:`~.append_tokens.append_tokens` (:meth:`PagedCache.append` plans its work items).
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

from ..checks import INT32_MAX, check_int32, check_device, check_tensor
from ..hostmath import cdiv
from .append_tokens import check_cache_tensors, check_append_values, append_plan, launch_append
from .formats import PAGE_SIZES, ROW_DTYPES, SUMMARY_DTYPES, check_fp8_latent_layout, fp8_latent_bytes

KV_DTYPES = (None, "fp8")  # PagedCache(kv_dtype=...): rows in ``dtype``, or the FP8 latent layout


def as_index(name: str, value) -> int:
    """``value`` as an ``int`` if it is an integer (Python, NumPy or a one-element integer tensor), not a bool;
    else a ValueError naming ``name`` (``int()`` would truncate ``1.7`` and parse ``"1"``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}: must be integers, got {value!r}")


def as_indices(name: str, values) -> list[int]:
    """``values`` (a sequence of integers or a 1-D integer tensor) as a list of ``int``; else a ValueError naming
    ``name`` (None, a string, a set, a float or a bool among them)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(values.shape)}")
    elif not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(f"{name}: expected a sequence of integers, got {type(values).__name__}")
    return [as_index(name, v) for v in values]


def page_items(row: int, start: int, n: int, pages: Sequence[int], P: int) -> list[tuple[int, int, int, int]]:
    """The work items of appending source rows ``row .. row + n`` at logical positions ``start .. start + n`` of a
    sequence whose logical page ``j`` is physical page ``pages[j]``: one ``(row, count, page, first slot)`` per
    touched page."""
    items, pos, end = [], start, start + n
    while pos < end:
        count = min(end - pos, P - pos % P)
        items.append((row, count, pages[pos // P], pos % P))
        row, pos = row + count, pos + count
    return items


class PageAllocator:
    """A free list of physical pages: ``allocate(n)`` hands out pages, ``free(pages)`` takes them back.

    A call that raises changes nothing."""

    def __init__(self, num_pages: int):
        check_int32("num_pages", num_pages)  # page ids are int32
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray([1]) * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def peek(self, n: int) -> list[int]:
        """The ``n`` pages the next ``allocate(n)`` hands out, without taking them."""
        n = as_index("n", n)
        if n < 0:
            raise ValueError(f"n: must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise ValueError(f"n: {n} pages requested, {len(self._free)} free")
        return self._free[len(self._free) - n:][::-1]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` (>= 0) free pages off the list; returns their ids. ``allocate(a + b)`` hands out the pages of
        ``allocate(a)`` and then ``allocate(b)``, in that order."""
        pages = self.peek(n)
        del self._free[len(self._free) - len(pages):]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return ``pages`` (distinct, allocated page ids) to the free list (the next ``allocate`` hands them out
        first). Anything else (not a sequence of integers, a page outside ``[0, num_pages)``, free or given twice)
        raises a ValueError naming ``pages``."""
        pages = as_indices("pages", pages)
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"pages: must lie in [0, {self.num_pages}), got {p}")
            if self._is_free[p]:
                raise ValueError(f"pages: page {p} is free already")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages: must be distinct, got {pages}")
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(reversed(pages))


class PagedCache:
    """Paged latent KV + FP8 indexer K caches of one layer, with block table, lengths and allocator.

    ``kv_dim`` or ``index_dim`` may be 0 to leave that cache out. ``dtype`` (of the latent rows): fp32, bf16 or
    fp16. ``device``: default :func:`~dsa_triton.runtime.default_device`. ``poison=True`` fills every slot with
    NaN (tests: a slot that was never written must never reach an output). ``summary_dtype``: bf16
    (exact, the default) or fp32. ``max_pages_per_seq`` (default ``num_pages``) is the block table's width.
    ``kv_dtype``: None keeps latent rows in ``dtype``; ``"fp8"`` keeps them in DeepSeek's FP8 latent layout
    (``kv`` uint8 ``[num_pages, P, fp8_latent_bytes(kv_dim - rope_dim, rope_dim)]``: 656 bytes for 576 = 512 + 64;
    the last ``rope_dim`` values of a row stay bf16; poisoned bytes are 0xFF, NaN in every part), and
    :meth:`append` takes fp32, bf16 or fp16 rows. ``bytes_per_token`` says what a token costs.
    Host-side bookkeeping (lengths, pages) lives in Python lists, so ``append`` with ``check_values=False``
    never waits on the device. A call that raises changes nothing: not the lengths, the block table, the
    allocator or the caches.

    Construction checks every argument before allocating: a size, dtype, device or layout it cannot hold raises a
    ValueError naming the argument. Slots and positions are int32: ``num_pages`` and ``max_pages_per_seq`` at most
    ``(2^31 - 1) // page_size``, ``max_seqs`` at most 2^31 - 1.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 64,
        max_seqs: int = 1,
        max_pages_per_seq: int | None = None,
        kv_dim: int = 576,
        index_dim: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        poison: bool = False,
        summary_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: str | None = None,
        rope_dim: int = 64,
    ):
        from ..runtime import default_device

        if type(page_size) is not int or page_size not in PAGE_SIZES:  # 16.0 == 16 would reach torch.full
            raise ValueError(f"page_size: must be one of {PAGE_SIZES}, got {page_size!r}")
        # slots (page * P + offset) and positions are int32
        check_int32("num_pages", num_pages, 1, INT32_MAX // page_size)
        check_int32("max_seqs", max_seqs)
        for name, dim in (("kv_dim", kv_dim), ("index_dim", index_dim)):
            if type(dim) is not int or dim < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {dim!r}")
            check_int32(name, dim, 0)
        if kv_dim + index_dim == 0:
            raise ValueError("kv_dim, index_dim: must not both be 0")
        if not isinstance(dtype, torch.dtype) or dtype not in ROW_DTYPES:
            raise ValueError(f"dtype: must be one of {ROW_DTYPES}, got {dtype!r}")
        if summary_dtype not in SUMMARY_DTYPES:
            raise ValueError(f"summary_dtype: must be one of {SUMMARY_DTYPES}, got {summary_dtype}")
        if not any(kv_dtype is k or kv_dtype == k for k in KV_DTYPES):
            raise ValueError(f"kv_dtype: must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype == "fp8" and kv_dim:
            if type(rope_dim) is not int or not 0 <= rope_dim < kv_dim:
                raise ValueError(f"rope_dim: must be an integer in [0, {kv_dim}) (kv_dim), got {rope_dim!r}")
            check_fp8_latent_layout("kv_dim, rope_dim", kv_dim - rope_dim, rope_dim)
        max_pages_per_seq = num_pages if max_pages_per_seq is None else check_int32(
            "max_pages_per_seq", max_pages_per_seq, 1, INT32_MAX // page_size)
        device = check_device("device", device) if device is not None else default_device()
        self.page_size, self.max_seqs, self.max_pages_per_seq = page_size, max_seqs, max_pages_per_seq
        self.kv_dim, self.kv_dtype, self.rope_dim = kv_dim, kv_dtype, rope_dim
        fill = float("nan") if poison else 0.0
        new = lambda shape, dt: torch.full(shape, fill, dtype=dt, device=device)  # noqa: E731
        if kv_dim and kv_dtype == "fp8":  # 0xFF: NaN as e4m3, as an fp32 scale and as bf16
            self.kv = torch.full((num_pages, page_size, fp8_latent_bytes(kv_dim - rope_dim, rope_dim)),
                                 0xFF if poison else 0, dtype=torch.uint8, device=device)
        else:
            self.kv = new((num_pages, page_size, kv_dim), dtype) if kv_dim else None
        ik_bytes = torch.full((num_pages, page_size, index_dim), 0x7F if poison else 0, dtype=torch.uint8, device=device)
        self.ik = ik_bytes.view(torch.float8_e4m3fn) if index_dim else None  # 0x7F: e4m3 NaN
        self.ik_scale = new((num_pages, page_size), torch.float32) if index_dim else None
        self.summaries = new((num_pages, 2, index_dim), summary_dtype) if index_dim else None
        self.block_table = torch.full((max_seqs, max_pages_per_seq), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.allocator = PageAllocator(num_pages)
        self._lens = [0] * max_seqs
        self._pages: list[list[int]] = [[] for _ in range(max_seqs)]

    @property
    def pmax(self) -> torch.Tensor | None:
        """``[num_pages, index_dim]`` view (summary dtype): element-wise max of each page's dequantized keys."""
        return None if self.summaries is None else self.summaries[:, 0]

    @property
    def pmin(self) -> torch.Tensor | None:
        """``[num_pages, index_dim]`` view (summary dtype): element-wise min of each page's dequantized keys."""
        return None if self.summaries is None else self.summaries[:, 1]

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes: its latent row (``kv_dim`` values in ``dtype``, or the FP8 layout: 656
        for 576) plus its indexer key and scale (``index_dim + 4``: 132). The page summaries come on top, per page
        (``2 * index_dim`` values in the summary dtype)."""
        kv = 0 if self.kv is None else self.kv.shape[-1] * self.kv.element_size()
        return kv + (0 if self.ik is None else self.ik.shape[-1] + 4)

    def lengths(self) -> list[int]:
        """Host copy of ``seq_lens``."""
        return list(self._lens)

    def append(
        self,
        seq_ids: Sequence[int],
        lens: Sequence[int],
        kv: torch.Tensor | None = None,
        index_k: torch.Tensor | None = None,
        *,
        config: dict | None = None,
        check_values: bool = True,
    ) -> None:
        """Append ``lens[i]`` tokens to sequence ``seq_ids[i]``; rows of ``kv[N, kv_dim]`` (in the cache's dtype;
        fp32, bf16 or fp16 into an FP8 latent cache) and ``index_k[N, index_dim]`` are packed in that order
        (``N = sum(lens)``). A decode step is
        ``lens = [1] * len(seq_ids)``. Pages are allocated as needed.

        Everything is checked before anything changes (ids, lengths, tensors, free pages, ``config``; a ValueError
        naming the argument), so a call that raises leaves the cache as it was. ``check_values=True`` also checks
        that ``kv`` and ``index_k`` are finite (one device-to-host transfer); with ``False`` the call never waits on
        the device and non-finite keys propagate as NaN (see :func:`append_tokens`).
        """
        seq_ids, lens = as_indices("seq_ids", seq_ids), as_indices("lens", lens)
        if len(seq_ids) != len(lens):
            raise ValueError(f"lens: {len(lens)} entries for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids) or any(not 0 <= s < self.max_seqs for s in seq_ids):
            raise ValueError(f"seq_ids: must be distinct and in [0, {self.max_seqs}), got {seq_ids}")
        if any(n < 0 for n in lens):
            raise ValueError(f"lens: must be >= 0, got {lens}")
        if (kv is None) != (self.kv is None) or (index_k is None) != (self.ik is None):
            raise ValueError("kv, index_k: give exactly the parts this cache holds")
        P = self.page_size
        if any(self._lens[s] + n > self.max_pages_per_seq * P for s, n in zip(seq_ids, lens)):
            raise ValueError(f"lens: a sequence would exceed max_pages_per_seq * page_size = {self.max_pages_per_seq * P}")
        new_pages = [cdiv(self._lens[s] + n, P) - len(self._pages[s]) for s, n in zip(seq_ids, lens)]
        if sum(new_pages) > self.allocator.num_free:
            raise ValueError(f"lens: needs {sum(new_pages)} new pages, {self.allocator.num_free} free")
        _, n_rows, _ = check_cache_tensors(self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k,
                                            self.rope_dim)
        if n_rows != sum(lens):
            raise ValueError(f"kv, index_k: {n_rows} rows, but sum(lens) = {sum(lens)}")
        if check_values:
            check_append_values(kv, index_k, None, n_rows, 0, P)

        # the plan: each sequence's new pages (the allocator's next ones, in order), work items, table entries
        fresh = iter(self.allocator.peek(sum(new_pages)))
        taken = [[next(fresh) for _ in range(n)] for n in new_pages]
        items, table_updates, row = [], [], 0
        for s, n, mine in zip(seq_ids, lens, taken):
            table_updates += [(s, len(self._pages[s]) + j, p) for j, p in enumerate(mine)]
            items += page_items(row, self._lens[s], n, self._pages[s] + mine, P)
            row += n
        # one host-to-device copy: work items, new block-table entries, new lengths
        flat = [x for item in items for x in item] + [x for u in table_updates for x in u]
        flat += [x for s, n in zip(seq_ids, lens) for x in (s, self._lens[s] + n)]
        meta = torch.tensor(flat, dtype=torch.int32).to(self.device)
        n_items, n_upd = 4 * len(items), 3 * len(table_updates)
        items_t = meta[:n_items].view(-1, 4)
        plan = append_plan(self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k, items_t, config,
                           self.rope_dim)
        launch_append(plan, self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k, items_t)

        # the launch is queued: commit the bookkeeping (the kernel reads none of it)
        self.allocator.allocate(sum(new_pages))
        for s, n, mine in zip(seq_ids, lens, taken):
            self._pages[s] += mine
            self._lens[s] += n
        upd = meta[n_items:n_items + n_upd].view(-1, 3).long()
        self.block_table[upd[:, 0], upd[:, 1]] = upd[:, 2].int()
        new_lens = meta[n_items + n_upd:].view(-1, 2)
        self.seq_lens[new_lens[:, 0].long()] = new_lens[:, 1]

    def _seq_id(self, seq_id) -> int:
        seq_id = as_index("seq_id", seq_id)
        if not 0 <= seq_id < self.max_seqs:
            raise ValueError(f"seq_id: must be in [0, {self.max_seqs}), got {seq_id}")
        return seq_id

    def release(self, seq_id: int) -> None:
        """Free sequence ``seq_id``'s pages and set its length to 0."""
        seq_id = self._seq_id(seq_id)
        self.allocator.free(self._pages[seq_id])
        self._pages[seq_id], self._lens[seq_id] = [], 0
        self.block_table[seq_id] = -1
        self.seq_lens[seq_id] = 0

    def slots(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots (int64, the shape of ``positions``) of logical ``positions`` of one sequence (an integer
        tensor of any shape and device): ``table[i // P] * P + i % P``. A ``seq_id`` outside ``[0, max_seqs)``, or
        ``positions`` that are not integers in ``[0, length)``, raise a ValueError naming it."""
        seq_id = self._seq_id(seq_id)
        P = self.page_size
        check_tensor("positions", positions, contiguous_last=False)
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise ValueError(f"positions: dtype must be an integer type, got {positions.dtype}")
        positions = positions.to(self.device, torch.int64)
        if bool(((positions < 0) | (positions >= self._lens[seq_id])).any()):
            raise ValueError(f"positions: must lie in [0, {self._lens[seq_id]})")
        return self.block_table[seq_id].long()[positions // P] * P + positions % P
