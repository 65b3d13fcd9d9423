"""The shapes to tune: parsed from ``--shapes``, a kernel's bench shapes, or derived from a model's config.json.

A kernel declares what a model fixes and what its counts count (its registry entry's ``model_dims`` and
``count_roles``, read through :class:`dsa_triton.model_dims.ModelDims`); this module lays the batch sizes, prefill
chunks and context lengths over them:

- a ``batch`` dim takes the decode batch sizes (1 in prefill);
- a ``tokens`` dim takes the prefill chunk sizes in prefill, and in decode the batch sizes when the kernel's bench
  shapes tie it to its batch dim (else, beside a batch dim, it counts queries per sequence and comes from the bench
  shapes); ``rows`` counts routed rows: tokens times ``num_experts_per_tok`` (or ``--set top_k=...``);
- a ``context`` dim takes the context lengths (at least the chunk in prefill), a ``pages`` dim the context lengths over
  the page size (``--set P=...`` or the model's);
- a phase that is neither decode nor prefill (``any``) gets both.

A field the model config lacks (or holds null) is an error naming it and the dim it was for, unless ``--set`` gives
the dim. Any other dimension is one no config has (queries per decode step, pages selected, an alignment, ...): it
takes its value from the kernel's GPU bench shape (its realistic DeepSeek-V3.2 shape) that agrees most with the
derived dims, and is reported as a note with its value; ``--set NAME=VALUE`` overrides or supplies any dimension.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsa_triton.hostmath import cdiv
from dsa_triton.model_dims import Missing, ModelDims
from dsa_triton.registry import KernelSpec
from tuning_db import shape_from_text, shape_text

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
PREFILL_CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)


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


def derived_dims(spec: KernelSpec, config: dict[str, Any], given: dict[str, int] | None = None) -> list[dict[str, int]]:
    """The dims the model fixes (the spec's ``model_dims``): one dict, or one per weight matrix. Dims in ``given``
    (``--set``) are not read from the model, so a config lacking them is no error."""
    given = given or {}
    found = spec.model_dims(ModelDims(config)) if spec.model_dims else [{}]
    alternatives = []
    for dims in found:
        dims = {d: v for d, v in dims.items() if d not in given}
        for d, v in dims.items():
            if isinstance(v, Missing):
                raise ValueError(f"{spec.name}: the model config lacks {v.field!r} (for dim {d}); give it with "
                                 f"--set {d}=...")
        alternatives.append({d: int(v) for d, v in dims.items()})
    return dedupe(alternatives)


def counted_dims(spec: KernelSpec, phase: str, skip: set[str], batches: tuple[int, ...], contexts: tuple[int, ...],
                 chunks: tuple[int, ...]) -> list[dict[str, int]]:
    """Every combination of the kernel's counted dims (``count_roles``, less ``skip``) for ``phase``; a phase that
    is neither decode nor prefill (``any``) gets the combinations of both. ``pages`` dims hold context lengths and
    ``rows`` dims token counts here (the caller scales them)."""
    roles: dict[str, list[str]] = {"batch": [], "tokens": [], "context": []}
    for dim, role in spec.count_roles.items():
        if dim not in skip:
            roles[{"pages": "context", "rows": "tokens"}.get(role, role)].append(dim)
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
    (with their values): only dims the model does not fix."""
    overrides = overrides or {}
    model = ModelDims(config)
    key_dims = (*spec.fixed_dims, *spec.bucketed_dims)
    page = overrides.get("P") or model.page  # --set wins over the model
    per_token = overrides.get("top_k") or model.top_k
    shapes, borrowed = [], {}
    for fixed in derived_dims(spec, config, overrides):
        for counts in counted_dims(spec, phase, set(fixed), batches, contexts, chunks):
            for dim, role in spec.count_roles.items():
                if dim in counts and role == "pages":
                    counts[dim] = cdiv(counts[dim], page)
                if dim in counts and role == "rows":
                    if isinstance(per_token, Missing):
                        raise ValueError(f"{spec.name}: the model config lacks {per_token.field!r} (for dim top_k); "
                                         f"give it with --set top_k=...")
                    counts[dim] *= per_token
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
