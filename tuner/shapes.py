"""The shapes to tune: parsed from ``--shapes``, a kernel's bench shapes, or derived from a model's config.json.

A kernel names its shape dimensions (``spec.fixed_dims`` / ``spec.bucketed_dims``); this module maps those
names onto a DeepSeek-V3.2-style ``config.json`` (Hugging Face field names) with the vocabulary below.

Model dims (any of the names on a row; fixed dims of a shape key, or dims outside it): ::

    hidden_size                    hidden, hidden_size, d_model
    num_attention_heads            Hq, heads, num_heads, n_heads, num_attention_heads   (H outside indexer kernels)
    kv_lora_rank+qk_rope_head_dim  Dqk, head_dim, qk_dim                                (D outside indexer kernels)
    kv_lora_rank                   Dv, v_dim, kv_lora_rank
    qk_rope_head_dim               Dr, rope_dim, qk_rope_head_dim
    index_n_heads                  Hi, index_heads, index_n_heads                       (H in kernels named *index*)
    index_head_dim                 DK, Di, index_dim, index_head_dim                    (D in kernels named *index*)
    index_topk                     k, topk, index_topk
    n_routed_experts               E, experts, num_experts, n_routed_experts
    num_experts_per_tok            top_k, experts_per_token, num_experts_per_tok
    moe_intermediate_size          I, inter, moe_intermediate_size
    page size (not in config: 64)  P, page, page_size, block_size
    n_group (missing, null: 1)     n_group, n_groups
    topk_group (1 without groups)  topk_group, topk_groups
    scoring_func (default sigmoid) softmax                                              (1 for softmax routing)

A config without expert groups (``n_group`` missing, null or 1) has one group and ``topk_group`` 1. A field the
vocabulary needs that the config lacks (or holds null) is an error naming it, unless ``--set`` gives the dim.

Dense weights (kernels named *linear*): ``N`` and ``K`` take every dense projection of a layer
(:func:`linear_gemms`); ``M`` counts tokens.

Expert weights (kernels named *mxfp4*, *moe*, *gemm*, *expert*): ``N``, ``K`` and ``gather``, fixed or
bucketed, take both GEMMs: gate_up (N = 2 x moe_intermediate_size, K = hidden_size, gather = 1) and down
(N = hidden_size, K = moe_intermediate_size, gather = 0). Their ``M`` counts routed rows: the tokens times
num_experts_per_tok, or ``--set top_k=...`` (a grouped GEMM over T tokens routed top-8 has M = 8 T rows).

Bucketed dims: batch names (B, batch, num_seqs, seqs) take the decode batch sizes (1 in prefill); token names
(T, M, Q, N, tokens, num_tokens, rows) the prefill chunk sizes in prefill, and in decode the batch sizes
(tied to the batch dim when the kernel's bench shapes tie them; otherwise, beside a batch dim, they count
queries per sequence, see below); context names (L, context, ctx, seq_len, kv_len, keys) the context lengths
(at least the chunk in prefill); page-count names (pages, n_pages, num_pages) the context lengths over
the page size (``--set P=...`` or 64). A phase that is neither decode nor prefill (``any``) gets both.

The vocabulary applies to every dim a shape carries, inside its key or outside it (dims that only size the inputs,
such as the MoE layer path's ``n_group``: :func:`shape_dims`). Any other dimension is one no config has (queries
per decode step, pages selected, an alignment, ...): it takes its value from the kernel's GPU bench shape (its
realistic DeepSeek-V3.2 shape) that agrees most with the derived dims, and is reported as a note with its value;
``--set NAME=VALUE`` overrides or supplies any dimension.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from dsa_triton.hostmath import cdiv
from dsa_triton.registry import KernelSpec
from dsa_triton.registry import shape_text
from tuning_db.records import shape_from_text

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
PREFILL_CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_PAGE = 64

BATCH_NAMES = ("B", "batch", "num_seqs", "seqs")
TOKEN_NAMES = ("T", "M", "Q", "N", "tokens", "num_tokens", "rows")
CONTEXT_NAMES = ("L", "context", "ctx", "seq_len", "kv_len", "keys")
PAGE_NAMES = ("pages", "n_pages", "num_pages")  # context / page size
WEIGHT_KERNELS = ("mxfp4", "moe", "gemm", "expert")
LINEAR_KERNELS = ("linear",)  # dense GEMMs: N and K of each projection of a layer (:func:`linear_gemms`)
ROUTED_ROWS = "M"  # in a weight kernel: tokens x experts per token

Quantity = Callable[[dict[str, Any]], int]


def need(config: dict[str, Any], name: str) -> Any:
    """``config[name]``; a missing or null field raises KeyError (the caller names it)."""
    value = config.get(name)
    if value is None:
        raise KeyError(name)
    return value


def groups(config: dict[str, Any]) -> int:
    """Expert groups: ``n_group`` missing, null or 1 means no groups (one group)."""
    return int(config.get("n_group") or 1)


SCORING = {"sigmoid": 0, "softmax": 1}  # the routing kernels' ``softmax`` dim


def scoring(config: dict[str, Any]) -> int:
    """The routing kernels' ``softmax`` dim from ``scoring_func`` (missing: sigmoid, DeepSeek-V3's routing)."""
    func = config.get("scoring_func") or "sigmoid"
    if func not in SCORING:
        raise ValueError(f"the model config's scoring_func {func!r} is none of {sorted(SCORING)}")
    return SCORING[func]


FIXED: dict[str, Quantity] = {}
for names, quantity in [
    (("hidden", "hidden_size", "d_model"), lambda c: need(c, "hidden_size")),
    (("Hq", "heads", "num_heads", "n_heads", "num_attention_heads"), lambda c: need(c, "num_attention_heads")),
    (("Dqk", "head_dim", "qk_dim"), lambda c: need(c, "kv_lora_rank") + need(c, "qk_rope_head_dim")),
    (("Dv", "v_dim", "kv_lora_rank"), lambda c: need(c, "kv_lora_rank")),
    (("Dr", "rope_dim", "qk_rope_head_dim"), lambda c: need(c, "qk_rope_head_dim")),
    (("Hi", "index_heads", "index_n_heads"), lambda c: need(c, "index_n_heads")),
    (("DK", "Di", "index_dim", "index_head_dim"), lambda c: need(c, "index_head_dim")),
    (("k", "topk", "index_topk"), lambda c: need(c, "index_topk")),
    (("E", "experts", "num_experts", "n_routed_experts"), lambda c: need(c, "n_routed_experts")),
    (("top_k", "experts_per_token", "num_experts_per_tok"), lambda c: need(c, "num_experts_per_tok")),
    (("I", "inter", "moe_intermediate_size"), lambda c: need(c, "moe_intermediate_size")),
    (("P", "page", "page_size", "block_size"), lambda c: c.get("page_size") or DEFAULT_PAGE),
    (("n_group", "n_groups"), groups),
    (("topk_group", "topk_groups"), lambda c: need(c, "topk_group") if groups(c) > 1 else 1),
    (("softmax",), scoring),
]:
    FIXED.update(dict.fromkeys(names, quantity))
INDEXER_FIXED = {"H": FIXED["index_heads"], "D": FIXED["index_dim"]}
ATTENTION_FIXED = {"H": FIXED["heads"], "D": FIXED["head_dim"]}


EXPERT_GEMMS: tuple[dict[str, Quantity], ...] = (
    {"N": lambda c: 2 * need(c, "moe_intermediate_size"), "K": lambda c: need(c, "hidden_size"), "gather": lambda c: 1},
    {"N": lambda c: need(c, "hidden_size"), "K": lambda c: need(c, "moe_intermediate_size"), "gather": lambda c: 0},
)


def linear_gemms(c: dict[str, Any]) -> list[dict[str, Quantity]]:
    """``N`` and ``K`` of every dense projection of a layer (the weights a blockwise-FP8 checkpoint keeps in FP8):
    q (through ``q_lora_rank`` when the config has one), the latent kv, its up-projection, the output, and the dense
    MLP and the shared experts when the config has them."""
    heads = lambda c: need(c, "num_attention_heads")  # noqa: E731
    qk = lambda c: need(c, "qk_nope_head_dim") + need(c, "qk_rope_head_dim")  # noqa: E731
    hidden = lambda c: need(c, "hidden_size")  # noqa: E731
    q = ([{"N": lambda c: need(c, "q_lora_rank"), "K": hidden},
          {"N": lambda c: heads(c) * qk(c), "K": lambda c: need(c, "q_lora_rank")}] if c.get("q_lora_rank")
         else [{"N": lambda c: heads(c) * qk(c), "K": hidden}])
    shared = c.get("n_shared_experts") or 0
    return q + [
        {"N": lambda c: need(c, "kv_lora_rank") + need(c, "qk_rope_head_dim"), "K": hidden},
        {"N": lambda c: heads(c) * (need(c, "qk_nope_head_dim") + need(c, "v_head_dim")),
         "K": lambda c: need(c, "kv_lora_rank")},
        {"N": hidden, "K": lambda c: heads(c) * need(c, "v_head_dim")},
    ] + ([{"N": lambda c: need(c, "intermediate_size"), "K": hidden},
          {"N": hidden, "K": lambda c: need(c, "intermediate_size")}] if c.get("intermediate_size") else []) + (
         [{"N": lambda c: shared * need(c, "moe_intermediate_size"), "K": hidden},
          {"N": hidden, "K": lambda c: shared * need(c, "moe_intermediate_size")}] if shared else [])


def parse_shapes(texts: list[str]) -> list[dict[str, int]]:
    """``["B=64,L=131072", "B=1,L=4096;B=8,L=4096"]`` -> shapes (``;`` separates shapes within one text)."""
    return [shape_from_text(s) for text in texts for s in text.split(";") if s.strip()]


def parse_ints(text: str) -> tuple[int, ...]:
    """``"1,8,64"`` -> (1, 8, 64)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


MODELS = Path(__file__).resolve().parent / "models"


def model_path(path: str | Path) -> Path:
    """A config.json's path, or that of the one named under ``tuner/models`` (``deepseek-v3.2``)."""
    path = Path(path)
    if not path.is_file() and (MODELS / f"{path}.json").is_file():
        path = MODELS / f"{path}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MODELS.glob("*.json")))
        raise ValueError(f"--model: no config.json at {path} (or a model name: {known})")
    return path


def load_model_config(path: str | Path) -> dict[str, Any]:
    """A config.json, or the name of one under ``tuner/models`` (``deepseek-v3.2``: the shape fields only)."""
    return json.loads(model_path(path).read_text())


def _value(spec: KernelSpec, dim: str, quantity: Quantity, config: dict[str, Any]) -> int:
    try:
        return int(quantity(config))
    except KeyError as exc:
        raise ValueError(f"{spec.name}: the model config lacks {exc} (for dim {dim}); give it with --set {dim}=...") from None


def shape_dims(spec: KernelSpec, phase: str) -> tuple[str, ...]:
    """Every dim a shape of ``phase`` carries: the shape key's, then the others of the GPU bench shapes (dims that
    only size the inputs, such as ``n_group`` of the MoE layer path)."""
    key = (*spec.fixed_dims, *spec.bucketed_dims)
    others = {d for s in spec.bench_shapes(phase, True) for d in s} - set(key)
    return (*key, *sorted(others))


def derived_dims(spec: KernelSpec, config: dict[str, Any], dims: tuple[str, ...] | None = None,
                 given: dict[str, int] | None = None) -> list[dict[str, int]]:
    """The dims of ``dims`` (default: the shape key's) that the vocabulary derives from the model, counts
    (bucketed dims) aside: one dict, or one per expert GEMM (gate_up, down) or dense projection. Dims in ``given`` (``--set``)
    are not read from the model, so a config lacking one is no error."""
    table = {**FIXED, **(INDEXER_FIXED if "index" in spec.name else ATTENTION_FIXED)}
    dims = (*spec.fixed_dims, *spec.bucketed_dims) if dims is None else dims
    given = given or {}
    matrices = (linear_gemms(config) if any(w in spec.name for w in LINEAR_KERNELS)
                else EXPERT_GEMMS if any(w in spec.name for w in WEIGHT_KERNELS) else ())
    gemm = [d for d in dims if matrices and d in matrices[0] and d not in given]
    fixed = {d: _value(spec, d, table[d], config) for d in dims
             if d in table and d not in gemm and d not in spec.bucketed_dims and d not in given}
    if not gemm:
        return [fixed]
    alternatives = [{**fixed, **{d: _value(spec, d, g[d], config) for d in gemm}} for g in matrices]
    return dedupe(alternatives)


def counted_dims(spec: KernelSpec, phase: str, skip: set[str], batches: tuple[int, ...], contexts: tuple[int, ...],
                 chunks: tuple[int, ...]) -> list[dict[str, int]]:
    """Every combination of the kernel's bucketed batch / token / context dims (not in ``skip``) for ``phase``;
    a phase that is neither decode nor prefill (``any``) gets the combinations of both."""
    roles: dict[str, list[str]] = {"batch": [], "tokens": [], "context": []}
    for dim in (d for d in spec.bucketed_dims if d not in skip):
        for role, names in (("batch", BATCH_NAMES), ("tokens", TOKEN_NAMES),
                            ("context", CONTEXT_NAMES + PAGE_NAMES)):
            if dim in names:
                roles[role].append(dim)
    batch_dims, context_dims = roles["batch"], roles["context"]
    tied = roles["tokens"]
    if batch_dims:  # beside a batch dim, a decode token dim follows it only if the bench shapes tie them
        benches = spec.bench_shapes(phase, True)
        tied = [t for t in tied if all(s.get(t) == s.get(batch_dims[0]) for s in benches)]
    some = lambda values, wanted: values if wanted else (None,)
    rows = []
    if phase != "prefill":  # decode: batch sizes x contexts
        rows += [({d: b for d in batch_dims + tied}, c) for b in some(batches, batch_dims or tied)
                 for c in some(contexts, context_dims)]
    if phase != "decode":  # prefill: one sequence, chunks x contexts of at least the chunk
        rows += [({**{d: 1 for d in batch_dims}, **{d: t for d in roles["tokens"]}}, c)
                 for t in some(chunks, roles["tokens"]) for c in some(contexts, context_dims)
                 if t is None or c is None or c >= t]
    return dedupe([{**counts, **{d: c for d in context_dims}} for counts, c in rows])


def closest_bench(spec: KernelSpec, phase: str, derived: dict[str, int]) -> dict[str, int]:
    """The GPU bench shape with the most dims equal to ``derived`` (ties: the first)."""
    benches = spec.bench_shapes(phase, True)
    if not benches:
        raise ValueError(f"{spec.name}: no GPU bench shape for {phase} to complete the derived shapes from")
    return max(benches, key=lambda s: sum(s.get(d) == v for d, v in derived.items()))


def model_shapes(spec: KernelSpec, phase: str, config: dict[str, Any], overrides: dict[str, int] | None = None,
                 batches: tuple[int, ...] = DECODE_BATCHES, contexts: tuple[int, ...] = CONTEXTS,
                 chunks: tuple[int, ...] = PREFILL_CHUNKS, notes: list[str] | None = None) -> list[dict[str, int]]:
    """Every shape of ``phase`` the model needs from this kernel; ``notes`` gets the dims taken from bench shapes
    (with their values): only dims the vocabulary cannot derive from a config."""
    overrides = overrides or {}
    key_dims = (*spec.fixed_dims, *spec.bucketed_dims)
    routed = any(w in spec.name for w in WEIGHT_KERNELS) and ROUTED_ROWS in key_dims
    page = overrides.get("P") or _value(spec, "P", FIXED["P"], config)  # --set wins over the model
    rows_per_token = (overrides.get("top_k") or _value(spec, "top_k", FIXED["top_k"], config)) if routed else 1
    shapes, borrowed = [], {}
    for fixed in derived_dims(spec, config, shape_dims(spec, phase), overrides):
        for counts in counted_dims(spec, phase, set(fixed), batches, contexts, chunks):
            for dim in PAGE_NAMES:
                if dim in counts:
                    counts[dim] = cdiv(counts[dim], page)
            if ROUTED_ROWS in counts:
                counts[ROUTED_ROWS] *= rows_per_token
            derived = {**fixed, **counts, **overrides}
            bench = closest_bench(spec, phase, derived)
            for dim in bench.keys() - derived.keys():
                borrowed.setdefault(dim, set()).add(bench[dim])
            for dim in set(key_dims) - derived.keys() - bench.keys():
                raise ValueError(f"{spec.name} {phase}: no value for dim {dim}; give it with --set {dim}=...")
            shapes.append({**bench, **derived})
    if notes is not None and borrowed:
        taken = ", ".join(f"{d}={'/'.join(map(str, sorted(v)))}" for d, v in sorted(borrowed.items()))
        notes.append(f"{spec.name} {phase}: {taken} from its GPU bench shapes (not model dims; --set to change)")
    return dedupe(shapes)


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
