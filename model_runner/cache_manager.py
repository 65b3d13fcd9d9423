"""Paged caches of every layer: which pages a sequence owns, and where one step's tokens go.

Every layer holds the same tokens at the same positions, so one page allocator (``dt.PageAllocator``) and one
block table serve all layers, and a step's write plan is computed once and used by every layer. Each layer's
storage is a ``dt.PagedCache`` (latent rows ``kv[num_pages, P, kv_lora + rope]``, FP8 indexer keys, key scales and
page summaries); its own one-row block table is not used. ``kv_cache="fp8"`` keeps the latent rows in DeepSeek's FP8
layout (656 bytes a token for 512 + 64: e4m3 latent values, one fp32 scale per 128, bf16 rope values), quantized by
the append op and dequantized inside the attention kernels. With the indexer in the activation dtype
(``index_precision="activation"``) the layer's indexer keys are kept unrounded in ``index_keys[layer]``
``[num_pages * P, index_head_dim]`` instead of the FP8 indexer cache.

Pages are allocated as a sequence grows: :meth:`CacheManager.allocate` gives a sequence id with the pages of its
first chunk, :meth:`CacheManager.grow` adds pages before a step writes past them, :meth:`CacheManager.free` gives
everything back (a finished sequence, or a preempted one that is recomputed later). :meth:`CacheManager.room` says
how many tokens a sequence could hold now, so a scheduler can size chunks and choose preemptions.

The manager owns each sequence's cached length (:meth:`CacheManager.length`): only :meth:`CacheManager.place` (which
every forward's batch goes through, eager or CUDA graph) advances it; the scheduler and the engine ask for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import dsa_triton as dt
from dsa_triton.attention.cache import page_items
from dsa_triton.hostmath import cdiv

from .config import ModelConfig
from .errors import RunnerError

KV_CACHE_FORMATS = ("activation", "fp8")  # latent cache rows in the activation dtype, or the FP8 layout


@dataclass
class PagedBatch:
    """One forward step: ``B`` sequences with ``T`` new tokens packed by sequence (device tensors).

    positions ``[T]`` int64 (int32 in the padded batches of :mod:`.cuda_graphs`); limits ``[T]`` int32 = position + 1 (causal: token t sees positions < limit);
    cu_seqlens ``[B + 1]`` int32; row_to_seq ``[T]`` int32 (row of ``block_table``); block_table
    ``[B, max_pages]`` int32 and seq_lens ``[B]`` int32 after this step's append; last_rows ``[B]`` int64;
    the write plan as ``dt.append_tokens`` work items ``items[n, 4]`` int32 and, for the reference, per-token
    ``slots[T]``, touched ``pages[n]`` and their ``fill[n]`` (int64).
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

    @property
    def decode(self) -> bool:
        """One new token per sequence: the decode kernels."""
        return self.max_q == 1


class CacheManager:
    """Pages and storage for up to ``max_seqs`` sequences of at most ``max_seq_len`` tokens, in ``num_pages``
    pages of ``page_size`` tokens per layer. ``poison=True`` fills unwritten slots with NaN (tests);
    ``index_precision``: "fp8" (DeepSeek's FP8 indexer cache) or "activation" (keys in ``dtype``);
    ``kv_cache``: "activation" (latent rows in ``dtype``) or "fp8" (DeepSeek's FP8 latent cache)."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, max_seqs: int, max_seq_len: int,
                 dtype: torch.dtype, device, poison: bool = False, index_precision: str = "fp8",
                 kv_cache: str = "activation"):
        if kv_cache not in KV_CACHE_FORMATS:
            raise RunnerError(f"kv_cache: must be one of {KV_CACHE_FORMATS}, got {kv_cache!r}")
        self.page_size, self.device, self.kv_cache = page_size, torch.device(device), kv_cache
        self.max_pages = cdiv(max_seq_len, page_size)
        self.allocator = dt.PageAllocator(num_pages)
        fp8_index = index_precision == "fp8"
        self.layers = [dt.PagedCache(num_pages, page_size, 1, 1, config.latent_dim,
                                     config.index_head_dim if fp8_index else 0, dtype, device, poison=poison,
                                     kv_dtype="fp8" if kv_cache == "fp8" else None,
                                     rope_dim=config.qk_rope_head_dim)
                       for _ in range(config.num_hidden_layers)]
        fill = float("nan") if poison else 0.0
        self.index_keys = [None if fp8_index else
                           torch.full((num_pages * page_size, config.index_head_dim), fill, dtype=dtype, device=device)
                           for _ in range(config.num_hidden_layers)]
        self.block_table = torch.full((max_seqs, self.max_pages), -1, dtype=torch.int32, device=device)
        self._pages: dict[int, list[int]] = {}
        self._lens = [0] * max_seqs
        self._free_ids = list(range(max_seqs - 1, -1, -1))

    def bytes_per_token(self) -> dict[str, int]:
        """Bytes one token takes in one layer: ``{"kv cache": its latent row (1152 in bf16, 656 in FP8 for
        DeepSeek-V3.2), "indexer cache": its key and scale (132), or its activation-dtype key}`` (the indexer's page
        summaries come on top, per page)."""
        layer, keys = self.layers[0], self.index_keys[0]
        kv = layer.kv.shape[-1] * layer.kv.element_size()
        return {"kv cache": kv,
                "indexer cache": layer.bytes_per_token - kv if keys is None else keys.shape[-1] * keys.element_size()}

    def nbytes(self) -> dict[str, int]:
        """Bytes of the latent KV cache and of the indexer caches (keys, scales, page summaries), all layers; each
        line names the format and the bytes a token takes in every layer together."""
        size = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
        index = sum(size(c.ik, c.ik_scale, c.summaries) for c in self.layers) + size(*self.index_keys)
        per_token = {k: v * len(self.layers) for k, v in self.bytes_per_token().items()}
        index_format = "fp8, + page summaries" if self.index_keys[0] is None else "activation"
        return {f"kv cache ({self.kv_cache}, {per_token['kv cache']} B a token)": sum(size(c.kv) for c in self.layers),
                f"indexer cache ({per_token['indexer cache']} B a token, {index_format})": index}

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    def room(self, seq: int | None = None, reserve_pages: int = 0) -> int:
        """Tokens sequence ``seq`` could hold now: its pages plus the free ones less ``reserve_pages``, at most
        ``max_pages`` pages. ``seq=None``: a new sequence (0 when no sequence id is free)."""
        if seq is None and not self._free_ids:
            return 0
        owned = len(self._pages[seq]) if seq is not None else 0
        return min(owned + max(self.allocator.num_free - reserve_pages, 0), self.max_pages) * self.page_size

    def can_allocate(self, n_tokens: int) -> bool:
        return n_tokens <= self.room()

    def allocate(self, n_tokens: int = 0) -> int:
        """A new sequence with pages for its first ``n_tokens`` tokens; returns its id (a row of the block table)."""
        if not self.can_allocate(n_tokens):
            raise ValueError(f"n_tokens: {n_tokens} tokens do not fit (free pages {self.allocator.num_free}, "
                             f"free sequence ids {len(self._free_ids)}, at most {self.max_pages} pages a sequence)")
        seq = self._free_ids.pop()
        self._pages[seq], self._lens[seq] = [], 0
        self.grow(seq, n_tokens)
        return seq

    def grow(self, seq: int, n_tokens: int) -> None:
        """Give sequence ``seq`` the pages to hold ``n_tokens`` tokens in all (a no-op when it has them)."""
        pages = self._pages[seq]
        need = cdiv(n_tokens, self.page_size) - len(pages)
        if need <= 0:
            return
        if n_tokens > self.room(seq):
            raise ValueError(f"n_tokens: sequence {seq} cannot hold {n_tokens} tokens (it has {len(pages)} pages, "
                             f"{self.allocator.num_free} are free, at most {self.max_pages} a sequence)")
        new = self.allocator.allocate(need)
        self.block_table[seq, len(pages): len(pages) + need] = torch.tensor(new, dtype=torch.int32)
        pages += new

    def free(self, seq: int) -> None:
        """Give sequence ``seq``'s pages and id back."""
        self.allocator.free(self._pages.pop(seq))
        self.block_table[seq] = -1
        self._free_ids.append(seq)

    def length(self, seq: int) -> int:
        """Tokens of sequence ``seq`` in the cache (placed by the forwards so far)."""
        return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        """Sequence ``seq``'s physical pages in logical order (read only)."""
        return self._pages[seq]

    def place(self, chunks: list[tuple[int, int]]) -> list[int]:
        """Put ``count`` new tokens after each sequence's cached ones, for ``(seq, count)`` in ``chunks``: checks
        that its pages hold them, advances its length and returns the start positions."""
        P, starts = self.page_size, []
        for seq, count in chunks:
            start = self._lens[seq]
            if start + count > len(self._pages[seq]) * P:
                raise ValueError(f"chunks: sequence {seq} would exceed its {len(self._pages[seq])} pages (grow first)")
            starts.append(start)
        for (seq, count), start in zip(chunks, starts):
            self._lens[seq] = start + count
        return starts

    def prepare(self, chunks: list[tuple[int, int]]) -> PagedBatch:
        """Place ``count`` new tokens after each sequence's cached ones, for ``(seq, count)`` in ``chunks``."""
        P = self.page_size
        positions, items, slots, row = [], [], [], 0
        for (seq, count), start in zip(chunks, self.place(chunks)):
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
        return PagedBatch(
            seq_ids=seq_ids, positions=positions_t, limits=(positions_t + 1).int(), cu_seqlens=as_tensor(cu, torch.int32),
            row_to_seq=as_tensor([b for b, n in enumerate(counts) for _ in range(n)], torch.int32),
            block_table=self.block_table[as_tensor(seq_ids, torch.int64)],
            seq_lens=as_tensor([self._lens[s] for s in seq_ids], torch.int32),
            last_rows=as_tensor(cu[1:], torch.int64) - 1, items=items_t, slots=as_tensor(slots, torch.int64),
            pages=items_t[:, 2].long(), fill=(items_t[:, 3] + items_t[:, 1]).long(),
            num_cols=max(self._lens[s] for s in seq_ids), max_q=max(counts))
