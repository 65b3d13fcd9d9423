"""The per-layer caches of the MLA + DSA families (DeepSeek-V3.2, GLM-5): one stream of one entry a token, and per
layer a ``dt.PagedCache`` (latent rows ``kv[num_pages, P, kv_lora + rope]``, FP8 indexer keys, key scales and page
summaries; its own one-row block table is not used). ``kv_cache="fp8"`` keeps the latent rows in DeepSeek's FP8
layout (656 bytes a token for 512 + 64: e4m3 latent values, one fp32 scale per 128, bf16 rope values), quantized by
the append op and dequantized inside the attention kernels. With the indexer in the activation dtype
(``index_precision="activation"``) a layer's indexer keys are kept unrounded in ``index_keys[layer]``
``[num_pages * P, index_head_dim]`` instead of the FP8 indexer cache. A layer that runs no indexer (GLM-5's
"shared" layers) keeps latent rows only.
"""
from __future__ import annotations

import torch

import dsa_triton as dt

from .config import ModelConfig
from .errors import RunnerError
from .paging import LayerCost, Stream

KV_CACHE_FORMATS = ("activation", "fp8")  # latent cache rows in the activation dtype, or the FP8 layout


def latent_layout(config: ModelConfig, *, index_precision: str, kv_cache: str, step_tokens: int) -> "LatentLayout":
    """The family interface's ``cache_layout`` (``step_tokens`` does not size these caches)."""
    return LatentLayout(config, index_precision, kv_cache)


class LatentLayout:
    """The caches an MLA + DSA model's layers declare (:class:`.cache_manager.CacheManager`'s layout)."""
    streams = {"tokens": Stream()}

    def __init__(self, config: ModelConfig, index_precision: str = "fp8", kv_cache: str = "activation"):
        if kv_cache not in KV_CACHE_FORMATS:
            raise RunnerError(f"kv_cache: must be one of {KV_CACHE_FORMATS}, got {kv_cache!r}")
        self.config, self.fp8_index, self.kv_cache = config, index_precision == "fp8", kv_cache
        self.layers: list[dt.PagedCache] = []
        self.index_keys: list[torch.Tensor | None] = []

    @staticmethod
    def page_counts(num_pages: int, page_size: int, max_seqs: int, max_seq_len: int) -> dict[str, int]:
        return {"tokens": num_pages}

    def allocate(self, pages: dict[str, int], page_size: int, dtype: torch.dtype, device,
                 poison: bool) -> list[dt.PagedCache]:
        """The layers' storage for ``pages["tokens"]`` pages (``poison``: unwritten slots NaN)."""
        c, num_pages = self.config, pages["tokens"]
        self.layers = [dt.PagedCache(num_pages, page_size, 1, 1, c.latent_dim,
                                     c.index_head_dim if self.fp8_index and c.runs_indexer(i) else 0, dtype, device,
                                     poison=poison, kv_dtype="fp8" if self.kv_cache == "fp8" else None,
                                     rope_dim=c.qk_rope_head_dim)
                       for i in range(c.num_hidden_layers)]
        fill = float("nan") if poison else 0.0
        self.index_keys = [None if self.fp8_index or not c.runs_indexer(i) else
                           torch.full((num_pages * page_size, c.index_head_dim), fill, dtype=dtype, device=device)
                           for i in range(c.num_hidden_layers)]
        return self.layers

    def costs(self, dtype: torch.dtype, page_size: int) -> list[LayerCost]:
        """Per layer kind (with its indexer cache, without: GLM-5's shared layers) the bytes a token takes: latent
        row, indexer key and scale (or activation key), page summaries per ``page_size`` tokens."""
        c, out = self.config, []
        for runs in (True, False):
            layers = sum(c.runs_indexer(i) == runs for i in range(c.num_hidden_layers))
            if not layers:
                continue
            index = c.index_head_dim if self.fp8_index and runs else 0
            page = dt.PagedCache(1, page_size, 1, 1, c.latent_dim, index, dtype, "cpu",
                                 kv_dtype="fp8" if self.kv_cache == "fp8" else None, rope_dim=c.qk_rope_head_dim)
            size = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
            keys = c.index_head_dim * torch.tensor([], dtype=dtype).element_size() if runs and not self.fp8_index \
                else 0
            what = (f"latent rows ({self.kv_cache})" + (", indexer keys" if runs else "")
                    + (" (fp8, + page summaries)" if index else " (activation)" if keys else ""))
            out.append(LayerCost("MLA + indexer" if runs else "MLA, shared top-k", layers, 0,
                                 size(page.kv, page.ik, page.ik_scale, page.summaries) / page_size + keys, what))
        return out

    def workspace(self, tokens_per_step: int, max_seq_len: int) -> dict[str, int]:
        """The indexer logits of a step: ``tokens_per_step x max_seq_len`` fp32."""
        return {"workspace: indexer logits of a step": tokens_per_step * max_seq_len * 4}

    def bytes_per_token(self, layer: int = 0) -> dict[str, int]:
        """Bytes one token takes in ``layer``: ``{"kv cache": its latent row (1152 in bf16, 656 in FP8 for
        DeepSeek-V3.2), "indexer cache": its key and scale (132), or its activation-dtype key, or 0 in a layer that
        runs no indexer}`` (the indexer's page summaries come on top, per page)."""
        cache, keys = self.layers[layer], self.index_keys[layer]
        kv = cache.kv.shape[-1] * cache.kv.element_size()
        return {"kv cache": kv,
                "indexer cache": cache.bytes_per_token - kv if keys is None else keys.shape[-1] * keys.element_size()}

    def nbytes(self) -> dict[str, int]:
        """Bytes of the latent KV cache and of the indexer caches (keys, scales, page summaries), all layers; each
        line names the format and the bytes a token takes in every layer together."""
        size = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
        index = sum(size(c.ik, c.ik_scale, c.summaries) for c in self.layers) + size(*self.index_keys)
        per_token = {k: sum(self.bytes_per_token(i)[k] for i in range(len(self.layers)))
                     for k in ("kv cache", "indexer cache")}
        index_format = "fp8, + page summaries" if all(k is None for k in self.index_keys) else "activation"
        return {f"kv cache ({self.kv_cache}, {per_token['kv cache']} B a token)": sum(size(c.kv) for c in self.layers),
                f"indexer cache ({per_token['indexer cache']} B a token, {index_format})": index}
