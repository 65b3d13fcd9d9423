"""Paged caches of one DSA layer and the append op that fills them.

Layout (page size ``P`` in 16, 32, 64, 128; every size a parameter):

- latent KV cache ``kv[num_pages, P, kv_dim]`` (bf16 on GPU; 576 = 512 latent + 64 rope), or the FP8 latent
  cache ``kv[num_pages, P, bytes]`` uint8 (``kv_dtype="fp8"``: 656 bytes a token for 512 + 64, DeepSeek's layout:
  e4m3 latent values, one fp32 power-of-two scale per 128 of them, bf16 rope values; :mod:`.cache_reference`),
  quantized on append;
- indexer K cache ``ik[num_pages, P, index_dim]`` float8_e4m3fn and ``ik_scale[num_pages, P]`` fp32,
  one power-of-two scale per token vector, quantized on append (DeepSeek-V3.2 ``act_quant``, ue8m0);
- page summaries ``summaries[num_pages, 2, index_dim]`` bf16 (or fp32): ``[:, 0]`` = ``pmax``, ``[:, 1]`` =
  ``pmin``, the element-wise max / min of the page's dequantized indexer keys, kept current by every append.
  bf16 holds them exactly (an e4m3 value times a power of two has 4 significant bits) in half the bytes;
- ``block_table[max_seqs, max_pages_per_seq]`` int32 (-1 = no page), ``seq_lens[max_seqs]`` int32.

Token ``i`` of sequence ``b`` lives at physical slot ``block_table[b, i // P] * P + i % P``.

The append kernel (:mod:`.cache_kernels`) takes *work items*, one per (sequence, touched page):
``items[n, 4]`` int32 = (first source row, token count, physical page, first slot in the page); an item
never crosses a page and each page is written by one program. Launch configs come from the tuning database
through the registry (kernels ``paged_append`` and, into an FP8 latent cache, ``paged_append_fp8``, see
:mod:`.cache_spec`) unless ``config`` is given.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

from ..checks import PlanCache, check_device, check_kernel_device, check_positive, check_tensor
from ..hostmath import cdiv, next_pow2
from ..launch import cached_meta, launch_with
from .cache_kernels import append_kernel
from .cache_reference import LATENT_GROUP, fp8_latent_bytes
from .cache_spec import FP8_SPEC, SPEC

PAGE_SIZES = (16, 32, 64, 128)
SUMMARY_DTYPES = (torch.bfloat16, torch.float32)
KV_DTYPES = (None, "fp8")  # PagedCache(kv_dtype=...): rows in ``dtype``, or the FP8 latent layout
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # PagedCache(dtype=...): latent rows kept as they are
FP8_SOURCE_DTYPES = ROW_DTYPES  # new rows appended to an FP8 latent cache


def check_fp8_latent_layout(name: str, d_latent: int, d_rope: int) -> None:
    """The FP8 latent layout's sizes: ``d_latent >= 1`` a multiple of 4 and ``d_rope >= 0`` even, so every fp32
    scale and bf16 rope value is aligned in every row; else a ValueError naming ``name``."""
    if d_latent < 1 or d_latent % 4 or d_rope < 0 or d_rope % 2:
        raise ValueError(f"{name}: an FP8 latent cache needs a latent width that is a positive multiple of 4 and an "
                         f"even rope width, got {d_latent} + {d_rope}")


@cached_meta
def _append_meta(P: int, has_kv: bool, has_index: bool, DK: int, block_t: int, block_d: int, num_warps: int,
                 D: int, row_bytes: int | None, rope_dim: int | None) -> dict:
    """The append kernel's keyword arguments; ``row_bytes`` and ``rope_dim``: of an FP8 latent cache's rows (None:
    rows in kv's dtype)."""
    meta = dict(P=P, HAS_KV=has_kv, HAS_INDEX=int(has_index), BLOCK_T=block_t, BLOCK_D=block_d,
                DKP=next_pow2(max(DK, 16)), num_warps=num_warps)
    if row_bytes is not None:
        meta.update(KV_FP8=True, ROW_BYTES=row_bytes, ROPE_AT=D + 4 * cdiv(D, LATENT_GROUP), DR=rope_dim,
                    GROUP=min(LATENT_GROUP, next_pow2(D)), BLOCK_R=next_pow2(max(rope_dim, 16)))
    return meta


def launch_append(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim: int = 64) -> None:
    n_items = items.shape[0]
    has_kv, has_index = kv is not None, index_k is not None
    if n_items == 0 or not (has_kv or has_index):
        return
    cache = kv_cache if has_kv else ik
    P = cache.shape[1]
    D = kv_cache.shape[-1] if has_kv else 0
    DK = ik.shape[-1] if has_index else 0
    row_bytes = rope = None
    if has_kv and kv_cache.dtype == torch.uint8:  # one part per 128-value latent group, one for the rope values
        D, row_bytes, rope = kv.shape[-1] - rope_dim, kv_cache.shape[-1], rope_dim
        kv_parts = cdiv(D, LATENT_GROUP) + int(rope_dim > 0)
    else:
        kv_parts = cdiv(D, config["BLOCK_D"]) if has_kv else 0
    meta = _append_meta(P, has_kv, has_index, DK, config["BLOCK_T"], config["BLOCK_D"], config["num_warps"],
                        D, row_bytes, rope)
    dummy = items  # never dereferenced: the constexpr flags remove those loads
    launch_with(append_kernel, (n_items, kv_parts + int(has_index)), meta,
        items,
        kv if has_kv else dummy, kv_cache if has_kv else dummy, kv.stride(0) if has_kv else 0,
        index_k if has_index else dummy, ik if has_index else dummy,
        ik_scale if has_index else dummy, summaries if has_index else dummy,
        index_k.stride(0) if has_index else 0,
        D, DK,
    )


def _check_cache_tensors(kv_cache, ik, ik_scale, summaries, kv, index_k,
                         rope_dim: int = 64) -> tuple[int, int, torch.device]:
    """Validate cache and new-token tensors; returns (page size, token count, device)."""
    if kv is None and index_k is None:
        raise ValueError("kv, index_k: at least one of them must be given")
    P = n = device = None
    if kv is not None:
        check_tensor("kv_cache", kv_cache, ndim=3)
        device = check_kernel_device("kv_cache", kv_cache)
        if not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache: must be contiguous, got strides {kv_cache.stride()}")
        P, D = kv_cache.shape[1], kv_cache.shape[2]
        if kv_cache.dtype == torch.uint8:  # FP8 latent cache: rows of D bytes hold kv's rows quantized
            check_tensor("kv", kv, dtype=FP8_SOURCE_DTYPES, ndim=2, device=device)
            if type(rope_dim) is not int or not 0 <= rope_dim < kv.shape[1]:
                raise ValueError(f"rope_dim: must be an integer in [0, {kv.shape[1]}) (kv's width), got {rope_dim!r}")
            check_fp8_latent_layout("rope_dim", kv.shape[1] - rope_dim, rope_dim)
            if fp8_latent_bytes(kv.shape[1] - rope_dim, rope_dim) != D:
                raise ValueError(f"kv_cache: FP8 rows of {kv.shape[1] - rope_dim} latent + {rope_dim} rope values "
                                 f"take {fp8_latent_bytes(kv.shape[1] - rope_dim, rope_dim)} bytes, got {D}")
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
    bytes]`` uint8 (layout: :mod:`.cache_reference`) and kv ``[N, D]`` fp32 / bf16 / fp16, whose last ``rope_dim``
    values are the rope part (kept as bf16) and the others the latent part (quantized, one power-of-two scale
    per 128 values; ``bytes = fp8_latent_bytes(D - rope_dim, rope_dim)``, 656 for 512 + 64); ik
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
    P, n, num_pages, config = _append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim)
    if check_values:
        _check_values(kv, index_k, items, n, num_pages, P)
    launch_append(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim)


def _append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim: int = 64) -> tuple:
    """The checked plan of an append, ``(P, N, num_pages, config)``: cached per tensor metadata, rope_dim and
    config."""
    key, plan = _APPEND_PLANS.find((kv_cache, ik, ik_scale, summaries, kv, index_k, items), (rope_dim,), config)
    if plan is None:
        plan = _APPEND_PLANS.put(key, _checked_append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items,
                                                           config, rope_dim))
    return plan


_APPEND_PLANS = PlanCache()


def _checked_append_plan(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config, rope_dim) -> tuple:
    """The metadata checks of :func:`append_tokens`; returns ``(P, N, num_pages, config)``."""
    P, n, device = _check_cache_tensors(kv_cache, ik, ik_scale, summaries, kv, index_k, rope_dim)
    check_tensor("items", items, dtype=torch.int32, shape=(None, 4), device=device)
    if not items.is_contiguous():
        raise ValueError(f"items: must be contiguous, got strides {items.stride()}")
    num_pages = (kv_cache if kv is not None else ik).shape[0]
    phase = "decode" if items.shape[0] == n else "prefill"
    fp8 = kv is not None and kv_cache.dtype == torch.uint8
    shape = _append_shape(kv_cache, ik, n, items.shape[0])
    if fp8:  # the latent width as kv gives it (the cache's is in bytes), and the rope width
        shape = {**shape, "D": kv.shape[1], "Dr": rope_dim}
    spec = FP8_SPEC if fp8 else SPEC
    if config is None:
        config = spec.launch_config(phase, shape, device)
    else:
        spec.validate(config, shape)
    return P, n, num_pages, config


def _check_values(kv, index_k, items: torch.Tensor | None, n: int, num_pages: int, P: int) -> None:
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


def _append_shape(kv_cache, ik, n_tokens: int, n_items: int) -> dict[str, int]:
    cache = kv_cache if kv_cache is not None else ik
    return {"P": cache.shape[1], "D": kv_cache.shape[-1] if kv_cache is not None else 0,
            "DK": ik.shape[-1] if ik is not None else 0, "N": n_tokens, "B": n_items}


def as_index(name: str, value) -> int:
    """``value`` as an ``int`` if it is an integer (Python, NumPy or a one-element integer tensor), not a bool;
    else a ValueError naming ``name`` (``int()`` would truncate ``1.7`` and parse ``"1"``)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}: must be integers, got {value!r}")


def as_indices(name: str, values) -> list[int]:
    """``values`` (a sequence of integers or a 1-D integer tensor) as a list of ``int``; else a ValueError naming
    ``name`` (None, a string, a set, a float or a bool among them)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(values.shape)}")
    elif not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(f"{name}: expected a sequence of integers, got {type(values).__name__}")
    return [as_index(name, v) for v in values]


def page_items(row: int, start: int, n: int, pages: Sequence[int], P: int) -> list[tuple[int, int, int, int]]:
    """The work items of appending source rows ``row .. row + n`` at logical positions ``start .. start + n`` of a
    sequence whose logical page ``j`` is physical page ``pages[j]``: one ``(row, count, page, first slot)`` per
    touched page."""
    items, pos, end = [], start, start + n
    while pos < end:
        count = min(end - pos, P - pos % P)
        items.append((row, count, pages[pos // P], pos % P))
        row, pos = row + count, pos + count
    return items


class PageAllocator:
    """A free list of physical pages: ``allocate(n)`` hands out pages, ``free(pages)`` takes them back.

    A call that raises changes nothing."""

    def __init__(self, num_pages: int):
        check_positive("num_pages", num_pages)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray([1]) * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def peek(self, n: int) -> list[int]:
        """The ``n`` pages the next ``allocate(n)`` hands out, without taking them."""
        n = as_index("n", n)
        if n < 0:
            raise ValueError(f"n: must be an integer >= 0, got {n!r}")
        if n > len(self._free):
            raise ValueError(f"n: {n} pages requested, {len(self._free)} free")
        return self._free[len(self._free) - n:][::-1]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` (>= 0) free pages off the list; returns their ids. ``allocate(a + b)`` hands out the pages of
        ``allocate(a)`` and then ``allocate(b)``, in that order."""
        pages = self.peek(n)
        del self._free[len(self._free) - len(pages):]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return ``pages`` (distinct, allocated page ids) to the free list (the next ``allocate`` hands them out
        first). Anything else (not a sequence of integers, a page outside ``[0, num_pages)``, free or given twice)
        raises a ValueError naming ``pages``."""
        pages = as_indices("pages", pages)
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"pages: must lie in [0, {self.num_pages}), got {p}")
            if self._is_free[p]:
                raise ValueError(f"pages: page {p} is free already")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages: must be distinct, got {pages}")
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(reversed(pages))


class PagedCache:
    """Paged latent KV + FP8 indexer K caches of one layer, with block table, lengths and allocator.

    ``kv_dim`` or ``index_dim`` may be 0 to leave that cache out. ``dtype`` (of the latent rows): fp32, bf16 or
    fp16. ``device``: default :func:`~dsa_triton.runtime.default_device`. ``poison=True`` fills every slot with
    NaN (tests: a slot that was never written must never reach an output). ``summary_dtype``: bf16
    (exact, the default) or fp32. ``max_pages_per_seq`` (default ``num_pages``) is the block table's width.
    ``kv_dtype``: None keeps latent rows in ``dtype``; ``"fp8"`` keeps them in DeepSeek's FP8 latent layout
    (``kv`` uint8 ``[num_pages, P, fp8_latent_bytes(kv_dim - rope_dim, rope_dim)]``: 656 bytes for 576 = 512 + 64;
    the last ``rope_dim`` values of a row stay bf16; poisoned bytes are 0xFF, NaN in every part), and
    :meth:`append` takes fp32, bf16 or fp16 rows. ``bytes_per_token`` says what a token costs.
    Host-side bookkeeping (lengths, pages) lives in Python lists, so ``append`` with ``check_values=False``
    never waits on the device. A call that raises changes nothing: not the lengths, the block table, the
    allocator or the caches.

    Construction checks every argument before allocating: a size, dtype, device or layout it cannot hold raises a
    ValueError naming the argument.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 64,
        max_seqs: int = 1,
        max_pages_per_seq: int | None = None,
        kv_dim: int = 576,
        index_dim: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        poison: bool = False,
        summary_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: str | None = None,
        rope_dim: int = 64,
    ):
        from ..runtime import default_device

        check_positive("num_pages", num_pages)
        check_positive("max_seqs", max_seqs)
        if type(page_size) is not int or page_size not in PAGE_SIZES:  # 16.0 == 16 would reach torch.full
            raise ValueError(f"page_size: must be one of {PAGE_SIZES}, got {page_size!r}")
        for name, dim in (("kv_dim", kv_dim), ("index_dim", index_dim)):
            if type(dim) is not int or dim < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {dim!r}")
        if kv_dim + index_dim == 0:
            raise ValueError("kv_dim, index_dim: must not both be 0")
        if not isinstance(dtype, torch.dtype) or dtype not in ROW_DTYPES:
            raise ValueError(f"dtype: must be one of {ROW_DTYPES}, got {dtype!r}")
        if summary_dtype not in SUMMARY_DTYPES:
            raise ValueError(f"summary_dtype: must be one of {SUMMARY_DTYPES}, got {summary_dtype}")
        if not any(kv_dtype is k or kv_dtype == k for k in KV_DTYPES):
            raise ValueError(f"kv_dtype: must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype == "fp8" and kv_dim:
            if type(rope_dim) is not int or not 0 <= rope_dim < kv_dim:
                raise ValueError(f"rope_dim: must be an integer in [0, {kv_dim}) (kv_dim), got {rope_dim!r}")
            check_fp8_latent_layout("kv_dim, rope_dim", kv_dim - rope_dim, rope_dim)
        max_pages_per_seq = num_pages if max_pages_per_seq is None else check_positive("max_pages_per_seq",
                                                                                      max_pages_per_seq)
        device = check_device("device", device) if device is not None else default_device()
        self.page_size, self.max_seqs, self.max_pages_per_seq = page_size, max_seqs, max_pages_per_seq
        self.kv_dim, self.kv_dtype, self.rope_dim = kv_dim, kv_dtype, rope_dim
        fill = float("nan") if poison else 0.0
        new = lambda shape, dt: torch.full(shape, fill, dtype=dt, device=device)  # noqa: E731
        if kv_dim and kv_dtype == "fp8":  # 0xFF: NaN as e4m3, as an fp32 scale and as bf16
            self.kv = torch.full((num_pages, page_size, fp8_latent_bytes(kv_dim - rope_dim, rope_dim)),
                                 0xFF if poison else 0, dtype=torch.uint8, device=device)
        else:
            self.kv = new((num_pages, page_size, kv_dim), dtype) if kv_dim else None
        ik_bytes = torch.full((num_pages, page_size, index_dim), 0x7F if poison else 0, dtype=torch.uint8, device=device)
        self.ik = ik_bytes.view(torch.float8_e4m3fn) if index_dim else None  # 0x7F: e4m3 NaN
        self.ik_scale = new((num_pages, page_size), torch.float32) if index_dim else None
        self.summaries = new((num_pages, 2, index_dim), summary_dtype) if index_dim else None
        self.block_table = torch.full((max_seqs, max_pages_per_seq), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.allocator = PageAllocator(num_pages)
        self._lens = [0] * max_seqs
        self._pages: list[list[int]] = [[] for _ in range(max_seqs)]

    @property
    def pmax(self) -> torch.Tensor | None:
        """``[num_pages, index_dim]`` view (summary dtype): element-wise max of each page's dequantized keys."""
        return None if self.summaries is None else self.summaries[:, 0]

    @property
    def pmin(self) -> torch.Tensor | None:
        """``[num_pages, index_dim]`` view (summary dtype): element-wise min of each page's dequantized keys."""
        return None if self.summaries is None else self.summaries[:, 1]

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes: its latent row (``kv_dim`` values in ``dtype``, or the FP8 layout: 656
        for 576) plus its indexer key and scale (``index_dim + 4``: 132). The page summaries come on top, per page
        (``2 * index_dim`` values in the summary dtype)."""
        kv = 0 if self.kv is None else self.kv.shape[-1] * self.kv.element_size()
        return kv + (0 if self.ik is None else self.ik.shape[-1] + 4)

    def lengths(self) -> list[int]:
        """Host copy of ``seq_lens``."""
        return list(self._lens)

    def append(
        self,
        seq_ids: Sequence[int],
        lens: Sequence[int],
        kv: torch.Tensor | None = None,
        index_k: torch.Tensor | None = None,
        *,
        config: dict | None = None,
        check_values: bool = True,
    ) -> None:
        """Append ``lens[i]`` tokens to sequence ``seq_ids[i]``; rows of ``kv[N, kv_dim]`` (in the cache's dtype;
        fp32, bf16 or fp16 into an FP8 latent cache) and ``index_k[N, index_dim]`` are packed in that order
        (``N = sum(lens)``). A decode step is
        ``lens = [1] * len(seq_ids)``. Pages are allocated as needed.

        Everything is checked before anything changes (ids, lengths, tensors, free pages, ``config``; a ValueError
        naming the argument), so a call that raises leaves the cache as it was. ``check_values=True`` also checks
        that ``kv`` and ``index_k`` are finite (one device-to-host transfer); with ``False`` the call never waits on
        the device and non-finite keys propagate as NaN (see :func:`append_tokens`).
        """
        seq_ids, lens = as_indices("seq_ids", seq_ids), as_indices("lens", lens)
        if len(seq_ids) != len(lens):
            raise ValueError(f"lens: {len(lens)} entries for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids) or any(not 0 <= s < self.max_seqs for s in seq_ids):
            raise ValueError(f"seq_ids: must be distinct and in [0, {self.max_seqs}), got {seq_ids}")
        if any(n < 0 for n in lens):
            raise ValueError(f"lens: must be >= 0, got {lens}")
        if (kv is None) != (self.kv is None) or (index_k is None) != (self.ik is None):
            raise ValueError("kv, index_k: give exactly the parts this cache holds")
        P = self.page_size
        if any(self._lens[s] + n > self.max_pages_per_seq * P for s, n in zip(seq_ids, lens)):
            raise ValueError(f"lens: a sequence would exceed max_pages_per_seq * page_size = {self.max_pages_per_seq * P}")
        new_pages = [cdiv(self._lens[s] + n, P) - len(self._pages[s]) for s, n in zip(seq_ids, lens)]
        if sum(new_pages) > self.allocator.num_free:
            raise ValueError(f"lens: needs {sum(new_pages)} new pages, {self.allocator.num_free} free")
        _, n_rows, _ = _check_cache_tensors(self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k,
                                            self.rope_dim)
        if n_rows != sum(lens):
            raise ValueError(f"kv, index_k: {n_rows} rows, but sum(lens) = {sum(lens)}")
        if check_values:
            _check_values(kv, index_k, None, n_rows, 0, P)

        # the plan: each sequence's new pages (the allocator's next ones, in order), work items, table entries
        fresh = iter(self.allocator.peek(sum(new_pages)))
        taken = [[next(fresh) for _ in range(n)] for n in new_pages]
        items, table_updates, row = [], [], 0
        for s, n, mine in zip(seq_ids, lens, taken):
            table_updates += [(s, len(self._pages[s]) + j, p) for j, p in enumerate(mine)]
            items += page_items(row, self._lens[s], n, self._pages[s] + mine, P)
            row += n
        # one host-to-device copy: work items, new block-table entries, new lengths
        flat = [x for item in items for x in item] + [x for u in table_updates for x in u]
        flat += [x for s, n in zip(seq_ids, lens) for x in (s, self._lens[s] + n)]
        meta = torch.tensor(flat, dtype=torch.int32).to(self.device)
        n_items, n_upd = 4 * len(items), 3 * len(table_updates)
        items_t = meta[:n_items].view(-1, 4)
        config = _append_plan(self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k, items_t, config,
                              self.rope_dim)[3]
        launch_append(self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k, items_t, config, self.rope_dim)

        # the launch is queued: commit the bookkeeping (the kernel reads none of it)
        self.allocator.allocate(sum(new_pages))
        for s, n, mine in zip(seq_ids, lens, taken):
            self._pages[s] += mine
            self._lens[s] += n
        upd = meta[n_items:n_items + n_upd].view(-1, 3).long()
        self.block_table[upd[:, 0], upd[:, 1]] = upd[:, 2].int()
        new_lens = meta[n_items + n_upd:].view(-1, 2)
        self.seq_lens[new_lens[:, 0].long()] = new_lens[:, 1]

    def _seq_id(self, seq_id) -> int:
        seq_id = as_index("seq_id", seq_id)
        if not 0 <= seq_id < self.max_seqs:
            raise ValueError(f"seq_id: must be in [0, {self.max_seqs}), got {seq_id}")
        return seq_id

    def release(self, seq_id: int) -> None:
        """Free sequence ``seq_id``'s pages and set its length to 0."""
        seq_id = self._seq_id(seq_id)
        self.allocator.free(self._pages[seq_id])
        self._pages[seq_id], self._lens[seq_id] = [], 0
        self.block_table[seq_id] = -1
        self.seq_lens[seq_id] = 0

    def slots(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots (int64, the shape of ``positions``) of logical ``positions`` of one sequence (an integer
        tensor of any shape and device): ``table[i // P] * P + i % P``. A ``seq_id`` outside ``[0, max_seqs)``, or
        ``positions`` that are not integers in ``[0, length)``, raise a ValueError naming it."""
        seq_id = self._seq_id(seq_id)
        P = self.page_size
        check_tensor("positions", positions, contiguous_last=False)
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise ValueError(f"positions: dtype must be an integer type, got {positions.dtype}")
        positions = positions.to(self.device, torch.int64)
        if bool(((positions < 0) | (positions >= self._lens[seq_id])).any()):
            raise ValueError(f"positions: must lie in [0, {self._lens[seq_id]})")
        return self.block_table[seq_id].long()[positions // P] * P + positions % P
