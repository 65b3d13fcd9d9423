"""Page bookkeeping of one paged per-sequence cache (a *stream*): which pages each sequence holds, in a block table;
and what a layer's caches cost (:class:`LayerCost`, the memory plan's unit).

A stream holds one entry every ``rate`` tokens of a sequence (1: one a token; 4: one per 4 tokens, once all 4 are
cached), ``P`` entries a page. ``keep`` (None: every entry) makes it a window: a step starting at ``n`` cached tokens
reads back at most the ``keep`` entries before its own, so the pages wholly before entry ``entries(n) - keep`` are
given back as the sequence grows (their block-table entries become -1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import dsa_triton as dt
from dsa_triton.hostmath import cdiv


@dataclass(frozen=True)
class LayerCost:
    """What the caches of ``layers`` layers of one kind cost, each: ``per_sequence`` bytes whatever its length (a
    window) and ``per_token`` bytes for each token it holds; ``what`` says what is kept."""
    kind: str
    layers: int
    per_sequence: int
    per_token: float
    what: str


@dataclass(frozen=True)
class Stream:
    """A cache's geometry: an entry every ``rate`` tokens, the last ``keep`` entries read back (None: all)."""
    rate: int = 1
    keep: int | None = None

    def entries(self, tokens: int) -> int:
        return tokens // self.rate

    def first_read(self, tokens: int) -> int:
        """The first entry a step starting at ``tokens`` cached tokens reads."""
        return 0 if self.keep is None else max(self.entries(tokens) - self.keep, 0)


class StreamPages:
    """One stream's pages for up to ``max_seqs`` sequences of at most ``max_seq_len`` tokens: an allocator of
    ``num_pages`` pages of ``page_size`` entries, ``block_table[max_seqs, max_pages]`` int32 on ``device`` (-1:
    none), and each sequence's pages in logical order (-1: given back)."""

    def __init__(self, stream: Stream, num_pages: int, page_size: int, max_seqs: int, max_seq_len: int, device):
        self.stream, self.page_size = stream, page_size
        self.max_pages = max(cdiv(stream.entries(max_seq_len), page_size), 1)
        self.allocator = dt.PageAllocator(num_pages)
        self.block_table = torch.full((max_seqs, self.max_pages), -1, dtype=torch.int32, device=device)
        self.pages: dict[int, list[int]] = {}

    def pages_for(self, tokens: int) -> int:
        """Logical pages a sequence of ``tokens`` tokens spans."""
        return cdiv(self.stream.entries(tokens), self.page_size)

    def dead(self, seq: int | None, cached: int) -> list[int]:
        """Logical pages of ``seq`` that no step from ``cached`` tokens on reads, not yet given back."""
        if seq is None:
            return []
        pages = self.pages[seq]
        return [j for j in range(min(self.stream.first_read(cached) // self.page_size, len(pages))) if pages[j] >= 0]

    def reach(self, seq: int | None, cached: int, reserve: int) -> int:
        """Tokens ``seq`` (None: a new sequence) could hold now with its pages, its dead ones given back and the free
        ones less ``reserve``, at most ``max_pages`` pages."""
        held = len(self.pages[seq]) if seq is not None else 0
        pages = min(held + max(self.allocator.num_free + len(self.dead(seq, cached)) - reserve, 0), self.max_pages)
        return (pages * self.page_size + 1) * self.stream.rate - 1

    def capacity(self, held_by: list[int]) -> int | None:
        """Tokens one sequence could hold with every free page and those of ``held_by``: None for a window that
        holds its read-back entries and the next (any length then fits, a chunk at a time)."""
        pages = self.allocator.num_free + sum(sum(p >= 0 for p in self.pages[s]) for s in held_by)
        if self.stream.keep is not None and pages >= cdiv(self.stream.keep + 1, self.page_size) + 1:
            return None
        return (pages * self.page_size + 1) * self.stream.rate - 1

    def needs_page(self, seq: int, tokens: int) -> bool:
        """Whether ``seq``'s next token after ``tokens`` needs a new page here."""
        return self.pages_for(tokens + 1) > len(self.pages[seq])

    def grow(self, seq: int, cached: int, tokens: int) -> None:
        """Give back ``seq``'s dead pages (from ``cached`` on), then add the pages to hold ``tokens`` tokens (the
        caller checked that they fit)."""
        pages = self.pages.setdefault(seq, [])
        dead = self.dead(seq, cached)
        if dead:
            self.allocator.free([pages[j] for j in dead])
            for j in dead:
                pages[j] = -1
            self.block_table[seq, dead] = -1
        need = self.pages_for(tokens) - len(pages)
        if need > 0:
            new = self.allocator.allocate(need)
            self.block_table[seq, len(pages): len(pages) + need] = torch.tensor(new, dtype=torch.int32)
            pages += new

    def free(self, seq: int) -> None:
        """Give every page of ``seq`` back."""
        self.allocator.free([p for p in self.pages.pop(seq, []) if p >= 0])
        self.block_table[seq] = -1
