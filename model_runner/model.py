"""The layer blocks of the MLA + DSA families (:mod:`.families`): a DeepSeek-V3.2 decoder on the dsa_triton ops (or
their references: :mod:`.ops`), following Hugging Face's ``DeepseekV32ForCausalLM`` and DeepSeek's inference code,
and GLM-5 (``GlmMoeDsaForCausalLM``): the indexer's RoPE on interleaved pairs, and "shared" layers
(``config.runs_indexer``) that attend over the top-k of the last layer that ran its indexer.

One layer, for the ``T`` new tokens of a step (:class:`.cache_manager.PagedBatch`):

    x -> RMSNorm -> MLA: q_lora latent -> q = [q_nope | q_pe] per head; one latent row [RMSNorm(c_kv) | RoPE(k_pe)]
         per token into the paged latent cache (MQA form)
      -> indexer: q from the q_lora latent, k = LayerNorm(wk(x)), RoPE on the first rope dims (NeoX halves in V3.2,
         interleaved pairs in GLM-5: ``config.index_rope_interleaved``); scores
         sum_h w[t, h] relu(q[t, h] . k[s]) / sqrt(index_head_dim) over each token's causal prefix, in one of two
         precisions (``index_precision``):
         "fp8": DeepSeek's inference code: q and k rotated by the normalized Hadamard matrix, then e4m3 with one
                power-of-two scale per vector (keys in the paged FP8 indexer cache; dsa_triton's indexer op);
         "activation": Hugging Face's: no rotation (it is orthogonal: it changes only the FP8 rounding) and no
                rounding; keys kept in the activation dtype, scores in PyTorch (a dense [T, L] comparison mode);
      -> top-k positions -> physical slots (block table); per phase either over every cached position (token
         level) or inside the best pages by their summaries' bound (block level, FP8 indexer only: :mod:`.index_path`)
      -> sparse attention with the absorbed query [q_nope @ W_uk (kv_lora) | RoPE(q_pe)]; values are the first
         kv_lora dims of the rows; out @ W_uv -> o_proj. Softmax scale qk_head_dim^-0.5 times YaRN's mscale^2.
    x -> RMSNorm -> dense SwiGLU MLP ("dense" layers) or the MoE layer (DeepSeek routing) plus its shared expert

Prefill attends causally within the top-k (all of the prefix while it is shorter than ``index_topk``). Projections
run through ``ops.linear`` (blockwise-FP8 weights on the FP8 GEMM); ``kv_b_proj`` is dense (absorbed per head).
The latent cache holds activation-dtype rows or DeepSeek's FP8 rows (``kv_cache``: :mod:`.cache_manager`); the indexer
takes the token-level or the block-level path per phase (:mod:`.index_path`). The logits come from one GEMM on
``lm_head`` as stored, with fp32 output where the device has it (CUDA), else in the activation dtype (no fp32 copy of
``lm_head``).
q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever ``rms_norm_eps`` says (as Hugging Face and DeepSeek do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dsa_triton as dt
from dsa_triton import registry

from .cache_manager import CacheManager, PagedBatch
from .config import ModelConfig
from .index_path import PathChoice, pages_to_select
from .rope import Rotary

INDEX_PRECISIONS = ("fp8", "activation")
LATENT_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight.to(x.dtype) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester-Hadamard matrix times ``n^-0.5`` (orthonormal, symmetric): DeepSeek's
    ``rotate_activation`` is ``x @ hadamard(n)``."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h * n ** -0.5


def activation_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, batch: PagedBatch,
                            page_size: int, scale: float) -> torch.Tensor:
    """Hugging Face's indexer scores ``[T, L]`` fp32 from unrounded ``q[T, IH, ID]``, ``weights[T, IH]`` fp32 and
    the paged ``keys[num_pages * P, ID]``: ``sum_h w relu(q . k * scale)``, ``-inf`` outside ``[0, limits[t])``."""
    L = batch.num_cols
    pos = torch.arange(L, device=q.device)
    out = torch.empty(q.shape[0], L, dtype=torch.float32, device=q.device)
    cu = batch.cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        pages = batch.block_table[b, pos // page_size].long()
        k = keys[(pages * page_size + pos % page_size).clamp_min(0)].float()  # [L, ID]
        scores = F.relu(torch.matmul(q[cu[b]:cu[b + 1]].float(), k.t()) * scale)  # [T_b, IH, L]
        out[cu[b]:cu[b + 1]] = torch.matmul(weights[cu[b]:cu[b + 1], None, :], scores).squeeze(1)
    return out.masked_fill(pos >= batch.limits[:, None], float("-inf"))


def fp32_output_gemm(weight: torch.Tensor) -> bool:
    """Whether ``torch.mm(x, weight.t(), out_dtype=torch.float32)`` runs here (CUDA; not on the CPU)."""
    if weight.dtype == torch.float32:
        return False
    try:
        torch.mm(weight[:1], weight[:1].t(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def logits(x: torch.Tensor, lm_head: torch.Tensor, fp32_output: bool) -> torch.Tensor:
    """``x[B, D] @ lm_head[V, D].T`` as fp32 ``[B, V]``: one GEMM on the weight as stored (fp32 accumulation)."""
    if fp32_output:
        return torch.mm(x, lm_head.t(), out_dtype=torch.float32)
    return F.linear(x, lm_head).float()


class Indexer:
    """DSA lightning indexer: the top-k cache slots of each new token."""

    def __init__(self, c: ModelConfig, w: dict, prefix: str, precision: str, path: PathChoice):
        self.c, self.precision, self.path = c, precision, path
        self.wq_b, self.wk = w[prefix + "wq_b.weight"], w[prefix + "wk.weight"]
        self.k_norm = (w[prefix + "k_norm.weight"], w[prefix + "k_norm.bias"])
        self.weights_proj = w[prefix + "weights_proj.weight"]  # fp32
        self.rotation = hadamard(c.index_head_dim).to(self.weights_proj.device) if precision == "fp8" else None

    def project(self, x, q_latent, tables, ops):
        """-> ``q [T, IH, ID]``, ``k [T, ID]`` (activation dtype, RoPE applied), ``w [T, IH]`` fp32 (times IH^-0.5)."""
        c, T, r = self.c, x.shape[0], self.c.qk_rope_head_dim
        q = ops.linear(q_latent, self.wq_b).view(T, c.index_n_heads, c.index_head_dim)
        interleaved = c.index_rope_interleaved
        q = torch.cat([Rotary.apply(q[..., :r], tables, interleaved), q[..., r:]], dim=-1)
        k = F.layer_norm(ops.linear(x, self.wk).float(), (c.index_head_dim,), *(t.float() for t in self.k_norm),
                         eps=1e-6).to(x.dtype)
        k = torch.cat([Rotary.apply(k[:, :r], tables, interleaved), k[:, r:]], dim=-1)
        return q, k, F.linear(x.float(), self.weights_proj) * c.index_n_heads ** -0.5

    def select(self, x, q_latent, tables, rows, batch: PagedBatch, cache: dt.PagedCache, index_keys, ops):
        """Append this step's latent ``rows`` and indexer keys to the caches; -> top-k slots ``[T, index_topk]``."""
        q, k, w = self.project(x, q_latent, tables, ops)
        scale = self.c.index_head_dim ** -0.5
        if self.precision == "fp8":
            rotate = lambda t: (t.float() @ self.rotation).to(t.dtype)  # noqa: E731
            q8, q_scale = dt.fp8_quantize_rows(rotate(q))
            ops.append(cache, rows, rotate(k), batch)
            c, P = self.c, cache.page_size
            if self.path(batch, P, c.index_topk, c.index_n_heads, c.index_head_dim, q.device) == "block":
                return ops.block_topk(q8, w * scale * q_scale, cache, batch, c.index_topk,
                                      pages_to_select(c.index_topk, P))
            scores = ops.indexer_logits(q8, w * scale * q_scale, cache, batch)
        else:
            ops.append(cache, rows, None, batch)
            index_keys[batch.slots] = k
            scores = activation_index_scores(q, w, index_keys, batch, cache.page_size, scale)
        return ops.topk(scores, self.c.index_topk, cache.page_size, batch)


class Attention:
    """MLA in the absorbed MQA form over the paged latent cache, with DSA top-k selection (``indexer`` None: the
    layer attends over the slots of the last layer that ran one)."""

    def __init__(self, c: ModelConfig, w: dict, prefix: str, index_precision: str, index_path: PathChoice,
                 indexer: bool = True):
        self.c = c
        take = lambda name: w[prefix + name + ".weight"]  # noqa: E731
        bias = lambda name: w.get(prefix + name + ".bias")  # noqa: E731
        self.q_a, self.q_a_norm, self.q_b = take("q_a_proj"), take("q_a_layernorm"), take("q_b_proj")
        self.kv_a, self.kv_a_norm, self.o_proj = take("kv_a_proj_with_mqa"), take("kv_a_layernorm"), take("o_proj")
        self.q_a_bias, self.kv_a_bias, self.o_bias = bias("q_a_proj"), bias("kv_a_proj_with_mqa"), bias("o_proj")
        kv_b = take("kv_b_proj").view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk, self.w_uv = kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim:]  # [H, nope | v, kv_lora]
        self.indexer = Indexer(c, w, prefix + "indexer.", index_precision, index_path) if indexer else None

    def __call__(self, x, tables, batch: PagedBatch, cache: dt.PagedCache, index_keys, slots,
                 ops) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the layer's output ``[T, D]`` and the top-k slots it attended over (``slots``: the last layer's)."""
        c, T = self.c, x.shape[0]
        q_latent = rms_norm(ops.linear(x, self.q_a, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS)
        q = ops.linear(q_latent, self.q_b).view(T, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = ops.linear(x, self.kv_a, self.kv_a_bias)
        latent = rms_norm(kv[:, : c.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        rows = torch.cat([latent, Rotary.apply(kv[:, c.kv_lora_rank:], tables, True)], dim=-1)
        if self.indexer is None:
            ops.append(cache, rows, None, batch)
        else:
            slots = self.indexer.select(x, q_latent, tables, rows, batch, cache, index_keys, ops)
        q_abs = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        q_mqa = torch.cat([q_abs, Rotary.apply(q_pe, tables, True)], dim=-1)  # [T, H, kv_lora + rope]
        out = ops.attention(q_mqa, cache.kv, slots, c.softmax_scale, c.kv_lora_rank, batch.decode)
        return ops.linear(torch.einsum("thc,hvc->thv", out, self.w_uv).flatten(1), self.o_proj, self.o_bias), slots


class DenseMLP:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; gate and up are one GEMM when both are dense tensors."""

    def __init__(self, w: dict, prefix: str):
        gate, up = w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]
        self.gate_up = [torch.cat([gate, up])] if isinstance(gate, torch.Tensor) else [gate, up]
        self.down = w[prefix + "down_proj.weight"]

    def __call__(self, x, ops) -> torch.Tensor:
        parts = [ops.linear(x, w) for w in self.gate_up]
        return ops.linear(ops.swiglu(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)), self.down)


class MoE:
    """Routed MXFP4 experts (DeepSeek sigmoid routing with correction bias and groups) plus the shared expert;
    ``parallel``: the expert-parallel group (:class:`.distributed.Parallel`; this rank holds only its experts) or
    None (every expert here)."""

    def __init__(self, c: ModelConfig, w: dict, prefix: str, parallel=None):
        e = prefix + "experts."
        self.experts = [w[e + name] for name in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")]
        self.router, self.bias = w[prefix + "gate.weight"], w[prefix + "gate.e_score_correction_bias"]
        self.shared = DenseMLP(w, prefix + "shared_experts.")
        self.routing = dt.RoutingConfig("deepseek", top_k=c.num_experts_per_tok, n_group=c.n_group,
                                        topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                                        routed_scaling_factor=c.routed_scaling_factor)
        self.parallel = parallel

    def routed(self, x, ops) -> torch.Tensor:
        """The routed experts' output ``[T, H]`` in ``x``'s dtype for ``x[T, H]`` (``T`` may be 0 in a group)."""
        if self.parallel is not None:  # this rank holds only its experts: rows go to their experts' ranks and back
            return self.parallel.moe(x, self, ops)
        return ops.moe(x, self.router, *self.experts, routing=self.routing, router_bias=self.bias)

    def __call__(self, x, ops) -> torch.Tensor:
        return self.routed(x, ops) + self.shared(x, ops)


class Model:
    """Weights from :func:`.families.mla_dsa.load_weights`; ``ops`` a backend of :mod:`.ops`; ``index_precision``
    one of :data:`INDEX_PRECISIONS` (the module docstring); ``indexer_path`` ``{"decode": path, "prefill": path}``
    (:mod:`.index_path`; default token level in both); ``parallel``: the expert-parallel group whose rank's experts
    ``weights`` hold (:mod:`.distributed`), or None (one process, every expert)."""
    decode_graphs = True  # decode steps can replay from CUDA graphs (:mod:`.cuda_graphs`)

    def __init__(self, config: ModelConfig, weights: dict, ops, index_precision: str = "fp8",
                 indexer_path: dict[str, str] | None = None, parallel=None):
        self.config, self.ops, self.index_precision, self.parallel = config, ops, index_precision, parallel
        if index_precision != "fp8" and indexer_path and "block" in indexer_path.values():
            raise ValueError("indexer_path: the block path needs the FP8 indexer (index_precision='fp8')")
        if index_precision == "fp8" and config.index_head_dim & (config.index_head_dim - 1):
            raise ValueError(f"index_precision: fp8 rotates by a Hadamard matrix, which needs a power-of-two "
                             f"index_head_dim, got {config.index_head_dim}")
        self.index_path = PathChoice(indexer_path if index_precision == "fp8" else None)
        self.embed, self.norm, self.lm_head = (weights[n] for n in ("model.embed_tokens.weight", "model.norm.weight",
                                                                     "lm_head.weight"))
        self.rotary = Rotary(config.rope, config.qk_rope_head_dim, self.embed.device)
        self.fp32_logits = fp32_output_gemm(self.lm_head)
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            mlp = (MoE(config, weights, p + "mlp.", parallel) if config.is_moe_layer(i)
                   else DenseMLP(weights, p + "mlp."))
            self.layers.append((weights[p + "input_layernorm.weight"],
                                Attention(config, weights, p + "self_attn.", index_precision, self.index_path,
                                          config.runs_indexer(i)),
                                weights[p + "post_attention_layernorm.weight"], mlp))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def graph_obstacle(self) -> str | None:
        """What keeps this model's kernel-mode decode steps (value checks off) out of a CUDA graph (None: nothing)."""
        if self.index_precision != "fp8":
            return "needs the FP8 indexer (activation-precision scores read sizes on the host)"
        return None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: PagedBatch, cache: CacheManager) -> torch.Tensor:
        """``input_ids[T]`` (packed as ``batch``) -> fp32 logits ``[B, vocab]`` of each sequence's last token."""
        eps = self.config.rms_norm_eps
        tables = self.rotary.tables(batch.positions)
        x, slots = self.embed[input_ids], None
        for (attn_norm, attn, mlp_norm, mlp), layer, keys in zip(self.layers, cache.layers, cache.index_keys):
            out, slots = attn(rms_norm(x, attn_norm, eps), tables, batch, layer, keys, slots, self.ops)
            x = x + out
            x = x + mlp(rms_norm(x, mlp_norm, eps), self.ops)
        return logits(rms_norm(x[batch.last_rows], self.norm, eps), self.lm_head, self.fp32_logits)

    def workspace(self, tokens_per_step: int) -> dict[str, int]:
        """The MoE prefill path's shared FP8 workspace at its largest (two stages of the most experts a stage can
        hold, each ``[2I, D]`` e4m3 with fp32 scales per 128 columns; allocated on the first prefill that takes it)."""
        c = self.config
        if not any(c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
            return {}
        n, k = 2 * c.moe_intermediate_size, c.hidden_size
        slots = 2 * max(registry.get("fp8_grouped_gemm").space["EXPERTS_PER_STAGE"])
        return {"workspace: MoE FP8 (at most)": slots * (n * k + 4 * n * -(-k // 128))}

    @torch.inference_mode()
    def idle(self) -> None:
        """A step with no tokens on this rank of the group: each MoE layer joins its collectives (other ranks' rows
        still come to this rank's experts)."""
        empty = self.embed.new_empty(0, self.config.hidden_size)
        for *_, mlp in self.layers:
            if isinstance(mlp, MoE):
                mlp.routed(empty, self.ops)
