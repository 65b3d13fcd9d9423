"""A DeepSeek-V3.2-style decoder on the dsa_triton ops (or their references: :mod:`.ops`).

One layer, for the ``T`` new tokens of a step (:class:`.cache_manager.PagedBatch`):

    x -> RMSNorm -> MLA: q_lora latent -> q = [q_nope | q_pe] per head; one latent row [RMSNorm(c_kv) | RoPE(k_pe)]
         per token into the paged latent cache (MQA form)
      -> indexer: q from the q_lora latent, k = LayerNorm(wk(x)), NeoX RoPE on the first rope dims, FP8 with one
         power-of-two scale per vector; keys into the paged FP8 indexer cache (same append as the latent row)
      -> indexer logits over each token's causal prefix -> top-k positions -> physical slots (block table)
      -> sparse attention with the absorbed query [q_nope @ W_uk (kv_lora) | RoPE(q_pe)]; values are the first
         kv_lora dims of the rows; out @ W_uv -> o_proj
    x -> RMSNorm -> dense SwiGLU MLP (first layers) or the MoE layer (DeepSeek routing + shared expert)

Prefill attends causally within the top-k (all of the prefix while it is shorter than ``index_topk``).
The indexer's Hadamard rotation is left out (a fixed orthogonal map of q and k; it changes FP8 rounding only);
the latent cache holds activation-dtype rows (no FP8 latent cache); the indexer is token level (not the block path).
MLA RoPE is interleaved (DeepSeek's reference code), the indexer's NeoX (FACTS.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dsa_triton as dt
from dsa_triton.moe.layer import shared_expert

from .cache_manager import PagedBatch
from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """Rotate ``x[T, ..., d]`` by ``positions[T]``: pairs (2i, 2i+1) when ``interleaved``, else (i, i + d/2)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = (positions.float()[:, None] * freqs).view(x.shape[0], *([1] * (x.dim() - 2)), d // 2)
    cos, sin = angle.cos(), angle.sin()
    xf = x.float()
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., : d // 2], xf[..., d // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = torch.stack([ra, rb], dim=-1).flatten(-2) if interleaved else torch.cat([ra, rb], dim=-1)
    return out.to(x.dtype)


class Indexer:
    """DSA lightning indexer: FP8 queries and head weights of the new tokens, and their keys."""

    def __init__(self, c: ModelConfig, w: dict, prefix: str):
        self.c = c
        self.wq_b, self.wk = w[prefix + "wq_b.weight"], w[prefix + "wk.weight"]
        self.k_norm = (w[prefix + "k_norm.weight"], w[prefix + "k_norm.bias"])
        self.weights_proj = w[prefix + "weights_proj.weight"]

    def __call__(self, x, q_latent, positions):
        """-> ``(q8 [T, IH, ID] e4m3, weights [T, IH] fp32 with the q scales folded in, k [T, ID])``."""
        c, T = self.c, x.shape[0]
        r = c.qk_rope_head_dim
        q = F.linear(q_latent, self.wq_b).view(T, c.index_n_heads, c.index_head_dim)
        q = torch.cat([rope(q[..., :r], positions, c.rope_theta, False), q[..., r:]], dim=-1)
        k = F.layer_norm(F.linear(x, self.wk).float(), (c.index_head_dim,), *(t.float() for t in self.k_norm),
                         eps=1e-6).to(x.dtype)
        k = torch.cat([rope(k[:, :r], positions, c.rope_theta, False), k[:, r:]], dim=-1)
        q8, q_scale = dt.fp8_quantize_rows(q)
        head_weights = F.linear(x, self.weights_proj).float() * (c.index_n_heads * c.index_head_dim) ** -0.5
        return q8, head_weights * q_scale, k


class Attention:
    """MLA in the absorbed MQA form over the paged latent cache, with DSA top-k selection."""

    def __init__(self, c: ModelConfig, w: dict, prefix: str):
        self.c = c
        take = lambda name: w[prefix + name + ".weight"]  # noqa: E731
        self.q_a, self.q_a_norm, self.q_b = take("q_a_proj"), take("q_a_layernorm"), take("q_b_proj")
        self.kv_a, self.kv_a_norm, self.o_proj = take("kv_a_proj_with_mqa"), take("kv_a_layernorm"), take("o_proj")
        kv_b = take("kv_b_proj").view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk, self.w_uv = kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim:]  # [H, nope | v, kv_lora]
        self.indexer = Indexer(c, w, prefix + "indexer.")
        self.sm_scale = c.qk_head_dim ** -0.5

    def __call__(self, x, batch: PagedBatch, cache: dt.PagedCache, ops) -> torch.Tensor:
        c, T, pos = self.c, x.shape[0], batch.positions
        q_latent = rms_norm(F.linear(x, self.q_a), self.q_a_norm, c.rms_norm_eps)
        q = F.linear(q_latent, self.q_b).view(T, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = F.linear(x, self.kv_a)
        latent = rms_norm(kv[:, : c.kv_lora_rank], self.kv_a_norm, c.rms_norm_eps)
        rows = torch.cat([latent, rope(kv[:, c.kv_lora_rank:], pos, c.rope_theta, True)], dim=-1)
        index_q, index_w, index_k = self.indexer(x, q_latent, pos)

        ops.append(cache, rows, index_k, batch)
        scores = ops.indexer_logits(index_q, index_w, cache, batch)
        slots = ops.topk(scores, c.index_topk, cache.page_size, batch)
        q_abs = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        q_mqa = torch.cat([q_abs, rope(q_pe, pos, c.rope_theta, True)], dim=-1)  # [T, H, kv_lora + rope]
        out = ops.attention(q_mqa, cache.kv, slots, self.sm_scale, c.kv_lora_rank, batch.decode)
        return F.linear(torch.einsum("thc,hvc->thv", out, self.w_uv).flatten(1), self.o_proj)


class DenseMLP:
    def __init__(self, w: dict, prefix: str):
        self.gate_up = torch.cat([w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]])
        self.down = w[prefix + "down_proj.weight"]

    def __call__(self, x, ops) -> torch.Tensor:
        return shared_expert(x, self.gate_up, self.down)


class MoE:
    """Routed MXFP4 experts (DeepSeek sigmoid routing with correction bias and groups) plus the shared expert."""

    def __init__(self, c: ModelConfig, w: dict, prefix: str):
        e = prefix + "experts."
        self.experts = [w[e + name] for name in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")]
        self.router, self.bias = w[prefix + "gate.weight"], w[prefix + "gate.e_score_correction_bias"]
        self.shared = DenseMLP(w, prefix + "shared_experts.")
        self.routing = dt.RoutingConfig("deepseek", top_k=c.num_experts_per_tok, n_group=c.n_group,
                                        topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                                        routed_scaling_factor=c.routed_scaling_factor)

    def __call__(self, x, ops) -> torch.Tensor:
        return ops.moe(x, self.router, *self.experts, routing=self.routing, router_bias=self.bias,
                       shared_gate_up=self.shared.gate_up, shared_down=self.shared.down)


class Model:
    """Weights from :func:`.loader.load_checkpoint`; ``ops`` a backend of :mod:`.ops`."""

    def __init__(self, config: ModelConfig, weights: dict, ops):
        self.config, self.ops = config, ops
        self.embed, self.norm, self.lm_head = (weights[n] for n in ("model.embed_tokens.weight", "model.norm.weight",
                                                                     "lm_head.weight"))
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            mlp = MoE(config, weights, p + "mlp.") if config.is_moe_layer(i) else DenseMLP(weights, p + "mlp.")
            self.layers.append((weights[p + "input_layernorm.weight"], Attention(config, weights, p + "self_attn."),
                                weights[p + "post_attention_layernorm.weight"], mlp))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: PagedBatch, caches: list[dt.PagedCache]) -> torch.Tensor:
        """``input_ids[T]`` (packed as ``batch``) -> fp32 logits ``[B, vocab]`` of each sequence's last token."""
        eps = self.config.rms_norm_eps
        x = self.embed[input_ids]
        for (attn_norm, attn, mlp_norm, mlp), cache in zip(self.layers, caches):
            x = x + attn(rms_norm(x, attn_norm, eps), batch, cache, self.ops)
            x = x + mlp(rms_norm(x, mlp_norm, eps), self.ops)
        return F.linear(rms_norm(x[batch.last_rows], self.norm, eps).float(), self.lm_head.float())
