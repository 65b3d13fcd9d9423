"""The per-sequence caches DeepSeek-V4's layers declare (a :class:`model_runner.cache_manager.CacheManager` layout),
all paged, freed and recomputed together on preemption:

- stream "window" (an entry a token, the last ``keep`` read back): each layer's K=V row of the token (``kv [hd]``,
  normed and rotated: the sliding-window branch), and in CSA / HCA layers the compressors' inputs of the token
  (``comp_kv``, ``comp_gate`` ``[c hd]``; CSA also its indexer's ``idx_kv``, ``idx_gate`` ``[2 ID]``): the
  compressors' carry-over state is the inputs of the tokens since the last full window (and, with CSA's overlap, the
  window before), read back from here when a window closes. ``keep`` = the most any layer reads back:
  ``sliding_window - 1`` tokens for the window, ``2m - 1`` for CSA's compressor, ``m' - 1`` for HCA's;
- stream "csa" (an entry per ``compress_rates`` CSA tokens, all kept): CSA layers' compressed entries
  (``entries [hd]``, normed and rotated) and the indexer's compressed keys (``index_keys [ID]``);
- stream "hca" (an entry per HCA rate tokens, all kept): HCA layers' compressed entries (``entries [hd]``).

Each layer's storage is a dict of those names to ``[pages x P, width]`` tensors in the activation dtype (row =
physical slot ``page x P + offset``; viewed as pages ``[pages, P, width]`` by the ops). A sequence's entry ``j`` of a
stream is at ``block_table[j // P] * P + j % P``.
"""
from __future__ import annotations

import torch

from dsa_triton.hostmath import cdiv

from ...errors import RunnerError
from ...paging import LayerCost, Stream
from .config import CSA, HCA, SLIDING, DeepseekV4Config


def layout(config: DeepseekV4Config, *, index_precision: str, kv_cache: str, step_tokens: int) -> "DeepseekV4Layout":
    """The family interface's ``cache_layout``: rows in the activation dtype only."""
    if kv_cache != "activation":
        raise RunnerError(f"kv_cache: deepseek_v4 keeps its caches in the activation dtype, got {kv_cache!r}")
    return DeepseekV4Layout(config, step_tokens)


class DeepseekV4Layout:
    """The caches of ``config``'s layers; ``step_tokens``: the most tokens a step runs (sizes the window's pages)."""

    def __init__(self, config: DeepseekV4Config, step_tokens: int):
        self.config, self.step_tokens = config, step_tokens
        types = set(config.layer_types)
        self.keep = max([config.sliding_window - 1] + [2 * config.csa_rate - 1] * (CSA in types)
                        + [config.hca_rate - 1] * (HCA in types))
        self.streams = {"window": Stream(1, self.keep)}
        if CSA in types:
            self.streams["csa"] = Stream(config.csa_rate)
        if HCA in types:
            self.streams["hca"] = Stream(config.hca_rate)
        self.layers: list[dict[str, torch.Tensor]] = []

    def page_counts(self, num_pages: int, page_size: int, max_seqs: int, max_seq_len: int) -> dict[str, int]:
        """``num_pages`` pages of tokens bound the compressed streams; the window holds, per sequence, the pages of
        ``keep`` tokens and of its chunk (at most ``num_pages``)."""
        P = page_size
        counts = {"window": min(num_pages, max_seqs * (cdiv(self.keep, P) + 3) + cdiv(self.step_tokens, P))}
        for name in ("csa", "hca"):
            if name in self.streams:
                counts[name] = cdiv(num_pages * P // self.streams[name].rate, P) + max_seqs
        return counts

    def widths(self, layer: int) -> dict[str, tuple[str, int]]:
        """``{array: (stream, width)}`` of ``layer``'s storage."""
        c, kind = self.config, self.config.layer_types[layer]
        out = {"kv": ("window", c.head_dim)}
        if kind != SLIDING:
            width = (2 if kind == CSA else 1) * c.head_dim
            out.update(comp_kv=("window", width), comp_gate=("window", width),
                       entries=("csa" if kind == CSA else "hca", c.head_dim))
        if kind == CSA:
            out.update(idx_kv=("window", 2 * c.index_head_dim), idx_gate=("window", 2 * c.index_head_dim),
                       index_keys=("csa", c.index_head_dim))
        return out

    def allocate(self, pages: dict[str, int], page_size: int, dtype: torch.dtype, device,
                 poison: bool) -> list[dict[str, torch.Tensor]]:
        fill = float("nan") if poison else 0.0
        self.layers = [{name: torch.full((pages[stream] * page_size, width), fill, dtype=dtype, device=device)
                        for name, (stream, width) in self.widths(i).items()}
                       for i in range(self.config.num_hidden_layers)]
        return self.layers

    def costs(self, dtype: torch.dtype, page_size: int) -> list[LayerCost]:
        """Per layer type: the window (``keep`` + 1 tokens' rows a sequence, whatever its length) and the
        compressed entries (``width / rate`` a token)."""
        size, out = torch.tensor([], dtype=dtype).element_size(), []
        for kind in (SLIDING, CSA, HCA):
            layers = [i for i, t in enumerate(self.config.layer_types) if t == kind]
            if not layers:
                continue
            widths = self.widths(layers[0])
            window = sum(w for stream, w in widths.values() if stream == "window")
            per_token = sum(w / self.streams[stream].rate for stream, w in widths.values() if stream != "window")
            what = f"window {self.keep + 1} tokens x {window} values" + (
                f", compressed {per_token * self.streams['csa' if kind == CSA else 'hca'].rate:.0f} values per "
                f"{self.config.compress_rate(layers[0])} tokens" if kind != SLIDING else "")
            out.append(LayerCost(kind, len(layers), (self.keep + 1) * window * size, per_token * size, what))
        return out

    def workspace(self, tokens_per_step: int, max_seq_len: int) -> dict[str, int]:
        """The CSA indexer's scores of a step: ``tokens_per_step x max_seq_len / m`` fp32 (none without CSA)."""
        if "csa" not in self.streams:
            return {}
        return {"workspace: indexer scores of a step": tokens_per_step * (max_seq_len // self.config.csa_rate) * 4}

    def bytes_per_token(self, layer: int = 0) -> dict[str, float]:
        """Bytes a token takes in ``layer`` by stream: the compressed streams' ``width x dtype / rate`` (the window's
        cost is per sequence: :meth:`costs`)."""
        return {stream: sum(self.layers[layer][name].element_size() * width / self.streams[stream].rate
                            for name, (s, width) in self.widths(layer).items() if s == stream)
                for stream in {s for s, _ in self.widths(layer).values()} - {"window"}}

    def nbytes(self) -> dict[str, int]:
        """Bytes of each stream's storage, all layers; each line names what it keeps."""
        totals: dict[str, int] = {}
        for storage, i in zip(self.layers, range(len(self.layers))):
            for name, (stream, _) in self.widths(i).items():
                totals[stream] = totals.get(stream, 0) + storage[name].numel() * storage[name].element_size()
        what = {"window": f"window: the last {self.keep} tokens' K=V rows and compressor inputs",
                "csa": f"CSA compressed entries and indexer keys (one per {self.config.csa_rate} tokens)",
                "hca": f"HCA compressed entries (one per {self.config.hca_rate} tokens)"}
        return {f"cache {what[s]}": n for s, n in totals.items()}
