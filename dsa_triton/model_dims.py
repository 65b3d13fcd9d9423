"""A model's dims as the kernels name them, read from its ``config.json`` (Hugging Face field names).

Each registry entry declares the dims a model fixes (:attr:`~dsa_triton.registry.KernelSpec.model_dims`: a function
of a :class:`ModelDims` returning one dict per problem the model poses, e.g. one per weight matrix); the tuner lays
batch sizes, chunks and context lengths over them. A field the config lacks (or holds null) is a :class:`Missing`
value naming the field, which propagates through arithmetic, so the tuner can name the dim it was for and let
``--set DIM=...`` supply it.
"""
from __future__ import annotations

from typing import Any

DEFAULT_PAGE = 64  # tokens a page when the config names no page size (it is a serving choice, not a model dim)
SCORING = {"sigmoid": 0, "softmax": 1}  # the routing kernels' ``softmax`` dim
# DeepSeek-V4's attention layer types, their compression rates (transformers' defaults) and legacy rate values
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V4_RATES = {CSA: 4, HCA: 128}
V4_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


class Missing:
    """A config field that is absent or null: any arithmetic with it gives it back."""

    def __init__(self, field: str):
        self.field = field

    def __repr__(self) -> str:
        return f"Missing({self.field!r})"

    def _same(self, *_):
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __rfloordiv__ = _same


class ModelDims:
    """The quantities kernels take from a model config: each an int, or :class:`Missing` when the config lacks it."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def field(self, name: str):
        value = self.config.get(name)
        return Missing(name) if value is None else value

    @property
    def hidden(self):
        return self.field("hidden_size")

    @property
    def heads(self):
        return self.field("num_attention_heads")

    @property
    def v4(self) -> bool:
        """A DeepSeek-V4 config (``model_type`` ``deepseek_v4``): one K=V head of ``head_dim`` values, rope last."""
        return self.config.get("model_type") == "deepseek_v4"

    @property
    def latent(self):
        """The MQA latent (values) width: ``kv_lora_rank``; DeepSeek-V4: ``head_dim`` (the values are the whole
        row)."""
        return self.field("head_dim") if self.v4 else self.field("kv_lora_rank")

    @property
    def rope(self):
        """Rope dims: ``qk_rope_head_dim``; DeepSeek-V4: ``head_dim * partial_rotary_factor`` (default 64 / 512),
        or the legacy ``qk_rope_head_dim``."""
        if self.v4 and self.config.get("qk_rope_head_dim") is None:
            return int(self.latent * (self.config.get("partial_rotary_factor") or 0.125))
        return self.field("qk_rope_head_dim")

    @property
    def qk(self):
        """The width of a latent cache row, which every query head scores: latent plus rope (DeepSeek-V4:
        ``head_dim``, its last ``rope`` dims rotated)."""
        return self.latent if self.v4 else self.latent + self.rope

    @property
    def kv_fp8(self) -> int:
        """The FP8 cache layout the model's attention reads (the kernels' ``fp8``): 1 DeepSeek's FP8 latent cache,
        2 (DeepSeek-V4) FlashMLA's MODEL1 layout."""
        return 2 if self.v4 else 1

    @property
    def sliding_window(self):
        return self.field("sliding_window")

    def compress_rate(self, layer_type: str):
        """Tokens per compressed entry of a DeepSeek-V4 layer type: ``compress_rates``, the legacy
        ``compress_rate_csa`` / ``compress_rate_hca``, else 4 (CSA) and 128 (HCA)."""
        rates = self.config.get("compress_rates") or {}
        legacy = self.config.get("compress_rate_" + ("csa" if layer_type == CSA else "hca"))
        return rates.get(layer_type) or legacy or V4_RATES[layer_type]

    def attention_types(self) -> list[str]:
        """DeepSeek-V4's attention layer types in the model (``layer_types``, the legacy ``compress_ratios``, else
        transformers' default: HCA and CSA), in the order sliding, CSA, HCA."""
        types = self.config.get("layer_types")
        if types is None and self.config.get("compress_ratios") is not None:
            types = [V4_RATIO_TYPES.get(r, str(r)) for r in self.config["compress_ratios"]]
        types = set(types or (CSA, HCA))
        return [t for t in (SLIDING, CSA, HCA) if t in types]

    def attention_index_sets(self) -> list[tuple[int, int]]:
        """DeepSeek-V4: ``(window, compressed)`` index-set widths of each attention layer type: the sliding window
        and none (sliding), ``index_topk`` entries (CSA), every entry at ``max_position_embeddings`` (HCA: the
        widest row, shorter rows cut by their length)."""
        widths = {SLIDING: 0, CSA: self.index_topk,
                  HCA: self.field("max_position_embeddings") // self.compress_rate(HCA)}
        return [(self.sliding_window, widths[t]) for t in self.attention_types()]

    @property
    def index_heads(self):
        return self.field("index_n_heads")

    @property
    def index_dim(self):
        return self.field("index_head_dim")

    @property
    def index_topk(self):
        return self.field("index_topk")

    @property
    def experts(self):
        return self.field("n_routed_experts")

    @property
    def top_k(self):
        return self.field("num_experts_per_tok")

    @property
    def moe_inter(self):
        return self.field("moe_intermediate_size")

    @property
    def page(self) -> int:
        return self.config.get("page_size") or DEFAULT_PAGE

    @property
    def n_group(self) -> int:
        """Expert groups: ``n_group`` missing, null or 1 means one group."""
        return int(self.config.get("n_group") or 1)

    @property
    def topk_group(self):
        return self.field("topk_group") if self.n_group > 1 else 1

    @property
    def softmax(self) -> int:
        """1 for softmax routing scores, 0 for sigmoid (DeepSeek-V3's, the default)."""
        func = self.config.get("scoring_func") or "sigmoid"
        if func not in SCORING:
            raise ValueError(f"the model config's scoring_func {func!r} is none of {sorted(SCORING)}")
        return SCORING[func]

    def expert_gemms(self) -> list[dict[str, Any]]:
        """The two GEMMs of an expert: gate_up (``N`` = 2 I, ``K`` = hidden, rows gather tokens) and down."""
        return [{"N": 2 * self.moe_inter, "K": self.hidden, "gather": 1},
                {"N": self.hidden, "K": self.moe_inter, "gather": 0}]

    def dense_gemms(self) -> list[dict[str, Any]]:
        """``N`` and ``K`` of every dense projection of a layer (the weights a blockwise-FP8 checkpoint keeps in FP8):
        q (through ``q_lora_rank`` when the config has one), the latent kv, its up-projection, the output, and the
        dense MLP and the shared experts when the config has them."""
        c = self.config
        qk_head = self.field("qk_nope_head_dim") + self.rope
        q = ([{"N": self.field("q_lora_rank"), "K": self.hidden},
              {"N": self.heads * qk_head, "K": self.field("q_lora_rank")}] if c.get("q_lora_rank")
             else [{"N": self.heads * qk_head, "K": self.hidden}])
        out = q + [{"N": self.qk, "K": self.hidden},
                   {"N": self.heads * (self.field("qk_nope_head_dim") + self.field("v_head_dim")), "K": self.latent},
                   {"N": self.hidden, "K": self.heads * self.field("v_head_dim")}]
        if c.get("intermediate_size"):
            out += [{"N": c["intermediate_size"], "K": self.hidden}, {"N": self.hidden, "K": c["intermediate_size"]}]
        shared = c.get("n_shared_experts") or 0
        if shared:
            out += [{"N": shared * self.moe_inter, "K": self.hidden}, {"N": self.hidden, "K": shared * self.moe_inter}]
        return out
