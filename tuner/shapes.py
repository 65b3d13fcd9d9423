"""The shapes to tune: parsed from ``--shapes``, a kernel's bench shapes, or derived from a model's config.json.

A kernel names its shape dimensions (``spec.fixed_dims`` / ``spec.bucketed_dims``); this module maps those
names onto a DeepSeek-V3.2-style ``config.json`` (Hugging Face field names) with the vocabulary below.

Fixed dims (any of the names on a row): ::

    hidden_size                    hidden, hidden_size, d_model
    num_attention_heads            Hq, heads, num_heads, n_heads, num_attention_heads   (H outside indexer kernels)
    kv_lora_rank+qk_rope_head_dim  Dqk, Dk, head_dim, qk_dim                            (D outside indexer kernels)
    kv_lora_rank                   Dv, v_dim, kv_lora_rank
    qk_rope_head_dim               Dr, rope_dim, qk_rope_head_dim
    index_n_heads                  Hi, index_heads, index_n_heads                       (H in kernels named *index*)
    index_head_dim                 Di, index_dim, index_head_dim                        (D in kernels named *index*)
    index_topk                     k, topk, index_topk
    n_routed_experts               E, experts, num_experts, n_routed_experts
    num_experts_per_tok            top_k, experts_per_token, num_experts_per_tok
    moe_intermediate_size          I, inter, moe_intermediate_size
    page size (not in config: 64)  P, page, page_size, block_size
    (N, K) of the expert GEMMs     N, K: both (2 x moe_intermediate_size, hidden_size) for gate_up
                                   and (hidden_size, moe_intermediate_size) for down

Bucketed dims: batch names (B, batch, num_seqs, seqs) take the decode batch sizes (1 in prefill); token
names (T, M, tokens, num_tokens, rows) the decode batch sizes in decode and the prefill chunk sizes in
prefill; context names (L, context, ctx, seq_len, kv_len, keys) the context lengths (in prefill at least
the chunk). ``--set NAME=VALUE`` overrides or supplies any dimension; a dimension the vocabulary does not
know takes the value all of the kernel's GPU bench shapes agree on, else it is an error naming it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from dsa_triton.registry import KernelSpec
from tuning_db.records import shape_from_text, shape_text

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
PREFILL_CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_PAGE = 64

BATCH_NAMES = ("B", "batch", "num_seqs", "seqs")
TOKEN_NAMES = ("T", "M", "tokens", "num_tokens", "rows")
CONTEXT_NAMES = ("L", "context", "ctx", "seq_len", "kv_len", "keys")

Quantity = Callable[[dict[str, Any]], int]
FIXED: dict[str, Quantity] = {}
for names, quantity in [
    (("hidden", "hidden_size", "d_model"), lambda c: c["hidden_size"]),
    (("Hq", "heads", "num_heads", "n_heads", "num_attention_heads"), lambda c: c["num_attention_heads"]),
    (("Dqk", "Dk", "head_dim", "qk_dim"), lambda c: c["kv_lora_rank"] + c["qk_rope_head_dim"]),
    (("Dv", "v_dim", "kv_lora_rank"), lambda c: c["kv_lora_rank"]),
    (("Dr", "rope_dim", "qk_rope_head_dim"), lambda c: c["qk_rope_head_dim"]),
    (("Hi", "index_heads", "index_n_heads"), lambda c: c["index_n_heads"]),
    (("Di", "index_dim", "index_head_dim"), lambda c: c["index_head_dim"]),
    (("k", "topk", "index_topk"), lambda c: c["index_topk"]),
    (("E", "experts", "num_experts", "n_routed_experts"), lambda c: c["n_routed_experts"]),
    (("top_k", "experts_per_token", "num_experts_per_tok"), lambda c: c["num_experts_per_tok"]),
    (("I", "inter", "moe_intermediate_size"), lambda c: c["moe_intermediate_size"]),
    (("P", "page", "page_size", "block_size"), lambda c: c.get("page_size", DEFAULT_PAGE)),
]:
    FIXED.update(dict.fromkeys(names, quantity))
INDEXER_FIXED = {"H": FIXED["index_heads"], "D": FIXED["index_dim"]}
ATTENTION_FIXED = {"H": FIXED["heads"], "D": FIXED["head_dim"]}
GEMM_NK: tuple[tuple[Quantity, Quantity], ...] = (
    (lambda c: 2 * c["moe_intermediate_size"], lambda c: c["hidden_size"]),  # gate_up
    (lambda c: c["hidden_size"], lambda c: c["moe_intermediate_size"]),  # down
)


def parse_shapes(texts: list[str]) -> list[dict[str, int]]:
    """``["B=64,L=131072", "B=1,L=4096;B=8,L=4096"]`` -> shapes (``;`` separates shapes within one text)."""
    return [shape_from_text(s) for text in texts for s in text.split(";") if s.strip()]


def parse_ints(text: str) -> tuple[int, ...]:
    """``"1,8,64"`` -> (1, 8, 64)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def load_model_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--model: no config.json at {path}")
    return json.loads(path.read_text())


def _agreed(spec: KernelSpec, phase: str, dim: str) -> int | None:
    values = {s.get(dim) for s in spec.bench_shapes(phase, True)}
    return values.pop() if len(values) == 1 and None not in values else None


def fixed_alternatives(spec: KernelSpec, phase: str, config: dict[str, Any], overrides: dict[str, int]) -> list[dict[str, int]]:
    """Values of the kernel's fixed dims for this model: usually one dict, two for expert GEMMs (gate_up, down)."""
    table = {**FIXED, **(INDEXER_FIXED if "index" in spec.name else ATTENTION_FIXED)}
    base: dict[str, int] = {}
    unknown = []
    pair = [d for d in ("N", "K") if d in spec.fixed_dims and d not in overrides]
    for dim in spec.fixed_dims:
        if dim in overrides or dim in pair:
            continue
        try:
            base[dim] = int(table[dim](config))
        except KeyError:
            agreed = _agreed(spec, phase, dim)
            if agreed is None:
                unknown.append(dim)
            else:
                base[dim] = agreed
    if unknown:
        raise ValueError(f"{spec.name}: cannot derive {unknown} from the model config; give them with --set "
                         f"{','.join(f'{d}=...' for d in unknown)}")
    if not pair:
        return [{**base, **overrides}]
    try:
        choices = [dict(zip(("N", "K"), (n(config), k(config)))) for n, k in GEMM_NK]
    except KeyError as exc:
        raise ValueError(f"{spec.name}: the model config lacks {exc} (needed for N, K)") from None
    return list({shape_text(a): a for a in ({**base, **{d: c[d] for d in pair}, **overrides} for c in choices)}.values())


def bucketed_values(spec: KernelSpec, phase: str, batches: tuple[int, ...], contexts: tuple[int, ...],
                    chunks: tuple[int, ...]) -> list[dict[str, int]]:
    """Every combination of the kernel's bucketed dims for ``phase`` (prefill: context >= chunk)."""
    decode = phase == "decode"
    roles: dict[str, list[str]] = {"batch": [], "tokens": [], "context": []}
    for dim in spec.bucketed_dims:
        role = ("batch" if dim in BATCH_NAMES else "tokens" if dim in TOKEN_NAMES
                else "context" if dim in CONTEXT_NAMES else None)
        if role is None:
            raise ValueError(f"{spec.name}: bucketed dim {dim!r} is none of batch {BATCH_NAMES}, tokens "
                             f"{TOKEN_NAMES} or context {CONTEXT_NAMES}; give it with --set or --shapes")
        roles[role].append(dim)
    some = lambda values, wanted: values if wanted else (None,)
    contexts = some(contexts, roles["context"])
    if decode:
        rows = [(b, b, c) for b in some(batches, roles["batch"] or roles["tokens"]) for c in contexts]
    else:
        rows = [(1, t, c) for t in some(chunks, roles["tokens"]) for c in contexts
                if t is None or c is None or c >= t]
    out = []
    for batch, tokens, context in rows:
        shape = {d: batch for d in roles["batch"]}
        shape |= {d: tokens for d in roles["tokens"]}
        shape |= {d: context for d in roles["context"]}
        out.append(shape)
    return out


def model_shapes(spec: KernelSpec, phase: str, config: dict[str, Any], overrides: dict[str, int] | None = None,
                 batches: tuple[int, ...] = DECODE_BATCHES, contexts: tuple[int, ...] = CONTEXTS,
                 chunks: tuple[int, ...] = PREFILL_CHUNKS) -> list[dict[str, int]]:
    """Every shape of ``phase`` the model needs from this kernel (dims outside the shape key: bench shape)."""
    overrides = overrides or {}
    template = spec.bench_shapes(phase, True)[0]
    rest = {d: v for d, v in template.items() if d not in (*spec.fixed_dims, *spec.bucketed_dims)}
    return dedupe([{**rest, **fixed, **counts, **overrides}
                   for fixed in fixed_alternatives(spec, phase, config, overrides)
                   for counts in bucketed_values(spec, phase, batches, contexts, chunks)])


def job_shapes(spec: KernelSpec, phase: str, *, given: list[dict[str, int]], templates: list[dict[str, int]],
               overrides: dict[str, int]) -> list[dict[str, int]]:
    """``templates`` (model or bench shapes) with ``overrides`` and each given shape's dims laid over them.

    A given shape naming a dim the kernel does not have is not for this kernel (skipped).
    """
    known = set(spec.fixed_dims) | set(spec.bucketed_dims) | {d for t in templates for d in t}
    templates = [{**t, **overrides} for t in templates]
    if not given:
        return dedupe(templates)
    return dedupe([{**t, **g} for g in given if set(g) <= known for t in templates])


def dedupe(shapes: list[dict[str, int]]) -> list[dict[str, int]]:
    return list({shape_text(s): s for s in shapes}.values())
