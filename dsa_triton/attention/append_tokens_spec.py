"""Registry entry of :func:`~dsa_triton.append_tokens`, into a latent cache of rows in the activation dtype
(``fp8`` 0), into the FP8 latent cache (``fp8`` 1, whose new rows' last ``Dr`` values are rope, kept bf16) or into
MODEL1 FP8 pages (``fp8`` 2, DeepSeek-V4's). Shapes as :data:`.append_tokens.LAUNCH` says; problem-only ``ctx``:
tokens already in each sequence.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..checks import exact_mismatch
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import append_tokens, append_tokens_kernels, append_tokens_reference, cache, formats
from .append_tokens_reference import append_torch
from .formats import fp8_latent_bytes, model1_bytes, model1_cache


def _items_to_slots(items: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token physical slots, the touched pages and their fill after the append (device tensors)."""
    src, count, page, first = items.long().unbind(1)
    token_item = torch.repeat_interleave(torch.arange(items.shape[0], device=items.device), count)
    within = torch.arange(token_item.numel(), device=items.device) - (torch.cumsum(count, 0) - count)[token_item]
    slots = page[token_item] * P + first[token_item] + within
    return slots, page, first + count


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    """A cache with ``ctx`` tokens per sequence already in it (the last page partly full), and new tokens; with
    ``fp8`` 1 an FP8 latent cache, with ``fp8`` 2 MODEL1 pages (FlashMLA's page stride; NaN bytes where unwritten),
    and new rows whose magnitudes span 2^-8 .. 2^8 (per row)."""
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *size, dtype=torch.float32: torch.randn(*size, generator=g, device=device, dtype=dtype)  # noqa: E731
    B, N, P, D, DK, ctx = (shape[k] for k in ("B", "N", "P", "D", "DK", "ctx"))
    rope_dim = shape["Dr"] if shape["fp8"] else None
    per_seq = N // B
    pages_per_seq = cdiv(ctx + per_seq, P)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16
    layout = {} if rope_dim is None else {"kv_dtype": "fp8", "rope_dim": rope_dim}
    num_pages = B * pages_per_seq + 1
    if shape["fp8"] == 2:  # PagedCache keeps the FP8 latent layout: MODEL1 pages of their own, as FlashMLA's
        kv_cache = model1_cache(num_pages, P, D - rope_dim, rope_dim, fill=0xFF, device=device)
        paged = cache.PagedCache(num_pages, P, B, pages_per_seq, 0, DK, dtype, device, poison=True) if DK else None
    else:
        paged = cache.PagedCache(num_pages, P, B, pages_per_seq, D, DK, dtype, device, poison=True, **layout)
        kv_cache = paged.kv
    ik, ik_scale, summaries = (paged.ik, paged.ik_scale, paged.summaries) if DK else (None, None, None)
    keys = lambda n: randn(n, DK) if DK else None  # noqa: E731
    # the existing context is written by the reference, so the inputs never depend on the kernel
    perm = torch.randperm(B * pages_per_seq, generator=g, device=device).view(B, pages_per_seq) + 1  # page 0 unused
    old_slots = (perm[:, :, None] * P + torch.arange(P, device=device)).view(B, -1)[:, :ctx].reshape(-1)
    old_fill = (ctx - torch.arange(pages_per_seq, device=device) * P).clamp(0, P).repeat(B)
    append_torch(kv_cache, ik, ik_scale, summaries, randn(B * ctx, D, dtype=dtype), keys(B * ctx), old_slots,
                 perm.reshape(-1)[old_fill > 0], old_fill[old_fill > 0], rope_dim=rope_dim or 0)
    items = [item for b, pages in enumerate(perm.tolist())
             for item in cache.page_items(b * per_seq, ctx, per_seq, pages, P)]
    kv = randn(N, D, dtype=dtype)
    if rope_dim is not None:
        kv = (kv.float() * torch.exp2(torch.randint(-8, 9, (N, 1), generator=g, device=device))).to(dtype)
    return {
        "kv_cache": kv_cache, "ik": ik, "ik_scale": ik_scale, "summaries": summaries,
        "kv": kv,
        "index_k": randn(N, DK, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32) if DK else None,
        "items": torch.tensor(items, dtype=torch.int32).to(device),
        "rope_dim": rope_dim or 0,
    }


def _run(inputs: dict, config: dict):
    tensors = [inputs[k] for k in ("kv_cache", "ik", "ik_scale", "summaries", "kv", "index_k", "items")]
    plan = append_tokens.append_plan(*tensors, config, inputs["rope_dim"])
    append_tokens.launch_append(plan, *tensors)
    return inputs["kv_cache"], inputs["ik"], inputs["ik_scale"], inputs["summaries"]


def _append_torch(inputs: dict, kv_cache, ik, ik_scale, summaries) -> None:
    P = (kv_cache if kv_cache is not None else ik).shape[1]
    append_torch(kv_cache, ik, ik_scale, summaries, inputs["kv"], inputs["index_k"],
                 *_items_to_slots(inputs["items"], P), rope_dim=inputs["rope_dim"])


def _reference(inputs: dict):
    kv_cache, ik, ik_scale, summaries = (None if inputs[k] is None else inputs[k].clone()
                                         for k in ("kv_cache", "ik", "ik_scale", "summaries"))
    _append_torch(inputs, kv_cache, ik, ik_scale, summaries)
    return kv_cache, ik, ik_scale, summaries


def _compare(out, ref) -> str | None:
    return exact_mismatch((name, o, r) for name, o, r in zip(("kv_cache", "ik", "ik_scale", "summaries"), out, ref)
                          if r is not None)


def _cost(phase: str, shape) -> Cost:
    """New rows read (2 bytes a value) and written (2 bytes a value, or an FP8 row), index keys and summaries."""
    N, D, DK, B = shape["N"], shape["D"], shape["DK"], shape["B"]
    pages = B * cdiv(N // B, shape["P"]) if phase == "prefill" else B
    fp8, dr = shape["fp8"], shape["Dr"]
    row_bytes = model1_bytes(D - dr, dr) if fp8 == 2 else fp8_latent_bytes(D - dr, dr) if fp8 else 2 * D
    kv_bytes = N * (2 * D + row_bytes)
    index_bytes = N * DK * 2 + N * (DK + 4) + pages * 2 * DK * 2 * 2  # bf16 summaries, read and written
    return Cost(bytes=kv_bytes + index_bytes)


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    """DeepSeek-V3.2's rows over both caches (576 = 512 + 64: 656 bytes in FP8); on the CPU an FP8 latent of two
    groups, the second partial. (DeepSeek-V4's MODEL1 rows, ``fp8`` 2, come from its config.json: ``model_dims``.)"""
    if gpu:
        shape = ({"B": 4, "N": 16384, "P": 64, "D": 576, "DK": 128, "ctx": 100} if phase == "prefill"
                 else {"B": 64, "N": 64, "P": 64, "D": 576, "DK": 128, "ctx": 100})
        return [{**shape, "Dr": 0, "fp8": 0}, {**shape, "Dr": 64, "fp8": 1}]
    if phase == "prefill":
        return [{"B": 2, "N": 40, "P": 16, "D": 48, "Dr": 0, "DK": 32, "ctx": 5, "fp8": 0},
                {"B": 2, "N": 40, "P": 16, "D": 224, "Dr": 24, "DK": 32, "ctx": 5, "fp8": 1}]
    return [{"B": 3, "N": 3, "P": 16, "D": 48, "Dr": 0, "DK": 32, "ctx": 17, "fp8": 0},
            {"B": 3, "N": 3, "P": 16, "D": 48, "Dr": 8, "DK": 32, "ctx": 17, "fp8": 1}]


SPEC = registry.register(KernelSpec(
    launch=append_tokens.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=lambda inputs: _append_torch(inputs, *(inputs[k] for k in ("kv_cache", "ik", "ik_scale", "summaries"))),
    baseline_name="torch index_put + quantize + page min/max",
    model_dims=lambda m: [{"P": m.page, "D": m.qk, "Dr": dr, "DK": dk, "fp8": fp8}
                          for dr, fp8 in ((0, 0), (m.rope, m.kv_fp8))
                          for dk in ((m.index_dim, 0) if m.v4 else (m.index_dim,))],  # V4: window rows keyless
    count_roles={"N": "tokens", "B": "batch"},
    source_modules=(append_tokens_reference, append_tokens_kernels, append_tokens, formats, sys.modules[__name__]),
))
