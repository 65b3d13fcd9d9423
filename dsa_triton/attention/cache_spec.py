"""Registry entry of the paged-cache append (``paged_append``): :func:`~.cache.append_tokens`'s kernel.

Config space: ``BLOCK_T`` tokens per step of a program's loop (at most the page), ``BLOCK_D`` latent columns per
copy program, ``num_warps``. Shapes: ``P`` page size, ``D`` latent width (0: no latent cache), ``DK`` indexer key
width (0: no indexer cache), ``N`` new tokens, ``B`` work items (sequences); problem-only ``ctx``: tokens already
in each sequence.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..checks import exact_mismatch
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import cache, cache_kernels, cache_reference
from .cache_reference import append_torch


def _items_to_slots(items: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token physical slots, the touched pages and their fill after the append (device tensors)."""
    src, count, page, first = items.long().unbind(1)
    token_item = torch.repeat_interleave(torch.arange(items.shape[0], device=items.device), count)
    within = torch.arange(token_item.numel(), device=items.device) - (torch.cumsum(count, 0) - count)[token_item]
    slots = page[token_item] * P + first[token_item] + within
    return slots, page, first + count


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    """A cache with ``ctx`` tokens per sequence already in it (the last page partly full), and new tokens."""
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *size, dtype=torch.float32: torch.randn(*size, generator=g, device=device, dtype=dtype)  # noqa: E731
    B, N, P, D, DK, ctx = (shape[k] for k in ("B", "N", "P", "D", "DK", "ctx"))
    per_seq = N // B
    pages_per_seq = cdiv(ctx + per_seq, P)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16
    paged = cache.PagedCache(B * pages_per_seq + 1, P, B, pages_per_seq, D, DK, dtype, device, poison=True)
    # the existing context is written by the reference, so the inputs never depend on the kernel
    perm = torch.randperm(B * pages_per_seq, generator=g, device=device).view(B, pages_per_seq) + 1  # page 0 unused
    paged.block_table.copy_(perm.int())
    old_slots = (perm[:, :, None] * P + torch.arange(P, device=device)).view(B, -1)[:, :ctx].reshape(-1)
    old_fill = (ctx - torch.arange(pages_per_seq, device=device) * P).clamp(0, P).repeat(B)
    append_torch(paged.kv, paged.ik, paged.ik_scale, paged.summaries, randn(B * ctx, D, dtype=dtype),
                 randn(B * ctx, DK), old_slots, perm.reshape(-1)[old_fill > 0], old_fill[old_fill > 0])
    items = [item for b, pages in enumerate(perm.tolist())
             for item in cache.page_items(b * per_seq, ctx, per_seq, pages, P)]
    return {
        "kv_cache": paged.kv, "ik": paged.ik, "ik_scale": paged.ik_scale, "summaries": paged.summaries,
        "kv": randn(N, D, dtype=dtype),
        "index_k": randn(N, DK, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32),
        "items": torch.tensor(items, dtype=torch.int32).to(device),
    }


def _run(inputs: dict, config: dict):
    cache.launch_append(inputs["kv_cache"], inputs["ik"], inputs["ik_scale"], inputs["summaries"],
                        inputs["kv"], inputs["index_k"], inputs["items"], config)
    return inputs["kv_cache"], inputs["ik"], inputs["ik_scale"], inputs["summaries"]


def _reference(inputs: dict):
    kv_cache, ik, ik_scale, summaries = (inputs[k].clone() for k in ("kv_cache", "ik", "ik_scale", "summaries"))
    append_torch(kv_cache, ik, ik_scale, summaries, inputs["kv"], inputs["index_k"],
                 *_items_to_slots(inputs["items"], ik.shape[1]))
    return kv_cache, ik, ik_scale, summaries


def _compare(out, ref) -> str | None:
    return exact_mismatch(zip(("kv_cache", "ik", "ik_scale", "summaries"), out, ref))


def _cost(phase: str, shape) -> Cost:
    N, D, DK, B = shape["N"], shape["D"], shape["DK"], shape["B"]
    pages = B * cdiv(N // B, shape["P"]) if phase == "prefill" else B
    kv_bytes = 2 * N * D * 2
    index_bytes = N * DK * 2 + N * (DK + 4) + pages * 2 * DK * 2 * 2  # bf16 summaries, read and written
    return Cost(bytes=kv_bytes + index_bytes)


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        if phase == "prefill":
            return [{"B": 4, "N": 16384, "P": 64, "D": 576, "DK": 128, "ctx": 100}]
        return [{"B": 64, "N": 64, "P": 64, "D": 576, "DK": 128, "ctx": 100}]
    if phase == "prefill":
        return [{"B": 2, "N": 40, "P": 16, "D": 48, "DK": 32, "ctx": 5}]
    return [{"B": 3, "N": 3, "P": 16, "D": 48, "DK": 32, "ctx": 17}]


def _default(phase: str, shape) -> dict:
    if phase == "decode":
        return {"BLOCK_T": 1, "BLOCK_D": 128, "num_warps": 2}
    return {"BLOCK_T": min(32, shape["P"]), "BLOCK_D": 128, "num_warps": 4}


SPEC = registry.register(KernelSpec(
    name="paged_append",
    phases=("prefill", "decode"),
    space={"BLOCK_T": (1, 8, 16, 32, 64), "BLOCK_D": (64, 128, 256), "num_warps": (1, 2, 4, 8)},
    default=_default,
    fixed_dims=("P", "D", "DK"),
    bucketed_dims=("N", "B"),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=_compare,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=lambda c, s: "BLOCK_T larger than the page" if c["BLOCK_T"] > s["P"] else None,
    baseline=lambda inputs: append_torch(*(inputs[k] for k in ("kv_cache", "ik", "ik_scale", "summaries", "kv", "index_k")),
                                         *_items_to_slots(inputs["items"], inputs["ik"].shape[1])),
    baseline_name="torch index_put + quantize + page min/max",
    source_modules=(cache_reference, cache_kernels, cache, sys.modules[__name__]),
))
