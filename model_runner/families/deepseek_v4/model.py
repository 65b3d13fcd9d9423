"""The DeepSeek-V4 model (reference mode exact against transformers' ``DeepseekV4ForCausalLM``; kernel mode: the
projections, compressors, indexer, attention, experts and SwiGLU on dsa_triton's ops; the mHC mixes and norms in
PyTorch):

    x = embed(ids), copied into hc_mult residual streams [T, hc, D]
    per layer: x = attn_hc(x, attention(attn_norm(.)));  x = ffn_hc(x, moe(ffn_norm(.), ids))    (:mod:`.hyper`)
    logits = head(norm(hyper_head(x)))  for each sequence's last token

Attention :mod:`.attention` (sliding window, CSA, HCA), MoE :mod:`.moe`, caches :mod:`.cache`. Multi-token
prediction layers are not run (their tensors are skipped at load).

Kernel-mode decode steps with value checks off read nothing on the host: every size comes from the batch's host
ints (``num_cols``, ``max_q``) and the shapes, so they replay from CUDA graphs (:mod:`model_runner.cuda_graphs`,
whose padded batches fix ``num_cols`` at the cache's capacity: the indexer's and the HCA entries' width). Reference
mode loops over experts on the host and stays eager.
"""
from __future__ import annotations

from functools import partial

import torch

from ...cache_manager import CacheManager, PagedBatch
from ...errors import RunnerError
from ...model import fp32_output_gemm, logits
from ...rope import Rotary
from .attention import Attention
from .config import DeepseekV4Config
from .hyper import HyperConnection, HyperHead
from .moe import MoE
from .norms import rms_norm

INDEX_PRECISIONS = ("activation",)  # the indexer scores in the activation dtype, as transformers does


class Model:
    """Weights from :func:`.weights.load_weights`; ``ops`` a backend of :mod:`model_runner.ops`.
    ``index_precision`` "activation" only; no indexer path choice, no expert parallel (``parallel`` None)."""
    decode_graphs = True  # decode steps can replay from CUDA graphs (:mod:`model_runner.cuda_graphs`)

    def __init__(self, config: DeepseekV4Config, weights: dict, ops, index_precision: str = "activation",
                 indexer_path: dict[str, str] | None = None, parallel=None):
        if index_precision not in INDEX_PRECISIONS:
            raise RunnerError(f"index_precision: deepseek_v4 implements {INDEX_PRECISIONS}, got {index_precision!r}")
        if indexer_path and set(indexer_path.values()) != {"token"}:
            raise RunnerError(f"indexer_path: deepseek_v4 has the token path only, got {indexer_path}")
        if parallel is not None and parallel.world_size > 1:
            raise RunnerError("parallel: expert parallel is not implemented for deepseek_v4 (one process)")
        c = self.config = config
        self.ops, self.index_precision, self.parallel = ops, index_precision, None
        self.embed, self.norm, self.lm_head = (weights[n] for n in ("model.embed_tokens.weight", "model.norm.weight",
                                                                     "head.weight"))
        device = self.embed.device
        self.rotary = {"main": Rotary(c.rope, c.qk_rope_head_dim, device),
                       "compress": Rotary(c.compress_rope, c.qk_rope_head_dim, device)}
        self.fp32_logits = fp32_output_gemm(self.lm_head)
        self._entry_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.head_mix = HyperHead(weights, "model.hc_head.", c.hc_eps, c.rms_norm_eps)
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            hyper = [HyperConnection(weights, f"{p}hc_{site}_", c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps,
                                     c.rms_norm_eps) for site in ("attn", "ffn")]
            self.layers.append((hyper[0], weights[p + "attn_norm.weight"], Attention(c, weights, p + "attn.", i),
                                hyper[1], weights[p + "ffn_norm.weight"], MoE(c, weights, p + "ffn.", i)))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @staticmethod
    def graph_obstacle() -> None:
        """Nothing keeps kernel-mode decode steps (value checks off) out of a CUDA graph."""
        return None

    def rope_tables(self, kind: str, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin ``[n, rope / 2]`` of ``positions`` for the ``kind`` RoPE ("main" or "compress"), in ``dtype``."""
        return tuple(t.to(dtype) for t in self.rotary[kind].tables(positions))

    def entry_tables(self, max_len: int, dtype: torch.dtype, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[max_len // ratio + 1, rope / 2]`` in ``dtype``: row ``w`` the compress RoPE at position
        ``w x ratio``, where entry ``w``'s window starts (made once per ratio, length and dtype)."""
        key = (max_len, dtype, ratio)
        if key not in self._entry_tables:
            positions = torch.arange(max_len // ratio + 1, device=self.embed.device) * ratio
            self._entry_tables[key] = self.rope_tables("compress", positions, dtype)
        return self._entry_tables[key]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: PagedBatch, cache: CacheManager) -> torch.Tensor:
        """``input_ids[T]`` (packed as ``batch``) -> fp32 logits ``[B, vocab]`` of each sequence's last token."""
        c, dtype, P = self.config, self.dtype, cache.page_size
        tables = {kind: self.rope_tables(kind, batch.positions, dtype) for kind in self.rotary}
        tables["entries"] = partial(self.entry_tables, cache.max_pages * P, dtype)  # ratio -> compressed entries'
        x = self.embed[input_ids].unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        for (attn_hc, attn_norm, attn, ffn_hc, ffn_norm, moe), storage in zip(self.layers, cache.layers):
            x = attn_hc(x, lambda h: attn(rms_norm(h, attn_norm, c.rms_norm_eps), tables, batch, storage, P,
                                          self.ops))
            x = ffn_hc(x, lambda h: moe(rms_norm(h, ffn_norm, c.rms_norm_eps), input_ids, self.ops))
        last = rms_norm(self.head_mix(x[batch.last_rows]), self.norm, c.rms_norm_eps)
        return logits(last, self.lm_head, self.fp32_logits)

    @staticmethod
    def workspace(tokens_per_step: int) -> dict[str, int]:
        """No workspace beyond the layout's (the experts take the fused MXFP4 GEMMs, not the FP8 workspace)."""
        return {}

    def idle(self) -> None:
        """A step with no tokens on this rank: nothing to join (no expert parallel)."""
