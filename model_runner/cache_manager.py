"""Paged caches of every layer: which pages a sequence owns, and where one step's tokens go.

What a model's layers cache is declared by a *layout* (the family's): its streams (:mod:`.paging`: one entry a token,
or one per ``rate`` tokens, all kept or only a window) and the per-layer storage it allocates over their pages.
:class:`.latent_cache.LatentLayout` (the default: DeepSeek-V3.2, GLM-5) has one stream of one entry a token and a
latent cache with the indexer's keys per layer; DeepSeek-V4's (:mod:`.families.deepseek_v4.cache`) a window of the
last tokens' rows plus the compressors' entries. Every layer holds the same tokens at the same positions, so each
stream has one page allocator (``dt.PageAllocator``) and one block table for all layers, and a step's write plan is
computed once and used by every layer.

Pages are allocated as a sequence grows: :meth:`CacheManager.allocate` gives a sequence id with the pages of its
first chunk, :meth:`CacheManager.grow` adds pages before a step writes past them (and gives back the pages a window
no longer reads), :meth:`CacheManager.free` gives everything back, in every stream (a finished sequence, or a
preempted one that is recomputed later). :meth:`CacheManager.room` says how many tokens a sequence could hold now,
so a scheduler can size chunks and choose preemptions.

The manager owns each sequence's cached length (:meth:`CacheManager.length`): only :meth:`CacheManager.place` (which
every forward's batch goes through, eager or CUDA graph) advances it; the scheduler and the engine ask for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsa_triton.attention.cache import page_items
from dsa_triton.hostmath import cdiv

from .latent_cache import KV_CACHE_FORMATS, LatentLayout
from .paging import StreamPages

__all__ = ["KV_CACHE_FORMATS", "PagedBatch", "CacheManager"]


@dataclass
class PagedBatch:
    """One forward step: ``B`` sequences with ``T`` new tokens packed by sequence (device tensors).

    positions ``[T]`` int64 (int32 in the padded batches of :mod:`.cuda_graphs`); limits ``[T]`` int32 = position + 1 (causal: token t sees positions < limit);
    cu_seqlens ``[B + 1]`` int32; row_to_seq ``[T]`` int32 (row of ``block_table``); block_table
    ``[B, max_pages]`` int32 and seq_lens ``[B]`` int32 after this step's append; last_rows ``[B]`` int64;
    the write plan as ``dt.append_tokens`` work items ``items[n, 4]`` int32 and, for the reference, per-token
    ``slots[T]``, touched ``pages[n]`` and their ``fill[n]`` (int64). These tables and slots are the primary
    stream's (the layout's first); ``tables`` holds every stream's block-table rows ``[B, max_pages]`` int32 and
    ``starts`` each sequence's cached tokens before the step (host ints).
    """
    seq_ids: list[int]
    positions: torch.Tensor
    limits: torch.Tensor
    cu_seqlens: torch.Tensor
    row_to_seq: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    last_rows: torch.Tensor
    items: torch.Tensor
    slots: torch.Tensor
    pages: torch.Tensor
    fill: torch.Tensor
    num_cols: int
    max_q: int
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    starts: list[int] = field(default_factory=list)

    @property
    def decode(self) -> bool:
        """One new token per sequence: the decode kernels."""
        return self.max_q == 1


class CacheManager:
    """Pages and storage for up to ``max_seqs`` sequences of at most ``max_seq_len`` tokens, pages of ``page_size``
    entries: ``num_pages`` of them in the primary stream (the layout sizes the others). ``poison=True`` fills unwritten
    slots with NaN (tests). ``layout``: what the layers cache (default :class:`.latent_cache.LatentLayout` of
    ``config`` with ``index_precision`` and ``kv_cache``). ``layers``: each layer's storage (the layout's)."""

    def __init__(self, config, num_pages: int, page_size: int, max_seqs: int, max_seq_len: int, dtype: torch.dtype,
                 device, poison: bool = False, index_precision: str = "fp8", kv_cache: str = "activation",
                 layout=None):
        self.layout = layout or LatentLayout(config, index_precision, kv_cache)
        self.page_size, self.device, self.dtype = page_size, torch.device(device), dtype
        self.max_pages = cdiv(max_seq_len, page_size)  # a sequence's tokens at most: max_pages * page_size
        counts = self.layout.page_counts(num_pages, page_size, max_seqs, max_seq_len)
        self.streams = {name: StreamPages(stream, counts[name], page_size, max_seqs, max_seq_len, device)
                        for name, stream in self.layout.streams.items()}
        primary = next(iter(self.streams.values()))
        self.allocator, self.block_table, self._pages = primary.allocator, primary.block_table, primary.pages
        self.layers = self.layout.allocate(counts, page_size, dtype, device, poison)
        self._lens = [0] * max_seqs
        self._free_ids = list(range(max_seqs - 1, -1, -1))

    @property
    def index_keys(self) -> list[torch.Tensor | None]:
        """The activation-precision indexer keys of each layer (:class:`.latent_cache.LatentLayout`)."""
        return self.layout.index_keys

    def bytes_per_token(self, layer: int = 0) -> dict[str, int]:
        """Bytes one token takes in ``layer``, by cache (the layout's)."""
        return self.layout.bytes_per_token(layer)

    def nbytes(self) -> dict[str, int]:
        """Bytes of each cache, all layers (the layout's lines)."""
        return self.layout.nbytes()

    @property
    def num_free_pages(self) -> int:
        """Free pages of the primary stream."""
        return self.allocator.num_free

    def room(self, seq: int | None = None, reserve: list[tuple[int, int]] = ()) -> int:
        """Tokens sequence ``seq`` could hold now, in every stream: its pages (less those a window no longer reads)
        plus the free ones, less one for each ``(sequence, tokens)`` of ``reserve`` whose next token needs a new page
        there; at most ``max_pages * page_size``. ``seq=None``: a new sequence (0 when no sequence id is free)."""
        if seq is None and not self._free_ids:
            return 0
        cached = 0 if seq is None else self._lens[seq]
        reach = [s.reach(seq, cached, sum(s.needs_page(r, n) for r, n in reserve)) for s in self.streams.values()]
        return min(*reach, self.max_pages * self.page_size)

    def capacity(self, held_by: list[int] = ()) -> int:
        """Tokens one sequence could hold if it had the whole cache: the free pages and those of the sequences
        ``held_by``, in every stream; at most ``max_pages * page_size``."""
        reach = [s.capacity(list(held_by)) for s in self.streams.values()]
        return min([r for r in reach if r is not None] + [self.max_pages * self.page_size])

    def can_allocate(self, n_tokens: int) -> bool:
        return n_tokens <= self.room()

    def allocate(self, n_tokens: int = 0) -> int:
        """A new sequence with pages for its first ``n_tokens`` tokens; returns its id (a row of the block tables)."""
        if not self.can_allocate(n_tokens):
            raise ValueError(f"n_tokens: {n_tokens} tokens do not fit (free pages {self.allocator.num_free}, "
                             f"free sequence ids {len(self._free_ids)}, at most {self.max_pages} pages a sequence)")
        seq = self._free_ids.pop()
        self._lens[seq] = 0
        for stream in self.streams.values():
            stream.pages[seq] = []
        self.grow(seq, n_tokens)
        return seq

    def grow(self, seq: int, n_tokens: int) -> None:
        """Give sequence ``seq`` the pages to hold ``n_tokens`` tokens in all (a no-op when it has them)."""
        if all(s.pages_for(n_tokens) <= len(s.pages[seq]) for s in self.streams.values()):
            return
        if n_tokens > self.room(seq):
            raise ValueError(f"n_tokens: sequence {seq} cannot hold {n_tokens} tokens (it has {len(self._pages[seq])} "
                             f"pages, {self.allocator.num_free} are free, at most {self.max_pages} a sequence)")
        for stream in self.streams.values():
            stream.grow(seq, self._lens[seq], n_tokens)

    def free(self, seq: int) -> None:
        """Give sequence ``seq``'s pages (every stream's) and id back."""
        for stream in self.streams.values():
            stream.free(seq)
        self._free_ids.append(seq)

    def length(self, seq: int) -> int:
        """Tokens of sequence ``seq`` in the cache (placed by the forwards so far)."""
        return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        """Sequence ``seq``'s physical pages of the primary stream in logical order (read only)."""
        return self._pages[seq]

    def place(self, chunks: list[tuple[int, int]]) -> list[int]:
        """Put ``count`` new tokens after each sequence's cached ones, for ``(seq, count)`` in ``chunks``: checks
        that its pages hold them, advances its length and returns the start positions."""
        starts = []
        for seq, count in chunks:
            start = self._lens[seq]
            if any(s.pages_for(start + count) > len(s.pages[seq]) for s in self.streams.values()):
                raise ValueError(f"chunks: sequence {seq} would exceed its {len(self._pages[seq])} pages (grow first)")
            starts.append(start)
        for (seq, count), start in zip(chunks, starts):
            self._lens[seq] = start + count
        return starts

    def prepare(self, chunks: list[tuple[int, int]]) -> PagedBatch:
        """Place ``count`` new tokens after each sequence's cached ones, for ``(seq, count)`` in ``chunks``."""
        P = self.page_size
        positions, items, slots, row = [], [], [], 0
        starts = self.place(chunks)
        for (seq, count), start in zip(chunks, starts):
            end = start + count
            positions += range(start, end)
            slots += [self._pages[seq][i // P] * P + i % P for i in range(start, end)]
            items += page_items(row, start, count, self._pages[seq], P)
            row += count
        counts = [n for _, n in chunks]
        seq_ids = [s for s, _ in chunks]
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        as_tensor = lambda v, dtype: torch.tensor(v, dtype=dtype).to(self.device)  # noqa: E731
        positions_t = as_tensor(positions, torch.int64)
        items_t = as_tensor(items, torch.int32).view(-1, 4)
        rows = as_tensor(seq_ids, torch.int64)
        return PagedBatch(
            seq_ids=seq_ids, positions=positions_t, limits=(positions_t + 1).int(), cu_seqlens=as_tensor(cu, torch.int32),
            row_to_seq=as_tensor([b for b, n in enumerate(counts) for _ in range(n)], torch.int32),
            block_table=self.block_table[rows], seq_lens=as_tensor([self._lens[s] for s in seq_ids], torch.int32),
            last_rows=as_tensor(cu[1:], torch.int64) - 1, items=items_t, slots=as_tensor(slots, torch.int64),
            pages=items_t[:, 2].long(), fill=(items_t[:, 3] + items_t[:, 1]).long(),
            num_cols=max(self._lens[s] for s in seq_ids), max_q=max(counts),
            tables={name: s.block_table[rows] for name, s in self.streams.items()}, starts=starts)
