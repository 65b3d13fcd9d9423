"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket; a step is padded to its bucket.

Buckets: 1, 2, 4, 8, 16, then every 16 up to ``max_batch``. A step's inputs go to the device in one copy, as rows
of a static ``[5, max_batch]`` int32 tensor: token ids, positions, sequence ids (rows of the cache's block tables),
the physical page of each new token in the primary stream and a count (1; 0 for a padding row). The rest of the
:class:`.cache_manager.PagedBatch` is derived on the device inside the graph: ``limits = seq_lens =
(position + 1) * count``, append items ``(row, count, page, position % P)``, every stream's block-table rows gathered
from the cache's tables (whose pages the host writes as sequences grow), and fixed ``cu_seqlens`` / ``row_to_seq`` /
``last_rows``. The width a model sizes by the longest sequence (``num_cols``: V3.2's indexer, V4's compressed
entries) is the cache's capacity (``max_pages * P``), so that no size depends on the step.

Padding rows: token 0 at position 0 with count 0 and sequence length 0, each stream's block-table row all that
stream's scratch page (one a stream, reserved for them, which no sequence reads): whatever a padding row writes (the
page summary V3.2's append kernel rewrites, V4's window rows of its token) lands there. Their indexer rows are all
``-inf``, their top-k all -1, their attention finite (V3.2: 0; V4: its own window row) and their logits dropped.

Every op must then run on its graph-safe path: kernel mode with ``check_values=False``, and whatever else the model
needs (its ``graph_obstacle()``: V3.2 the FP8 indexer, whose activation-precision scores read sizes on the host).
Without a CUDA device the same padded batches run eagerly (``capture=False``), which is what the CPU tests check
against unpadded steps.
"""
from __future__ import annotations

import torch

from .cache_manager import CacheManager, PagedBatch
from .model import Model

SMALL_BUCKETS = (1, 2, 4, 8, 16)
FIELDS = ("ids", "positions", "seq_ids", "pages", "counts")


def buckets(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch`` (always included)."""
    sizes = [b for b in SMALL_BUCKETS if b < max_batch] + list(range(32, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def unavailable_reason(model: Model, device: torch.device) -> str | None:
    """Why decode steps cannot be captured here (None: they can)."""
    if device.type != "cuda":
        return "no CUDA device: decode steps run eagerly"
    if not model.decode_graphs:
        return f"not implemented for {model.config.model_type}: decode steps run eagerly"
    if getattr(model.ops, "name", None) != "kernel" or getattr(model.ops, "check_values", True):
        return "needs kernel mode with value checks off (--skip-checks): decode steps run eagerly"
    obstacle = model.graph_obstacle()
    if obstacle is not None:
        return f"{obstacle}: decode steps run eagerly"
    if model.parallel is not None and model.parallel.world_size > 1:
        return "expert parallel: the MoE exchange reads row counts on the host: decode steps run eagerly"
    return None


class DecodeGraphs:
    """Padded decode steps for up to ``max_batch`` sequences; ``capture=True`` records one CUDA graph per bucket
    (at construction) and replays it, ``capture=False`` runs the same padded batches eagerly. ``sizes``: other
    buckets than :func:`buckets` (e.g. only the batch sizes a benchmark runs)."""

    def __init__(self, model: Model, cache: CacheManager, max_batch: int, capture: bool,
                 sizes: list[int] | None = None):
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = sorted(set(sizes)) if sizes else buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.scratch = {name: s.allocator.allocate(1)[0] for name, s in cache.streams.items()}  # padding rows only
        self.scratch_page = next(iter(self.scratch.values()))  # the primary stream's
        device = cache.device
        self.meta = torch.zeros(len(FIELDS), self.max_batch, dtype=torch.int32, device=device)
        self.host = torch.zeros(len(FIELDS), self.max_batch, dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self.rows = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    @property
    def replays(self) -> bool:
        return self.capture

    def bucket(self, n: int) -> int:
        """The smallest bucket of at least ``n`` sequences."""
        return next(b for b in self.buckets if b >= n)

    def takes(self, step) -> bool:
        """Whether ``step`` (a :class:`.scheduler.Step`) is one token per sequence and fits a bucket."""
        return len(step.chunks) <= self.max_batch and all(n == 1 for _, n in step.chunks)

    def batch(self, b: int) -> PagedBatch:
        """The padded batch of bucket ``b``, derived on the device from the static inputs (graph-safe)."""
        ids, positions, seq_ids, pages, counts = (row[:b] for row in self.meta)
        P = self.cache.page_size
        lens = (positions + 1) * counts
        items = torch.stack([self.rows[:b], counts, pages, positions % P], dim=1)
        tables = self.tables(seq_ids, counts)
        return PagedBatch(
            seq_ids=[], positions=positions, limits=lens, cu_seqlens=self.rows[:b + 1], row_to_seq=self.rows[:b],
            block_table=next(iter(tables.values())), seq_lens=lens, last_rows=self.rows[:b],
            items=items, slots=(pages * P + positions % P).long(), pages=pages.long(),
            fill=(positions % P + counts).long(), num_cols=self.cache.max_pages * P, max_q=1, tables=tables)

    def tables(self, seq_ids: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every stream's block-table rows ``[b, max_pages]`` int32 of ``seq_ids[b]`` (int32), a padding row's
        (``counts`` 0) all the stream's scratch page (graph-safe)."""
        real = counts[:, None] > 0
        return {name: torch.where(real, s.block_table.index_select(0, seq_ids), self.scratch[name])
                for name, s in self.cache.streams.items()}

    def _run(self, b: int) -> torch.Tensor:
        return self.model.forward(self.meta[0, :b], self.batch(b), self.cache)

    def _write(self, columns: list[tuple[int, int, int, int, int]], b: int) -> None:
        """Static inputs for ``columns`` (one per sequence) padded to bucket ``b``: one host-to-device copy."""
        padding = (0, 0, 0, self.scratch_page, 0)
        values = torch.tensor(columns + [padding] * (b - len(columns)), dtype=torch.int32).t()
        self.host[:, :b] = values
        self.meta[:, :b].copy_(self.host[:, :b], non_blocking=True)

    def forward(self, input_ids: list[int], seq_ids: list[int]) -> torch.Tensor:
        """The decode step of ``seq_ids`` (one new token each, ``input_ids``): places the tokens in the cache and
        returns the logits ``[len(seq_ids), vocab]`` fp32."""
        n, P = len(seq_ids), self.cache.page_size
        b = self.bucket(n)
        starts = self.cache.place([(s, 1) for s in seq_ids])
        self._write([(t, pos, s, self.cache.pages(s)[pos // P], 1) for t, pos, s in zip(input_ids, starts, seq_ids)],
                    b)
        if not self.capture:
            return self._run(b)[:n]
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    def _capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool; each warmed up eagerly on padding rows
        only (plans, tuning lookups and weight checks happen then, outside the capture)."""
        pool = None
        for b in reversed(self.buckets):
            self._write([], b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(b)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run(b)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
