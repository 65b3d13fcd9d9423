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
always split into a value part (``Dv``: 512) and a rope part (``D - Dv``: 64), two dots into one score tile, so it
needs no parameter.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ..checks import check_kernel_device, check_positive, check_tensor
from ..plans import PlanCache
from ..hostmath import cdiv, next_pow2
from ..registry import LaunchSpace
from .cache import check_fp8_latent_layout
from .formats import fp8_latent_bytes
from .sparse_attention_kernels import AttentionLaunch, head_blocks, logical_to_slots, sparse_attention_fwd
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
        smem = 2 * (bh + min(config["num_stages"], 2) * bn) * (bdv + bdr)
        if fp8:
            smem = 2 * (bh + bn) * (bdv + bdr) + min(config["num_stages"], 2) * bn * (bdv + bdr)
        if smem > SMEM_BYTES:
            return f"q tile + KV buffers need ~{smem} bytes of shared memory (> {SMEM_BYTES})"
        return None
    return constraint


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else FALLBACK_SMS


def _default(phase: str):
    """The widest head tile (64 rows: wgmma) whose tiles still fill one wave, else the narrowest (wider tiles that
    leave SMs idle are slower); the longest token tile that fits; then splits over k up to one wave of programs
    (two per SM below 64 rows, where a program needs half the registers)."""
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
        wave = sms * (1 if config["BLOCK_H"] >= WGMMA_ROWS else 2)
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


def _check_common(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int,
                  block_table: torch.Tensor | None) -> int:
    """Checks shared by both ops; returns the page size (1 without pages)."""
    device = check_kernel_device("q", q)
    D = q.shape[-1]
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 0 < d_v <= D:
        raise ValueError(f"d_v: must be an integer in [1, {D}] (D = q.shape[-1]), got {d_v!r}")
    check_tensor("kv_cache", kv_cache, dtype=(q.dtype, torch.uint8), device=device)
    width = D
    if kv_cache.dtype == torch.uint8:  # FP8 latent cache: d_v latent + D - d_v rope values a row
        check_fp8_latent_layout("d_v", d_v, D - d_v)
        width = fp8_latent_bytes(d_v, D - d_v)
    if kv_cache.dim() not in (2, 3) or kv_cache.shape[-1] != width:
        unit = "" if width == D else f" bytes (FP8 latent rows of {d_v} + {D - d_v} values)"
        raise ValueError(f"kv_cache: expected [num_pages, P, {width}] or [num_slots, {width}]{unit} (D from q), "
                         f"got shape {tuple(kv_cache.shape)}")
    if kv_cache.dim() == 3 and kv_cache.shape[0] > 1 and kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError(f"kv_cache: pages must be evenly strided (stride(0) == P * stride(1)), got strides "
                         f"{kv_cache.stride()}")
    if kv_cache.dtype == torch.uint8 and kv_cache.stride(-2) % 4:
        raise ValueError(f"kv_cache: FP8 latent rows must start 4-byte aligned (row stride a multiple of 4), got "
                         f"strides {kv_cache.stride()}")
    if kv_cache.shape[:-1].numel() >= 2**31:
        raise ValueError(f"kv_cache: at most 2**31 - 1 rows (slots are int32), got {kv_cache.shape[:-1].numel()}")
    if block_table is not None:
        check_tensor("block_table", block_table, dtype=INDEX_DTYPES, ndim=2, device=device)
        if kv_cache.dim() != 3:
            raise ValueError("kv_cache: a block_table needs the paged form [num_pages, P, D] (for the page size)")
    return kv_cache.shape[1] if kv_cache.dim() == 3 else 1


def _check_index_range(indices: torch.Tensor, block_table: torch.Tensor | None, bt_div: int, num_slots: int,
                       page_size: int) -> None:
    """Host-side range check (one sync): every index is -1 or names a slot inside the cache."""
    if block_table is None:
        if bool(((indices < -1) | (indices >= num_slots)).any()):
            raise ValueError(f"indices: values must be -1 or physical slots in [0, {num_slots}) (num_pages * P)")
        return
    limit = block_table.shape[1] * page_size
    rows = indices.reshape(block_table.shape[0], -1).long()  # index row r uses block-table row r // bt_div
    inside = (rows >= 0) & (rows < limit)
    phys = block_table.gather(1, torch.where(inside, rows // page_size, 0)) if limit else rows
    bad_page = inside & ((phys < 0) | (phys >= num_slots // page_size))
    flags = torch.stack([((rows < -1) | (rows >= limit)).any(), bad_page.any()]).tolist()
    if flags[0]:
        raise ValueError(f"indices: values must be -1 or logical positions in [0, {limit}) (block_table columns * P)")
    if flags[1]:
        raise ValueError(f"block_table: an entry used by indices is outside [0, {num_slots // page_size}) (num_pages)")


def _launch_config(spec: LaunchSpace, shape: dict[str, int], device: torch.device, config: dict | None) -> dict:
    """The registry's config, or a validated copy of an explicit one (once per plan: plans are keyed by config)."""
    if config is None:
        return spec.launch_config(spec.phases[0], shape, device)
    return spec.validate(config, shape)


def _attention_launch(spec: LaunchSpace, shape: dict[str, int], q: torch.Tensor, kv_cache: torch.Tensor,
                      page_size: int, config: dict | None) -> AttentionLaunch:
    """The launches' keyword arguments for the registry ``shape`` of a checked call."""
    return AttentionLaunch(shape["D"], shape["Dv"], shape["k"], page_size, q.dtype, kv_cache.dtype == torch.uint8,
                           _launch_config(spec, shape, q.device, config))


def _attend(plan: "_Plan", q4: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, block_table: torch.Tensor | None,
            sm_scale: float, check_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if check_values and idx.numel():
        _check_index_range(idx, block_table, plan.bt_div, kv.shape[0], plan.page_size)
    if block_table is not None:
        idx = logical_to_slots(idx, block_table, plan.bt_div, kv.shape[0] // plan.page_size, plan.launch)
    gluon = plan.launch.gluon_kernel if plan.gluon and gluon_aligned(q4, kv) else None
    out, lse = sparse_attention_fwd(q4, kv, idx, float(sm_scale), plan.launch, gluon)
    return (out, lse) if plan.out_shape is None else (out.view(plan.out_shape), lse.view(plan.out_shape[:-1]))


class _Plan(NamedTuple):
    """What an op's checks and its launch config work out from the arguments' metadata."""

    launch: AttentionLaunch  # d_v, the config and the kernels' keyword arguments
    bt_div: int  # index row r reads block-table row r // bt_div
    page_size: int
    per_token: bool  # decode with [B, S, k] indices: run as B * S one-token sequences
    out_shape: tuple[int, ...] | None  # the view the op returns (lse: all but the last dim); None: as launched
    gluon: bool  # the Gluon kernel serves calls whose q and cache addresses are 16-byte aligned (gluon_applies)


_DECODE_PLANS, _PREFILL_PLANS = PlanCache(), PlanCache()


def _check_sm_scale(sm_scale) -> None:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: must be a finite real number, got {sm_scale!r}")


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                            d_v: int = 512, block_table: torch.Tensor | None = None, config: dict | None = None,
                            check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA decode: every head of a sequence shares each gathered cache tile.

    Args:
        q: ``[B, Hq, D]`` or ``[B, S, Hq, D]`` bf16 / fp16 (S query tokens per sequence, e.g. speculative decoding).
        kv_cache: ``[num_pages, P, D]`` or ``[num_slots, D]``, q's dtype; values are the first ``d_v`` dims of a row.
            Or an FP8 latent cache, uint8 ``[num_pages, P, bytes]`` / ``[num_slots, bytes]`` with ``bytes =
            fp8_latent_bytes(d_v, D - d_v)`` (656 for DSA; ``d_v`` a multiple of 4, ``D - d_v`` even).
        indices: int32 / int64, ``[B, k]``: one index set shared by the S tokens of a sequence (they form one
            ``S * Hq``-row tile), or ``[B, S, k]`` with a 4-D q: one set per token (run as ``B * S`` one-token
            sequences).
            Physical slots, or logical positions when ``block_table`` is given; -1 skipped.
        sm_scale: softmax scale applied to ``q . k``.
        d_v: value width (<= D).
        block_table: ``[B, max_pages]`` int32 (needs the paged cache form), or None.
        config: an explicit launch config (validated), else the tuning database's / the default.
        check_values: range-check the indices on the host (one sync) and raise a ValueError naming the argument
            before launch; False: the caller promises they are -1 or in range (see the module docstring).

    Returns:
        ``out`` ``[B, (S,) Hq, d_v]`` in q's dtype and ``lse`` ``[B, (S,) Hq]`` fp32 (natural log).
    """
    _check_sm_scale(sm_scale)
    key, plan = _DECODE_PLANS.find((q, kv_cache, indices, block_table), (d_v,), config)
    if plan is None:
        plan = _DECODE_PLANS.put(key, _checked_decode_plan(q, kv_cache, indices, block_table, d_v, config))
    kv = kv_cache.flatten(0, 1) if kv_cache.dim() == 3 else kv_cache
    if plan.per_token:
        B, S = indices.shape[:2]
        q4, idx = q.reshape(B * S, 1, *q.shape[2:]), indices.reshape(B * S, -1)
    else:
        q4, idx = (q if q.dim() == 4 else q[:, None]), indices
    return _attend(plan, q4, kv, idx, block_table, sm_scale, check_values)


def _checked_decode_plan(q, kv_cache, indices, block_table, d_v, config) -> _Plan:
    check_tensor("q", q, dtype=DTYPES)
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected [B, Hq, D] or [B, S, Hq, D], got shape {tuple(q.shape)}")
    B, S, H, D = q.shape if q.dim() == 4 else (q.shape[0], 1, *q.shape[1:])
    page_size = _check_common(q, kv_cache, d_v, block_table)
    check_tensor("indices", indices, dtype=INDEX_DTYPES, device=q.device)
    per_token = indices.dim() == 3 and q.dim() == 4  # (q [B, Hq, D] has no S to index per token)
    if indices.dim() != 2 + per_token or indices.shape[:-1] != ((B, S) if per_token else (B,)):
        forms = f"[B, k] = [{B}, k]" + (f" or [B, S, k] = [{B}, {S}, k]" if q.dim() == 4 else " (q is [B, Hq, D])")
        raise ValueError(f"indices: expected {forms}, got shape {tuple(indices.shape)}")
    check_positive("indices.shape[-1] (k)", indices.shape[-1])
    if block_table is not None and block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows (one per sequence), got shape {tuple(block_table.shape)}")
    rows, tile, bt_div = (B * S, 1, S) if per_token else (B, S, 1)
    shape = {"B": rows, "S": tile, "H": H, "D": D, "Dv": d_v, "k": indices.shape[-1],
             "fp8": int(kv_cache.dtype == torch.uint8)}
    out_shape = (B, S, H, d_v) if per_token else (B, H, d_v) if q.dim() == 3 else None
    launch = _attention_launch(DECODE, shape, q, kv_cache, page_size, config)
    return _Plan(launch, bt_div, page_size, per_token, out_shape, gluon_applies(q, kv_cache, d_v, launch.config))


def sparse_attention_prefill(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                             d_v: int = 512, block_table: torch.Tensor | None = None, config: dict | None = None,
                             check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA prefill: each query token attends to its own index set; rows are gathered inside the kernel
    (nothing of size ``[T, k, D]`` is built).

    Args:
        q: ``[T, Hq, D]`` bf16 / fp16.
        kv_cache: ``[num_pages, P, D]`` or ``[num_slots, D]``, q's dtype, or an FP8 latent cache (as in
            :func:`sparse_attention_decode`).
        indices: ``[T, k]`` int32 / int64: physical slots, or logical positions with ``block_table``; -1 skipped.
        sm_scale, d_v, config, check_values: as in :func:`sparse_attention_decode`.
        block_table: ``[T, max_pages]`` (the row of each token's sequence; ``bt[seq].expand(T, -1)`` for one
            sequence costs nothing) or ``[1, max_pages]`` shared by every token, or None.

    Returns:
        ``out`` ``[T, Hq, d_v]`` in q's dtype and ``lse`` ``[T, Hq]`` fp32 (natural log).
    """
    _check_sm_scale(sm_scale)
    key, plan = _PREFILL_PLANS.find((q, kv_cache, indices, block_table), (d_v,), config)
    if plan is None:
        plan = _PREFILL_PLANS.put(key, _checked_prefill_plan(q, kv_cache, indices, block_table, d_v, config))
    kv = kv_cache.flatten(0, 1) if kv_cache.dim() == 3 else kv_cache
    if block_table is not None:
        block_table = block_table.expand(q.shape[0], -1)
    return _attend(plan, q[:, None], kv, indices, block_table, sm_scale, check_values)


def _checked_prefill_plan(q, kv_cache, indices, block_table, d_v, config) -> _Plan:
    check_tensor("q", q, dtype=DTYPES, ndim=3)
    T, H, D = q.shape
    page_size = _check_common(q, kv_cache, d_v, block_table)
    check_tensor("indices", indices, dtype=INDEX_DTYPES, ndim=2, device=q.device)
    if indices.shape[0] != T:
        raise ValueError(f"indices: expected [T, k] = [{T}, k], got shape {tuple(indices.shape)}")
    check_positive("indices.shape[1] (k)", indices.shape[1])
    if block_table is not None and block_table.shape[0] not in (1, T):
        raise ValueError(f"block_table: expected 1 or {T} rows (T), got shape {tuple(block_table.shape)}")
    shape = {"T": T, "H": H, "D": D, "Dv": d_v, "k": indices.shape[1], "fp8": int(kv_cache.dtype == torch.uint8)}
    launch = _attention_launch(PREFILL, shape, q, kv_cache, page_size, config)
    return _Plan(launch, 1, page_size, False, (T, H, d_v), gluon_applies(q, kv_cache, d_v, launch.config))
