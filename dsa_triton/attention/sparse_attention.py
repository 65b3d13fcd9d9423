"""Sparse paged attention over the latent KV cache: ``dt.sparse_attention_decode`` and ``dt.sparse_attention_prefill``.

MQA form of DeepSeek-V3.2's MLA: a cache row is ``D`` wide (576 = 512 latent + 64 rope), every query head
scores the same rows, and the values are the first ``d_v`` dims of those rows. Each query row (a decode
sequence, or a prefill token) attends to the ``k`` rows its index set names:

- ``indices`` are physical slots of ``kv_cache`` viewed as ``[num_pages * P, D]``, or, with ``block_table``,
  logical positions ``i`` that map to slot ``block_table[row, i // P] * P + i % P``;
- ``-1`` is skipped (padding); a query row without any valid index gets out 0 and lse -inf;
- ``check_values=True`` (the default) range-checks the indices on the host (one sync) and raises a ValueError
  naming the argument (``indices``, or ``block_table`` for a table entry in use) before any launch when an
  index is below -1 or outside the cache (``>= num_pages * P``, a logical position past the block table, or one
  whose block-table entry is outside ``[0, num_pages)``);
- ``check_values=False`` (CUDA-graph capture, hot loops) checks nothing on the host: the caller promises every
  index is -1 or in range (and the block-table entries it uses in ``[0, num_pages)``). The kernels still never
  read outside the cache: an index that breaks the promise is skipped like -1.

The cache is either rows in q's dtype or DeepSeek's FP8 latent cache (``PagedCache(kv_dtype="fp8")``): uint8 rows of
``fp8_latent_bytes(d_v, D - d_v)`` bytes (656 for 512 + 64: ``d_v`` e4m3 latent values, one fp32 scale per 128 of
them, ``D - d_v`` bf16 rope values; :mod:`.formats`), which the kernels dequantize as they gather them
(same signature and outputs; the values are the dequantized latent part).

DeepSeek-V4 (FlashMLA's ``flash_mla_with_kvcache`` / ``flash_mla_sparse_fwd`` arguments, keyword-only here; every
one off by default, so a DeepSeek-V3.2 call is unchanged): one K=V head, ``d_v == D`` (512, the rope dims last: the
values are the whole row); a uint8 cache with ``d_v == D`` is FlashMLA's MODEL1 FP8 cache, pages ``[num_pages, P,
model1_bytes]`` (584 bytes a token for 448 + 64; the rope width follows from the width; page stride free,
:func:`.formats.model1_cache`). ``attn_sink[Hq]`` fp32 multiplies the output (not the lse) by
``exp(lse) / (exp(lse) + exp(sink[h]))``; ``topk_length`` counts only the first indices of each row;
``extra_kv_cache`` / ``extra_indices`` (with ``extra_topk_length``, ``extra_block_table``) add a second index set
over a second cache of the same format (its own page size): each query row attends to the union of both sets in one
softmax (the sliding window over the token cache, and the compressed entries: CSA's top-k, HCA's all). The registry
shape's ``k`` counts both sets, ``fp8`` is 2 over MODEL1 pages. Lengths are checked like the indices (``[0, k]``);
unchecked, the kernels clamp them.

Non-finite values (checked or not: the checks look at indices only): NaN in, NaN out. A NaN in a query row
makes that row's out and lse NaN; a NaN in a cache row makes NaN every query row whose index set reads it
(never -inf, which would claim an empty row). Cache rows no index names are never read and may hold anything.
An infinite q or cache value gives infinite scores: a +inf score makes its query row's out and lse NaN (the
softmax meets ``inf - inf``; never an lse of +inf with a NaN out), a -inf score is a probability of 0, like a
skipped index (a row of only -inf scores gives out 0 and lse -inf).

On an H200 (sm_90, outside the interpreter) a call with bf16 q and DSA dims (a bf16 cache or the FP8 latent cache)
whose config is 64 query rows x 64-token tiles at 8 warps runs the Gluon seesaw kernel of
:mod:`.sparse_attention_seesaw` (two warp-specialized warpgroups, each scoring its own tile; over the FP8 cache a
third one gathers the tiles and dequantizes 3 of each tile's 4 chunks, the math warpgroups the fourth), when q and
the cache are 16-byte aligned; ``DSA_GLUON=0`` keeps the Triton kernel.

Launch configs come from the tuning database through the registry (:data:`DECODE`, :data:`PREFILL`; the shape's
``fp8`` is 1 over the FP8 latent cache) unless ``config`` is given: ``BLOCK_N`` tokens per gathered tile,
``BLOCK_H`` query rows per program (heads, times the decode tokens sharing an index set), ``num_splits`` programs per
row over the ``k`` selected tokens (merged by the combine kernel), ``num_warps``, ``num_stages``. The head dim is
always split into a value part (``Dv``: 512) and a rope part (``D - Dv``: 64; none where ``D == Dv``), two dots into
one score tile, so it needs no parameter.

The Gluon kernel serves DeepSeek-V3.2 calls only: a call with any DeepSeek-V4 argument or cache runs the Triton kernel.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ..checks import check_kernel_device, check_positive, check_tensor
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..hostmath import cdiv, next_pow2
from ..registry import LaunchSpace
from .cache import check_fp8_latent_layout
from .formats import fp8_latent_bytes, model1_rope
from .sparse_attention_kernels import (NO_EXTRAS, AttentionLaunch, ExtraInputs, Extras, head_blocks, logical_to_slots,
                                       sparse_attention_fwd)
from .sparse_attention_seesaw import gluon_aligned, gluon_applies

DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

SPACE = {
    "BLOCK_N": (16, 32, 64, 128),
    "BLOCK_H": (16, 32, 64, 128),
    "num_splits": (1, 2, 4, 8, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3, 4),
}
SMEM_BYTES = 232448  # Hopper's shared memory per block (227 KiB)
REG_BUDGET = 128  # 32-bit registers per thread for the fp32 accumulator (+ q where mma.sync keeps it in registers)
FALLBACK_SMS = 132  # H200, when no GPU is visible
WGMMA_ROWS = 64  # below this many rows per tile Triton uses mma.sync, with q held in registers
# FP8 cache: registers a thread may spend on the dequantized tile beyond REG_BUDGET: about what ptxas keeps without
# spilling in sm_90 compiles of the DSA decode shape (bench.aot reports the spills).
FP8_TILE_REGS = 80
# MODEL1 pages (fp8 2) below 64 head rows (mma.sync) keep the dequantized tile in shared memory twice and buffer one
# more stage of bytes (fitted to what Hopper launched and refused: results/journal/attention.md, MODEL1 shared memory).


def _rows(phase: str, shape) -> tuple[int, int]:
    """(index rows R, query rows per index row M)."""
    return (shape["B"], shape["S"] * shape["H"]) if phase == "decode" else (shape["T"], shape["H"])


def _constraint(phase: str):
    """FP8 cache (``fp8`` 1): the gathered bytes become a tile in q's dtype in registers (``FP8_TILE_REGS`` more a
    thread) and then in shared memory once, while the bytes themselves are what the stages buffer."""
    def constraint(config, shape) -> str | None:
        R, M = _rows(phase, shape)
        fp8 = bool(shape["fp8"])
        k, bh, bn, warps = shape["k"], config["BLOCK_H"], config["BLOCK_N"], config["num_warps"]
        bdv, bdr = head_blocks(shape["D"], shape["Dv"])
        if bh > max(16, next_pow2(M)):
            return f"BLOCK_H={bh} is wider than the {M} query rows"
        if bn > max(16, next_pow2(k)):
            return f"BLOCK_N={bn} is longer than k={k}"
        if config["num_splits"] > cdiv(k, bn):
            return f"num_splits={config['num_splits']} exceeds the {cdiv(k, bn)} tiles of k"
        threads = 32 * warps
        regs = bh * bdv / threads + (bh * (bdv + bdr) / 2 / threads if bh < WGMMA_ROWS else 0)
        if regs > REG_BUDGET:
            return f"accumulator needs ~{regs:.0f} registers per thread (> {REG_BUDGET}): fewer rows or more warps"
        tile = bn * (bdv + bdr) / 2 / threads
        if fp8 and regs + tile > REG_BUDGET + FP8_TILE_REGS:
            return (f"accumulator and dequantized tile need ~{regs + tile:.0f} registers per thread "
                    f"(> {REG_BUDGET + FP8_TILE_REGS}): a shorter token tile")
        stages = min(config["num_stages"], 2)
        smem = 2 * (bh + stages * bn) * (bdv + bdr)
        if fp8:
            mma_model1 = shape["fp8"] == 2 and bh < WGMMA_ROWS  # MODEL1 under mma.sync (above)
            smem = (2 * (bh + (2 if mma_model1 else 1) * bn) * (bdv + bdr)
                    + (stages + mma_model1) * bn * (bdv + bdr))
        if smem > SMEM_BYTES:
            return f"q tile + KV buffers need ~{smem} bytes of shared memory (> {SMEM_BYTES})"
        return None
    return constraint


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else FALLBACK_SMS


def resident_programs(config: dict) -> int:
    """Programs an SM runs at once, as the default counts them: two below 64 rows at 4 warps (a program needs at most
    half the registers), else one (at 8 warps one program's registers fill an SM; our reading of the H100's B=1,
    s_q=2 FP8 decode at 1.7x FlashMLA's time: 256 programs of 32 rows at 8 warps, two waves; not measured since)."""
    return 2 if config["BLOCK_H"] < WGMMA_ROWS and config["num_warps"] == 4 else 1


def _default(phase: str):
    """The widest head tile (64 rows: wgmma) whose tiles still fill one wave, else the narrowest (wider tiles that
    leave SMs idle are slower); the longest token tile that fits; then splits over k up to one wave of programs
    (:func:`resident_programs` an SM)."""
    constraint = _constraint(phase)

    def default(_phase, shape) -> dict:
        R, M = _rows(phase, shape)
        k, sms = shape["k"], _sm_count()
        top = min(WGMMA_ROWS, max(16, next_pow2(M)))
        fitting = []  # per head tile (widest first): its first valid (warps, token tile)
        for bh in (64, 32, 16):
            candidates = ({"BLOCK_N": bn, "BLOCK_H": bh, "num_splits": 1, "num_warps": w, "num_stages": 2}
                          for w in (4, 8) for bn in (64, 32, 16))
            fitting += [c for c in candidates if bh <= top and constraint(c, shape) is None][:1]
        config = next((c for c in fitting if R * cdiv(M, c["BLOCK_H"]) * cdiv(k, c["BLOCK_N"]) >= sms), fitting[-1])
        programs = R * cdiv(M, config["BLOCK_H"])
        wave = sms * resident_programs(config)
        while (config["num_splits"] * 2 <= min(SPACE["num_splits"][-1], cdiv(k, config["BLOCK_N"]))
               and programs * config["num_splits"] * 2 <= wave):
            config["num_splits"] *= 2
        return config
    return default


DECODE = LaunchSpace(name="sparse_attention_decode", phases=("decode",), space=SPACE, default=_default("decode"),
                     fixed_dims=("S", "H", "D", "Dv", "k", "fp8"), bucketed_dims=("B",),
                     constraint=_constraint("decode"))
PREFILL = LaunchSpace(name="sparse_attention_prefill", phases=("prefill",), space=SPACE, default=_default("prefill"),
                      fixed_dims=("H", "D", "Dv", "k", "fp8"), bucketed_dims=("T",), constraint=_constraint("prefill"))


def _check_cache(name: str, cache: torch.Tensor, q: torch.Tensor, d_v: int, table_name: str,
                 block_table: torch.Tensor | None) -> tuple[int, int | None]:
    """Checks of one cache (``kv_cache`` or ``extra_kv_cache``) and its block table; returns the page size (1 without
    pages) and the rope values of a MODEL1 cache (None for another cache)."""
    D = q.shape[-1]
    check_tensor(name, cache, dtype=(q.dtype, torch.uint8), device=q.device)
    width, model1 = D, None
    if cache.dtype == torch.uint8 and d_v == D:  # MODEL1 FP8 pages: D values a token, the last ones bf16 rope
        model1 = model1_rope(D, cache.shape[-1]) if cache.dim() == 3 else None
        if model1 is None:
            raise ValueError(f"{name}: a uint8 cache with d_v = D = {D} is MODEL1 FP8 pages [num_pages, P, "
                             f"model1_bytes(D - d_rope, d_rope)] (584 for 448 + 64), got shape {tuple(cache.shape)}")
        P, width = cache.shape[1:]
        if cache.stride(1) != width or cache.stride(0) < P * width or cache.stride(0) % 2:
            raise ValueError(f"{name}: MODEL1 pages need token stride {width} and an even page stride >= {P * width} "
                             f"bytes, got strides {cache.stride()}")
    elif cache.dtype == torch.uint8:  # FP8 latent cache: d_v latent + D - d_v rope values a row
        check_fp8_latent_layout("d_v", d_v, D - d_v)
        width = fp8_latent_bytes(d_v, D - d_v)
    if cache.dim() not in (2, 3) or cache.shape[-1] != width:
        unit = "" if width == D else f" bytes (FP8 latent rows of {d_v} + {D - d_v} values)"
        raise ValueError(f"{name}: expected [num_pages, P, {width}] or [num_slots, {width}]{unit} (D from q), "
                         f"got shape {tuple(cache.shape)}")
    if (model1 is None and cache.dim() == 3 and cache.shape[0] > 1
            and cache.stride(0) != cache.shape[1] * cache.stride(1)):
        raise ValueError(f"{name}: pages must be evenly strided (stride(0) == P * stride(1)), got strides "
                         f"{cache.stride()}")
    if cache.dtype == torch.uint8 and model1 is None and cache.stride(-2) % 4:
        raise ValueError(f"{name}: FP8 latent rows must start 4-byte aligned (row stride a multiple of 4), got "
                         f"strides {cache.stride()}")
    if cache.shape[:-1].numel() >= 2**31:
        raise ValueError(f"{name}: at most 2**31 - 1 rows (slots are int32), got {cache.shape[:-1].numel()}")
    if block_table is not None:
        check_tensor(table_name, block_table, dtype=INDEX_DTYPES, ndim=2, device=q.device)
        if cache.dim() != 3:
            raise ValueError(f"{name}: a {table_name} needs the paged form [num_pages, P, D] (for the page size)")
    return (cache.shape[1] if cache.dim() == 3 else 1), model1


def _check_common(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int,
                  block_table: torch.Tensor | None) -> tuple[int, int | None]:
    """Checks shared by both ops; returns the page size (1 without pages) and a MODEL1 cache's rope values."""
    check_kernel_device("q", q)
    D = q.shape[-1]
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 0 < d_v <= D:
        raise ValueError(f"d_v: must be an integer in [1, {D}] (D = q.shape[-1]), got {d_v!r}")
    return _check_cache("kv_cache", kv_cache, q, d_v, "block_table", block_table)


class _Extra(NamedTuple):
    """A call's DeepSeek-V4 arguments (each None when not given)."""

    attn_sink: torch.Tensor | None = None
    topk_length: torch.Tensor | None = None
    extra_kv_cache: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None
    extra_block_table: torch.Tensor | None = None


def _check_extra(x: _Extra, q: torch.Tensor, kv_cache: torch.Tensor, d_v: int, indices: torch.Tensor,
                 lead: tuple[int, ...], per_token_lead: tuple[int, ...] | None, table_rows: tuple[int, ...],
                 model1: int | None) -> tuple[Extras, int, int]:
    """Checks of the DeepSeek-V4 arguments; returns the launch's :class:`Extras` and the index-row divisors of the
    two lengths. ``lead``: the index rows' shape (``indices.shape[:-1]``); ``per_token_lead``: the other shape the
    lengths of ``[B, S, k]`` indices may take, ``[B]`` (one a sequence, as FlashMLA's), else None; ``table_rows``:
    the row counts a block table may have."""
    H = q.shape[-2]
    if x.attn_sink is not None:
        check_tensor("attn_sink", x.attn_sink, dtype=torch.float32, shape=(H,), device=q.device)
    if (x.extra_kv_cache is None) != (x.extra_indices is None):
        missing = "extra_indices" if x.extra_indices is None else "extra_kv_cache"
        raise ValueError(f"{missing}: extra_kv_cache and extra_indices go together (the second index set and its "
                         "cache)")
    for name in ("extra_topk_length", "extra_block_table"):
        if getattr(x, name) is not None and x.extra_indices is None:
            raise ValueError(f"{name}: needs extra_indices (and extra_kv_cache)")
    k2, page_size2 = 0, 1
    if x.extra_indices is not None:
        check_tensor("extra_indices", x.extra_indices, dtype=INDEX_DTYPES, device=q.device)
        if tuple(x.extra_indices.shape[:-1]) != lead or x.extra_indices.dim() != indices.dim():
            raise ValueError(f"extra_indices: expected [{', '.join(map(str, lead))}, k2] (indices' rows), got shape "
                             f"{tuple(x.extra_indices.shape)}")
        k2 = check_positive("extra_indices.shape[-1] (k2)", x.extra_indices.shape[-1])
        if x.extra_kv_cache.dtype != kv_cache.dtype:
            raise ValueError(f"extra_kv_cache: dtype must be kv_cache's ({kv_cache.dtype}), got "
                             f"{x.extra_kv_cache.dtype}")
        page_size2, model1_2 = _check_cache("extra_kv_cache", x.extra_kv_cache, q, d_v, "extra_block_table",
                                            x.extra_block_table)
        if model1_2 != model1:
            raise ValueError(f"extra_kv_cache: MODEL1 rows of {model1_2} rope values, kv_cache's have {model1}")
        if x.extra_block_table is not None and x.extra_block_table.shape[0] not in table_rows:
            raise ValueError(f"extra_block_table: expected {' or '.join(map(str, table_rows))} rows (as block_table), "
                             f"got shape {tuple(x.extra_block_table.shape)}")
    divisors = []
    for name, lengths in (("topk_length", x.topk_length), ("extra_topk_length", x.extra_topk_length)):
        if lengths is None:
            divisors.append(1)
            continue
        check_tensor(name, lengths, dtype=INDEX_DTYPES, device=q.device)
        if not lengths.is_contiguous() or tuple(lengths.shape) not in (lead, per_token_lead):
            forms = " or ".join(f"[{', '.join(map(str, f))}]" for f in (lead, per_token_lead) if f is not None)
            raise ValueError(f"{name}: expected a contiguous {forms} (one length an index row"
                             f"{', or a sequence' if per_token_lead else ''}), got shape {tuple(lengths.shape)} "
                             f"strides {lengths.stride()}")
        divisors.append(math.prod(lead) // max(1, lengths.numel()) if lengths.numel() else 1)
    extras = Extras(k2, page_size2, x.topk_length is not None, x.extra_topk_length is not None,
                    x.attn_sink is not None, model1)
    return extras, divisors[0], divisors[1]


def _index_range_flags(indices: torch.Tensor, block_table: torch.Tensor | None, bt_div: int, num_slots: int,
                       page_size: int, names: tuple[str, str]) -> list[tuple[torch.Tensor, str]]:
    """The host-side range checks of one index set, as ``(bad flag on the device, message)``: every index is -1 or
    names a slot inside the cache (``names``: the indices' and the block table's)."""
    if block_table is None:
        return [(((indices < -1) | (indices >= num_slots)).any(),
                 f"{names[0]}: values must be -1 or physical slots in [0, {num_slots}) (num_pages * P)")]
    limit = block_table.shape[1] * page_size
    rows = indices.reshape(block_table.shape[0], -1).long()  # index row r uses block-table row r // bt_div
    inside = (rows >= 0) & (rows < limit)
    phys = block_table.gather(1, torch.where(inside, rows // page_size, 0)) if limit else rows
    bad_page = inside & ((phys < 0) | (phys >= num_slots // page_size))
    return [(((rows < -1) | (rows >= limit)).any(),
             f"{names[0]}: values must be -1 or logical positions in [0, {limit}) ({names[1]} columns * P)"),
            (bad_page.any(),
             f"{names[1]}: an entry used by {names[0]} is outside [0, {num_slots // page_size}) (num_pages)")]


def _length_flags(name: str, lengths: torch.Tensor | None, k: int) -> list[tuple[torch.Tensor, str]]:
    if lengths is None or not lengths.numel():
        return []
    return [(((lengths < 0) | (lengths > k)).any(), f"{name}: values must lie in [0, {k}] (the indices' width)")]


def _raise_flagged(flags: list[tuple[torch.Tensor, str]]) -> None:
    """Raise the message of the first flag that is set (one device-to-host transfer for all)."""
    if flags:
        for bad, (_, message) in zip(torch.stack([f for f, _ in flags]).tolist(), flags):
            if bad:
                raise ValueError(message)


def _launch_config(spec: LaunchSpace, shape: dict[str, int], device: torch.device, config: dict | None) -> dict:
    """The registry's config, or a validated copy of an explicit one (once per plan: plans are keyed by config)."""
    if config is None:
        return spec.launch_config(spec.phases[0], shape, device)
    return spec.validate(config, shape)


def _attention_launch(spec: LaunchSpace, shape: dict[str, int], q: torch.Tensor, kv_cache: torch.Tensor,
                      page_size: int, config: dict | None, extras: Extras) -> AttentionLaunch:
    """The launches' keyword arguments for the registry ``shape`` of a checked call (``k``: both sets' widths)."""
    return AttentionLaunch(shape["D"], shape["Dv"], shape["k"] - extras.k2, page_size, q.dtype,
                           kv_cache.dtype == torch.uint8, _launch_config(spec, shape, q.device, config), extras)


def _flat(plan: "_Plan", cache: torch.Tensor) -> torch.Tensor:
    """A cache as the kernel takes it: rows ``[num_slots, D]``, or MODEL1 pages as they are."""
    return cache.flatten(0, 1) if cache.dim() == 3 and plan.launch.extras.model1_rope is None else cache


def _attend(plan: "_Plan", q4: torch.Tensor, kv_cache: torch.Tensor, idx: torch.Tensor,
            block_table: torch.Tensor | None, sm_scale: float, check_values: bool,
            x: _Extra) -> tuple[torch.Tensor, torch.Tensor]:
    kv = _flat(plan, kv_cache)
    num_slots = kv_cache.shape[:-1].numel()
    idx2, bt2 = x.extra_indices, x.extra_block_table
    if check_values:
        flags = _index_range_flags(idx, block_table, plan.bt_div, num_slots, plan.page_size,
                                   ("indices", "block_table")) if idx.numel() else []
        flags += _length_flags("topk_length", x.topk_length, idx.shape[-1])
        if idx2 is not None and idx2.numel():
            flags += _index_range_flags(idx2, bt2, plan.bt_div, x.extra_kv_cache.shape[:-1].numel(),
                                        plan.launch.extras.page_size2, ("extra_indices", "extra_block_table"))
            flags += _length_flags("extra_topk_length", x.extra_topk_length, idx2.shape[-1])
        _raise_flagged(flags)
    if block_table is not None:
        idx = logical_to_slots(idx, block_table, plan.bt_div, num_slots // plan.page_size, plan.launch)
    extra = None
    if plan.launch.extras != NO_EXTRAS:
        kv2 = None if idx2 is None else _flat(plan, x.extra_kv_cache)
        if bt2 is not None:
            idx2 = logical_to_slots(idx2, bt2, plan.bt_div, x.extra_kv_cache.shape[:-1].numel()
                                    // plan.launch.extras.page_size2, plan.launch, second=True)
        if idx2 is not None and idx2.dtype != idx.dtype:  # (the kernel walks both sets through one index pointer)
            idx2 = idx2.to(idx.dtype)
        extra = ExtraInputs(kv2, idx2, x.topk_length, x.extra_topk_length, x.attn_sink, plan.len_div, plan.len2_div)
    gluon = plan.launch.gluon_kernel if plan.gluon and gluon_aligned(q4, kv) else None
    out, lse = sparse_attention_fwd(q4, kv, idx, float(sm_scale), plan.launch, gluon, extra)
    return (out, lse) if plan.out_shape is None else (out.view(plan.out_shape), lse.view(plan.out_shape[:-1]))


class _Plan(NamedTuple):
    """What an op's checks and its launch config work out from the arguments' metadata."""

    launch: AttentionLaunch  # d_v, the config and the kernels' keyword arguments (its extras: the V4 arguments')
    bt_div: int  # index row r reads block-table row r // bt_div (of either set)
    page_size: int
    per_token: bool  # decode with [B, S, k] indices: run as B * S one-token sequences
    out_shape: tuple[int, ...] | None  # the view the op returns (lse: all but the last dim); None: as launched
    gluon: bool  # the Gluon kernel serves calls whose q and cache addresses are 16-byte aligned (gluon_applies)
    len_div: int  # index row r reads topk_length[r // len_div]
    len2_div: int  # and extra_topk_length[r // len2_div]


_DECODE_PLANS, _PREFILL_PLANS = PlanCache(), PlanCache()


def _check_sm_scale(sm_scale) -> None:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: must be a finite real number, got {sm_scale!r}")


def _fp8_kind(kv_cache: torch.Tensor, model1: int | None) -> int:
    """The shapes' ``fp8``: 0 rows in q's dtype, 1 the FP8 latent cache, 2 MODEL1 FP8 pages."""
    return 0 if kv_cache.dtype != torch.uint8 else 1 if model1 is None else 2


def _gluon(q, kv_cache, d_v, launch: AttentionLaunch) -> bool:
    """The seesaw kernel serves DeepSeek-V3.2 calls only (no extras), where :func:`gluon_applies`."""
    return launch.extras == NO_EXTRAS and gluon_applies(q, kv_cache, d_v, launch.config)


EXTRA_ARGS_DOC = """attn_sink: ``[Hq]`` fp32 or None: the output (not the lse) is multiplied by
            ``exp(lse) / (exp(lse) + exp(attn_sink[h]))`` (+inf gives 0, -inf changes nothing; an empty row stays 0).
        topk_length: int32 / int64 or None: only the first ``topk_length[r]`` indices of index row r count (the
            kernels stop there); {lengths}, values in ``[0, k]`` (clamped when unchecked).
        extra_kv_cache, extra_indices: a second cache (q's dtype or the first's FP8 format; its own page size)
            and a second index set with the rows of ``indices`` (``[..., k2]``): each query row attends to the
            union of both sets, in one softmax (DeepSeek-V4: the sliding window and the compressed entries).
        extra_topk_length, extra_block_table: ``topk_length`` and ``block_table`` of the second set."""


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                            d_v: int = 512, block_table: torch.Tensor | None = None, config: dict | None = None,
                            check_values: bool = True, *, attn_sink: torch.Tensor | None = None,
                            topk_length: torch.Tensor | None = None, extra_kv_cache: torch.Tensor | None = None,
                            extra_indices: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                            extra_block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA decode: every head of a sequence shares each gathered cache tile.

    Args:
        q: ``[B, Hq, D]`` or ``[B, S, Hq, D]`` bf16 / fp16 (S query tokens per sequence, e.g. speculative decoding).
        kv_cache: ``[num_pages, P, D]`` or ``[num_slots, D]``, q's dtype; values are the first ``d_v`` dims of a row.
            Or an FP8 latent cache, uint8 ``[num_pages, P, bytes]`` / ``[num_slots, bytes]`` with ``bytes =
            fp8_latent_bytes(d_v, D - d_v)`` (656 for DSA; ``d_v`` a multiple of 4, ``D - d_v`` even). Or, with
            ``d_v == D``, MODEL1 FP8 pages uint8 ``[num_pages, P, model1_bytes(D - d_rope, d_rope)]`` (584 for
            DeepSeek-V4's 448 + 64; page stride free).
        indices: int32 / int64, ``[B, k]``: one index set shared by the S tokens of a sequence (they form one
            ``S * Hq``-row tile), or ``[B, S, k]`` with a 4-D q: one set per token (run as ``B * S`` one-token
            sequences).
            Physical slots, or logical positions when ``block_table`` is given; -1 skipped.
        sm_scale: softmax scale applied to ``q . k``.
        d_v: value width (<= D).
        block_table: ``[B, max_pages]`` int32 (needs the paged cache form), or None.
        config: an explicit launch config (validated), else the tuning database's / the default.
        check_values: range-check the indices (and lengths) on the host (one sync) and raise a ValueError naming the
            argument before launch; False: the caller promises they are -1 or in range (see the module docstring).
        {extra}

    Returns:
        ``out`` ``[B, (S,) Hq, d_v]`` in q's dtype and ``lse`` ``[B, (S,) Hq]`` fp32 (natural log).
    """
    _check_sm_scale(sm_scale)
    x = _Extra(attn_sink, topk_length, extra_kv_cache, extra_indices, extra_topk_length, extra_block_table)
    key, plan = _DECODE_PLANS.find((q, kv_cache, indices, block_table, *x), (d_v,), config)
    if plan is None:
        plan = _DECODE_PLANS.put(key, _checked_decode_plan(q, kv_cache, indices, block_table, d_v, config, x))
    if plan.per_token:
        B, S = indices.shape[:2]
        q4, idx = q.reshape(B * S, 1, *q.shape[2:]), indices.reshape(B * S, -1)
        if extra_indices is not None:
            x = x._replace(extra_indices=extra_indices.reshape(B * S, -1))
        x = x._replace(topk_length=None if topk_length is None else topk_length.view(-1),
                       extra_topk_length=None if extra_topk_length is None else extra_topk_length.view(-1))
    else:
        q4, idx = (q if q.dim() == 4 else q[:, None]), indices
    return _attend(plan, q4, kv_cache, idx, block_table, sm_scale, check_values, x)


def _checked_decode_plan(q, kv_cache, indices, block_table, d_v, config, x: _Extra) -> _Plan:
    check_tensor("q", q, dtype=DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected [B, Hq, D] or [B, S, Hq, D], got shape {tuple(q.shape)}")
    B, S, H, D = q.shape if q.dim() == 4 else (q.shape[0], 1, *q.shape[1:])
    page_size, model1 = _check_common(q, kv_cache, d_v, block_table)
    check_tensor("indices", indices, dtype=INDEX_DTYPES, device=q.device)
    per_token = indices.dim() == 3 and q.dim() == 4  # (q [B, Hq, D] has no S to index per token)
    if indices.dim() != 2 + per_token or indices.shape[:-1] != ((B, S) if per_token else (B,)):
        forms = f"[B, k] = [{B}, k]" + (f" or [B, S, k] = [{B}, {S}, k]" if q.dim() == 4 else " (q is [B, Hq, D])")
        raise ValueError(f"indices: expected {forms}, got shape {tuple(indices.shape)}")
    check_positive("indices.shape[-1] (k)", indices.shape[-1])
    if block_table is not None and block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows (one per sequence), got shape {tuple(block_table.shape)}")
    extras, len_div, len2_div = _check_extra(x, q, kv_cache, d_v, indices, tuple(indices.shape[:-1]),
                                             (B,) if per_token else None, (B,), model1)
    rows, tile, bt_div = (B * S, 1, S) if per_token else (B, S, 1)
    shape = {"B": rows, "S": tile, "H": H, "D": D, "Dv": d_v, "k": indices.shape[-1] + extras.k2,
             "fp8": _fp8_kind(kv_cache, model1)}
    out_shape = (B, S, H, d_v) if per_token else (B, H, d_v) if q.dim() == 3 else None
    launch = _attention_launch(DECODE, shape, q, kv_cache, page_size, config, extras)
    return _Plan(launch, bt_div, page_size, per_token, out_shape, _gluon(q, kv_cache, d_v, launch), len_div, len2_div)


def sparse_attention_prefill(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                             d_v: int = 512, block_table: torch.Tensor | None = None, config: dict | None = None,
                             check_values: bool = True, *, attn_sink: torch.Tensor | None = None,
                             topk_length: torch.Tensor | None = None, extra_kv_cache: torch.Tensor | None = None,
                             extra_indices: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                             extra_block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA prefill: each query token attends to its own index set; rows are gathered inside the kernel
    (nothing of size ``[T, k, D]`` is built).

    Args:
        q: ``[T, Hq, D]`` bf16 / fp16.
        kv_cache: ``[num_pages, P, D]`` or ``[num_slots, D]``, q's dtype, or an FP8 cache (as in
            :func:`sparse_attention_decode`).
        indices: ``[T, k]`` int32 / int64: physical slots, or logical positions with ``block_table``; -1 skipped.
        sm_scale, d_v, config, check_values: as in :func:`sparse_attention_decode`.
        block_table: ``[T, max_pages]`` (the row of each token's sequence; ``bt[seq].expand(T, -1)`` for one
            sequence costs nothing) or ``[1, max_pages]`` shared by every token, or None.
        {extra}

    Returns:
        ``out`` ``[T, Hq, d_v]`` in q's dtype and ``lse`` ``[T, Hq]`` fp32 (natural log).
    """
    _check_sm_scale(sm_scale)
    x = _Extra(attn_sink, topk_length, extra_kv_cache, extra_indices, extra_topk_length, extra_block_table)
    key, plan = _PREFILL_PLANS.find((q, kv_cache, indices, block_table, *x), (d_v,), config)
    if plan is None:
        plan = _PREFILL_PLANS.put(key, _checked_prefill_plan(q, kv_cache, indices, block_table, d_v, config, x))
    if block_table is not None:
        block_table = block_table.expand(q.shape[0], -1)
    if extra_block_table is not None:
        x = x._replace(extra_block_table=extra_block_table.expand(q.shape[0], -1))
    return _attend(plan, q[:, None], kv_cache, indices, block_table, sm_scale, check_values, x)


def _checked_prefill_plan(q, kv_cache, indices, block_table, d_v, config, x: _Extra) -> _Plan:
    check_tensor("q", q, dtype=DTYPES, ndim=3)
    T, H, D = q.shape
    page_size, model1 = _check_common(q, kv_cache, d_v, block_table)
    check_tensor("indices", indices, dtype=INDEX_DTYPES, ndim=2, device=q.device)
    if indices.shape[0] != T:
        raise ValueError(f"indices: expected [T, k] = [{T}, k], got shape {tuple(indices.shape)}")
    check_positive("indices.shape[1] (k)", indices.shape[1])
    if block_table is not None and block_table.shape[0] not in (1, T):
        raise ValueError(f"block_table: expected 1 or {T} rows (T), got shape {tuple(block_table.shape)}")
    extras, len_div, len2_div = _check_extra(x, q, kv_cache, d_v, indices, (T,), None, (1, T), model1)
    shape = {"T": T, "H": H, "D": D, "Dv": d_v, "k": indices.shape[1] + extras.k2, "fp8": _fp8_kind(kv_cache, model1)}
    launch = _attention_launch(PREFILL, shape, q, kv_cache, page_size, config, extras)
    return _Plan(launch, 1, page_size, False, (T, H, d_v), _gluon(q, kv_cache, d_v, launch), len_div, len2_div)


sparse_attention_decode.__doc__ = sparse_attention_decode.__doc__.replace("{extra}", EXTRA_ARGS_DOC.replace(
    "{lengths}", "one per index row (``[B]``, or ``[B, S]`` with ``[B, S, k]`` indices, which also take ``[B]``: one "
    "per sequence, as FlashMLA's)"))
sparse_attention_prefill.__doc__ = sparse_attention_prefill.__doc__.replace("{extra}", EXTRA_ARGS_DOC.replace(
    "{lengths}", "``[T]``, one per token"))


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

def _attention_op(name: str, fn, doc: str):
    """The custom op of a sparse-attention function (decode and prefill take the same arguments; DeepSeek-V4's
    last, keyword-only in ``dt``: a custom op takes no keyword-only tensor)."""
    def op(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
           block_table: torch.Tensor | None = None, check_values: bool = True, config: str | None = None,
           attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
           extra_kv_cache: torch.Tensor | None = None, extra_indices: torch.Tensor | None = None,
           extra_topk_length: torch.Tensor | None = None,
           extra_block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return fn(q, kv_cache, indices, sm_scale, d_v, block_table, config=op_config(config),
                  check_values=check_values, attn_sink=attn_sink, topk_length=topk_length,
                  extra_kv_cache=extra_kv_cache, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
                  extra_block_table=extra_block_table)

    op.__doc__ = doc
    registered = dsa_op(name)(op)

    @registered.register_fake
    def _(q, kv_cache, indices, sm_scale, d_v=512, *args, **kwargs):
        rows = q.shape[:-1]  # [B, Hq], [B, S, Hq] (one index set per sequence or per token) or [T, Hq]
        return q.new_empty((*rows, d_v)), q.new_empty(rows, dtype=torch.float32)

    return registered


sparse_attention_decode_op = _attention_op("sparse_attention_decode", sparse_attention_decode, """\
:func:`dt.sparse_attention_decode`: ``(out [B, (S,) Hq, d_v] q's dtype, lse [B, (S,) Hq] fp32)``; with DeepSeek-V4's
sinks, lengths and second index set as keywords.""")
sparse_attention_prefill_op = _attention_op("sparse_attention_prefill", sparse_attention_prefill, """\
:func:`dt.sparse_attention_prefill`: ``(out [T, Hq, d_v] q's dtype, lse [T, Hq] fp32)``; with DeepSeek-V4's sinks,
lengths and second index set as keywords.""")
