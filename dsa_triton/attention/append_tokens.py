"""Appending new tokens to the paged caches of one DSA layer: :func:`append_tokens`.

The append kernel (:mod:`.append_tokens_kernels`) takes *work items*, one per (sequence, touched page):
``items[n, 4]`` int32 = (first source row, token count, physical page, first slot in the page); an item
never crosses a page and each page is written by one program. Launch configs come from the tuning database
through the registry (:data:`LAUNCH`: ``BLOCK_T`` tokens per step of a program's loop, at most the page; ``BLOCK_D``
latent columns per copy program, unused by the FP8 append, which takes one program per 128-value group;
``num_warps``) unless ``config`` is given. Shapes: ``P`` page size, ``D`` latent row width (0: no latent cache),
``DK`` indexer key width (0: no indexer cache), ``fp8`` 1 into an FP8 latent cache, 2 into MODEL1 FP8 pages (whose
``D`` is the width of the new rows and ``Dr`` their rope values), ``N`` new tokens, ``B`` work items.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import check_kernel_device, check_tensor
from ..hostmath import cdiv, next_pow2
from ..launch import launch_with
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..registry import LaunchSpace
from .append_tokens_kernels import append_kernel
from .formats import (LATENT_GROUP, MODEL1_AMAX_FLOOR, MODEL1_TILE, PAGE_SIZES, ROW_DTYPES, SUMMARY_DTYPES,
                      check_fp8_latent_layout, fp8_latent_bytes, is_model1_width)


def _default(phase: str, shape) -> dict:
    if phase == "decode":
        return {"BLOCK_T": 1, "BLOCK_D": 128, "num_warps": 2}
    return {"BLOCK_T": min(32, shape["P"]), "BLOCK_D": 128, "num_warps": 4}


def _constraint(config: dict, shape) -> str | None:
    if config["BLOCK_T"] > shape["P"]:
        return "BLOCK_T larger than the page"
    if shape["fp8"] and config["BLOCK_D"] != 128:
        return "the FP8 append copies 128-value groups: BLOCK_D is 128"
    return None


LAUNCH = LaunchSpace(
    name="append_tokens",
    phases=("prefill", "decode"),
    space={"BLOCK_T": (1, 8, 16, 32, 64), "BLOCK_D": (64, 128, 256), "num_warps": (1, 2, 4, 8)},
    default=_default,
    fixed_dims=("P", "D", "Dr", "DK", "fp8"),
    bucketed_dims=("N", "B"),
    constraint=_constraint,
)


class AppendPlan(NamedTuple):
    """What an append's checks and launch config work out from its arguments' metadata."""

    P: int  # page size
    n: int  # new tokens
    num_pages: int
    config: dict
    grid: tuple[int, int] | None  # (items, parts: latent column blocks, or groups and rope, then the index part)
    meta: dict  # the kernel's keyword arguments
    D: int  # latent values a row (0: no latent part)
    DK: int  # indexer key width (0: no index part)


def launch_append(plan: AppendPlan, kv_cache, ik, ik_scale, summaries, kv, index_k, items) -> None:
    """The append kernel on ``plan``'s launch (nothing when there are no items or no parts)."""
    if plan.grid is None:
        return
    has_kv, has_index = kv is not None, index_k is not None
    dummy = items  # never dereferenced: the constexpr flags remove those loads
    launch_with(append_kernel, plan.grid, plan.meta,
        items,
        kv if has_kv else dummy, kv_cache if has_kv else dummy, kv.stride(0) if has_kv else 0,
        index_k if has_index else dummy, ik if has_index else dummy,
        ik_scale if has_index else dummy, summaries if has_index else dummy,
        index_k.stride(0) if has_index else 0,
        plan.D, plan.DK,
    )


def _plan(P: int, n: int, num_pages: int, n_items: int, config: dict, kv_cache, ik, kv, rope_dim: int) -> AppendPlan:
    """The launch of an append whose metadata passed the checks."""
    has_kv, has_index = kv is not None, ik is not None
    D = kv_cache.shape[-1] if has_kv else 0
    DK = ik.shape[-1] if has_index else 0
    meta = dict(P=P, HAS_KV=has_kv, HAS_INDEX=int(has_index), BLOCK_T=config["BLOCK_T"], BLOCK_D=config["BLOCK_D"],
                DKP=next_pow2(max(DK, 16)), num_warps=config["num_warps"])
    if has_kv and is_model1(kv_cache, kv, rope_dim):  # one part per 64-value tile, one for the rope and pad bytes
        D = kv.shape[-1] - rope_dim
        meta.update(KV_MODEL1=True, PAGE_BYTES=kv_cache.stride(0), DR=rope_dim, BLOCK_R=next_pow2(max(rope_dim, 16)),
                    FLOOR=MODEL1_AMAX_FLOOR)
        kv_parts = D // MODEL1_TILE + 1
    elif has_kv and kv_cache.dtype == torch.uint8:  # one part per 128-value latent group, one for the rope values
        D = kv.shape[-1] - rope_dim
        meta.update(KV_FP8=True, ROW_BYTES=kv_cache.shape[-1], ROPE_AT=D + 4 * cdiv(D, LATENT_GROUP), DR=rope_dim,
                    GROUP=min(LATENT_GROUP, next_pow2(D)), BLOCK_R=next_pow2(max(rope_dim, 16)))
        kv_parts = cdiv(D, LATENT_GROUP) + int(rope_dim > 0)
    else:
        kv_parts = cdiv(D, config["BLOCK_D"]) if has_kv else 0
    parts = kv_parts + int(has_index)
    grid = (n_items, parts) if n_items and parts else None
    return AppendPlan(P, n, num_pages, config, grid, meta, D, DK)


def is_model1(kv_cache: torch.Tensor, kv: torch.Tensor, rope_dim: int) -> bool:
    """Whether a uint8 ``kv_cache`` holds MODEL1 FP8 pages of ``kv``'s rows (by its width)."""
    return kv_cache.dtype == torch.uint8 and is_model1_width(kv_cache.shape[-1], kv.shape[1], rope_dim)


def check_cache_tensors(kv_cache, ik, ik_scale, summaries, kv, index_k,
                         rope_dim: int = 64) -> tuple[int, int, torch.device]:
    """Validate cache and new-token tensors; returns (page size, token count, device)."""
    if kv is None and index_k is None:
        raise ValueError("kv, index_k: at least one of them must be given")
    P = n = device = None
    if kv is not None:
        check_tensor("kv_cache", kv_cache, ndim=3)
        device = check_kernel_device("kv_cache", kv_cache)
        P, D = kv_cache.shape[1], kv_cache.shape[2]
        if kv_cache.dtype == torch.uint8:  # FP8 latent cache: rows of D bytes hold kv's rows quantized
            check_tensor("kv", kv, dtype=ROW_DTYPES, ndim=2, device=device)
            if type(rope_dim) is not int or not 0 <= rope_dim < kv.shape[1]:
                raise ValueError(f"rope_dim: must be an integer in [0, {kv.shape[1]}) (kv's width), got {rope_dim!r}")
        if kv_cache.dtype == torch.uint8 and is_model1(kv_cache, kv, rope_dim):  # MODEL1 pages: the stride is free
            if kv_cache.stride()[1:] != (D, 1) or kv_cache.stride(0) < P * D or kv_cache.stride(0) % 2:
                raise ValueError(f"kv_cache: MODEL1 pages need token stride {D} and an even page stride >= {P * D} "
                                 f"bytes, got strides {kv_cache.stride()}")
        elif not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache: must be contiguous, got strides {kv_cache.stride()}")
        elif kv_cache.dtype == torch.uint8:
            check_fp8_latent_layout("rope_dim", kv.shape[1] - rope_dim, rope_dim)
            if fp8_latent_bytes(kv.shape[1] - rope_dim, rope_dim) != D:
                raise ValueError(f"kv_cache: FP8 rows of {kv.shape[1] - rope_dim} latent + {rope_dim} rope values "
                                 f"take {fp8_latent_bytes(kv.shape[1] - rope_dim, rope_dim)} bytes (MODEL1 pages: "
                                 f"a multiple of {MODEL1_TILE} quantized values, model1_bytes), got {D}")
        else:
            check_tensor("kv", kv, dtype=kv_cache.dtype, shape=(None, D), device=device)
        n = kv.shape[0]
    if index_k is not None:
        check_tensor("ik", ik, dtype=torch.float8_e4m3fn, ndim=3, device=device)
        device = device or check_kernel_device("ik", ik)
        num_pages, P2, DK = ik.shape
        if P is not None and (P2 != P or num_pages != kv_cache.shape[0]):
            raise ValueError(f"ik: shape {tuple(ik.shape)} does not match kv_cache {tuple(kv_cache.shape)} in pages")
        P = P2
        check_tensor("ik_scale", ik_scale, dtype=torch.float32, shape=(num_pages, P), device=device)
        check_tensor("summaries", summaries, dtype=SUMMARY_DTYPES, shape=(num_pages, 2, DK), device=device)
        for name, t in (("ik", ik), ("ik_scale", ik_scale), ("summaries", summaries)):
            if not t.is_contiguous():
                raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")
        check_tensor("index_k", index_k, dtype=(torch.float32, torch.bfloat16, torch.float16),
                     shape=(None, DK), device=device)
        if n is not None and index_k.shape[0] != n:
            raise ValueError(f"index_k: {index_k.shape[0]} rows, but kv has {n}")
        n = index_k.shape[0]
    if P not in PAGE_SIZES:
        name = "kv_cache" if kv is not None else "ik"
        raise ValueError(f"{name}: page size (dimension 1) must be one of {PAGE_SIZES}, got {P}")
    return P, n, device


def append_tokens(
    kv_cache: torch.Tensor | None,
    ik: torch.Tensor | None,
    ik_scale: torch.Tensor | None,
    summaries: torch.Tensor | None,
    kv: torch.Tensor | None,
    index_k: torch.Tensor | None,
    items: torch.Tensor,
    *,
    rope_dim: int = 64,
    config: dict | None = None,
    check_values: bool = True,
) -> None:
    """Write new tokens into the paged caches in place (the functional form of :meth:`PagedCache.append`).

    kv_cache ``[num_pages, P, D]``, kv ``[N, D]`` same dtype; or an FP8 latent cache ``kv_cache[num_pages, P,
    bytes]`` uint8 (layout: :mod:`.formats`) and kv ``[N, D]`` fp32 / bf16 / fp16, whose last ``rope_dim``
    values are the rope part (kept as bf16) and the others the latent part (quantized, one power-of-two scale
    per 128 values; ``bytes = fp8_latent_bytes(D - rope_dim, rope_dim)``, 656 for 512 + 64); or MODEL1 FP8 pages
    ``[num_pages, P, model1_bytes(D - rope_dim, rope_dim)]`` (584 for DeepSeek-V4's 448 + 64: one ue8m0 scale per
    64 values; the page stride free, as FlashMLA allocates them: :func:`.formats.model1_cache`); ik
    ``[num_pages, P, DK]`` e4m3, ik_scale ``[num_pages, P]`` fp32, summaries ``[num_pages, 2, DK]`` bf16 or fp32,
    index_k ``[N, DK]`` float.
    ``items[n, 4]`` int32: (first row of kv/index_k, token count, physical page, first slot in the page).
    Either the latent or the index part may be ``None`` (both its cache and its new tokens). Shapes, dtypes,
    devices and ``config`` are always checked (once per tensor metadata and config), before anything is written.

    ``check_values=True`` also checks on the device, in one transfer, what the kernel relies on, and raises a
    ValueError naming the argument before any write: every item's rows ``src .. src + count`` lie in ``[0, N)``
    (``count >= 0``), its page in ``[0, num_pages)``, its slots ``first .. first + count`` in ``[0, P]``, no page
    appears in two items; and every value of ``kv`` and ``index_k`` is finite. ``check_values=False`` (CUDA
    graphs, hot loops with items built by a trusted planner) skips these checks and never waits on the device:
    the caller then promises the item conditions above, and an item that breaks them makes the kernel read
    outside ``kv`` / ``index_k`` or write outside the caches.

    Non-finite values with ``check_values=False``: they propagate as NaN, never as a finite wrong number. A
    ``kv`` row is copied as it is. An ``index_k`` row with a NaN or an inf gets a NaN scale and NaN key bytes
    (so every logit of that key is NaN), and its page's summaries turn NaN in every dimension and stay NaN
    until the page is written again from slot 0 (so the page's bound is NaN, which page selection never takes).
    """
    plan = append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim)
    if check_values:
        check_append_values(kv, index_k, items, plan.n, plan.num_pages, plan.P)
    launch_append(plan, kv_cache, ik, ik_scale, summaries, kv, index_k, items)


def append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim: int = 64) -> AppendPlan:
    """The checked plan of an append: cached per tensor metadata, rope_dim and config."""
    key, plan = _APPEND_PLANS.find((kv_cache, ik, ik_scale, summaries, kv, index_k, items), (rope_dim,), config)
    if plan is None:
        plan = _APPEND_PLANS.put(key, _checked_append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items,
                                                           config, rope_dim))
    return plan


_APPEND_PLANS = PlanCache()


def _checked_append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim) -> AppendPlan:
    """The metadata checks of :func:`append_tokens`, and its plan."""
    P, n, device = check_cache_tensors(kv_cache, ik, ik_scale, summaries, kv, index_k, rope_dim)
    check_tensor("items", items, dtype=torch.int32, shape=(None, 4), device=device)
    if not items.is_contiguous():
        raise ValueError(f"items: must be contiguous, got strides {items.stride()}")
    num_pages = (kv_cache if kv is not None else ik).shape[0]
    phase = "decode" if items.shape[0] == n else "prefill"
    shape = append_shape(kv_cache, ik, kv, rope_dim, n, items.shape[0])
    config = LAUNCH.launch_config(phase, shape, device) if config is None else LAUNCH.validate(config, shape)
    return _plan(P, n, num_pages, items.shape[0], config, kv_cache, ik, kv, rope_dim)


def check_append_values(kv, index_k, items: torch.Tensor | None, n: int, num_pages: int, P: int) -> None:
    """Token ranges in ``[0, n)``, pages in ``[0, num_pages)``, slots inside a page, distinct pages (when ``items``
    is given); finite new tokens: one transfer."""
    checks = []
    if items is not None and items.shape[0]:
        src, count, page, first = items.long().unbind(1)
        pages = page.sort().values
        checks += [(((src < 0) | (count < 0) | (src + count > n)).any(), f"items: token ranges must lie in [0, {n})"),
                   (((page < 0) | (page >= num_pages)).any(), f"items: pages must lie in [0, {num_pages})"),
                   (((first < 0) | (first + count > P)).any(), f"items: slots must stay inside a page of {P}"),
                   ((pages[1:] == pages[:-1]).any(), "items: each page may appear in one item only")]
    checks += [((~t.isfinite()).any(), f"{name}: every value must be finite (NaN or inf found)")
               for name, t in (("kv", kv), ("index_k", index_k)) if t is not None and t.numel()]
    if checks:
        for failed, (_, message) in zip(torch.stack([bad for bad, _ in checks]).tolist(), checks):
            if failed:
                raise ValueError(message)


def append_shape(kv_cache, ik, kv, rope_dim: int, n_tokens: int, n_items: int) -> dict[str, int]:
    """The registry shape of an append (:data:`LAUNCH`); into an FP8 cache ``D`` is the new rows' width (the cache's
    is in bytes) and ``Dr`` their rope values; ``fp8`` 1 the FP8 latent layout, 2 MODEL1."""
    cache = kv_cache if kv_cache is not None else ik
    fp8 = kv is not None and kv_cache.dtype == torch.uint8
    return {"P": cache.shape[1], "D": kv.shape[1] if fp8 else kv_cache.shape[-1] if kv_cache is not None else 0,
            "Dr": rope_dim if fp8 else 0, "DK": ik.shape[-1] if ik is not None else 0,
            "fp8": 2 if fp8 and is_model1(kv_cache, kv, rope_dim) else int(fp8), "N": n_tokens, "B": n_items}


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("append_tokens", mutates_args=("kv_cache", "ik", "ik_scale", "summaries"))
def append_tokens_op(kv_cache: torch.Tensor | None, ik: torch.Tensor | None, ik_scale: torch.Tensor | None,
                     summaries: torch.Tensor | None, kv: torch.Tensor | None, index_k: torch.Tensor | None,
                     items: torch.Tensor, check_values: bool = True, config: str | None = None,
                     rope_dim: int = 64) -> None:
    """:func:`dt.append_tokens`: new tokens ``kv[N, D]`` / ``index_k[N, DK]`` into the paged caches, in place
    (``rope_dim``: the rope values of rows into an FP8 cache).

    ``items[n, 4]`` int32 = (first source row, token count, physical page, first slot in the page), one per touched
    page, pages distinct. A decode step of ``B`` sequences at logical positions ``pos[B]`` is
    ``items = stack([arange(B), ones(B), block_table[b, pos // P], pos % P], 1)``: device ops, capturable. The block
    table and the lengths are the caller's (the op does not update them)."""
    append_tokens(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config=op_config(config),
                  check_values=check_values, rope_dim=rope_dim)


@append_tokens_op.register_fake
def _(kv_cache, ik, ik_scale, summaries, kv, index_k, items, check_values=True, config=None, rope_dim=64):
    return None
