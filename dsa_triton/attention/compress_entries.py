"""DeepSeek-V4's compressors as tokens arrive: :func:`compress_entries`.

A step's new tokens (packed by sequence: prefill chunks or decode tokens) bring their compressor inputs ``kv``,
``gate``; every window of ``ratio`` tokens that closes in the step becomes one compressed entry, written into a paged
cache of entries (CSA: ratio 4 with the overlap, its main compressor at ``head_dim`` and its indexer's at
``index_head_dim``; HCA: ratio 128). The inputs of earlier tokens a window needs (those of its own tokens before the
step and, with the overlap, of the window before it) are read from the window stream, where the caller keeps the
last ``c x ratio - 1`` tokens' inputs; so a chunked prefill, a decode and one pass give the same entries. The math
(transformers' exactly): :mod:`.compress_entries_reference`; the kernel: :mod:`.compress_entries_kernels`.

Launch configs come from the tuning database through the registry (:data:`LAUNCH`: ``BLOCK_S`` window slots a tile,
``num_warps``) unless ``config`` is given. Shape: ``B`` sequences, ``N`` new tokens, ``D`` entry width, ``M``
ratio, ``C`` 2 with the overlap (else 1).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ..checks import check_int32, check_kernel_device, check_tensor
from ..hostmath import cdiv, next_pow2
from ..launch import launch_with
from ..plans import PlanCache
from ..registry import LaunchSpace
from .compress_entries_kernels import compress_kernel
from .indexer_checks import DeviceChecks, check_size

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILE_ELEMENTS = 4096  # gate and value elements of a slot tile a program holds by default (x 2: both)


def _default(phase: str, shape) -> dict:
    """The longest slot tile (at most the window's slots) of about ``TILE_ELEMENTS`` elements, 4 warps."""
    slots = next_pow2(shape["C"] * shape["M"])
    return {"BLOCK_S": min(slots, max(1, TILE_ELEMENTS // next_pow2(shape["D"])), 32), "num_warps": 4}


def _constraint(config: dict, shape) -> str | None:
    if config["BLOCK_S"] > next_pow2(shape["C"] * shape["M"]):
        return f"BLOCK_S={config['BLOCK_S']} is longer than the window's {shape['C'] * shape['M']} slots"
    regs = 2 * config["BLOCK_S"] * next_pow2(shape["D"]) / (32 * config["num_warps"])
    if regs > 128:
        return f"a slot tile of gates and values takes ~{regs:.0f} registers per thread (> 128): fewer slots"
    return None


LAUNCH = LaunchSpace(
    name="compress_entries",
    phases=("prefill", "decode"),
    space={"BLOCK_S": (1, 2, 4, 8, 16, 32), "num_warps": (1, 2, 4, 8)},
    default=_default,
    fixed_dims=("D", "M", "C"),
    bucketed_dims=("B", "N"),
    constraint=_constraint,
)


class _Plan(NamedTuple):
    """What a call's metadata checks and launch config work out."""

    B: int  # sequences (the grid's first dim; the second: windows a sequence may close, cdiv(max_q, ratio))
    meta: dict  # the kernel's constexprs and options
    strides: tuple[int, ...]  # inputs' rows, window rows, window table rows, entry table rows, entry rows, tables
    max_q: int | None  # the most tokens of one sequence (None: read off cu_seqlens at each call)


def _pages(name: str, t, dtype, width: int, device) -> tuple[int, int]:
    """A paged array ``[num_pages, P, width]`` of ``dtype`` with evenly strided rows; returns ``(num_pages, P)``."""
    check_tensor(name, t, dtype=dtype, ndim=3, device=device)
    if t.shape[2] != width:
        raise ValueError(f"{name}: expected [num_pages, P, {width}], got shape {tuple(t.shape)}")
    if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        raise ValueError(f"{name}: pages must be evenly strided (stride(0) == P * stride(1)), got strides {t.stride()}")
    if t.shape[1] == 0 or t.shape[0] * t.shape[1] >= 2**31:
        raise ValueError(f"{name}: needs 1 to 2**31 - 1 rows, got shape {tuple(t.shape)}")
    return t.shape[0], t.shape[1]


def _checked_plan(kv, gate, kv_window, gate_window, window_table, entries, entry_table, cu_seqlens, seq_lens, ape,
                  norm_weight, cos, sin, ratio, overlap, max_q, config) -> _Plan:
    """The metadata checks of :func:`compress_entries` (every failure a ValueError naming the argument) and the
    launch they fix."""
    check_tensor("kv", kv, dtype=DTYPES, ndim=2)
    device = check_kernel_device("kv", kv)
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap: must be a bool, got {overlap!r}")
    M = check_int32("ratio", ratio, 1, 2**16)
    C = 2 if overlap else 1
    T, width = kv.shape
    check_tensor("entries", entries, dtype=kv.dtype, ndim=3, device=device)
    D = entries.shape[-1]
    if width != C * D or D % 2:
        raise ValueError(f"kv: expected [T, {C} x D] = [T, {C * D}] (D = entries.shape[-1], even; overlap="
                         f"{overlap}), got shape {tuple(kv.shape)}")
    check_tensor("gate", gate, dtype=kv.dtype, shape=(T, width), device=device)
    if gate.stride(0) != kv.stride(0):
        raise ValueError(f"gate: row stride must equal kv's ({kv.stride(0)}), got strides {gate.stride()}")
    _, Pw = _pages("kv_window", kv_window, kv.dtype, width, device)
    _pages("gate_window", gate_window, kv.dtype, width, device)
    if gate_window.shape != kv_window.shape or gate_window.stride() != kv_window.stride():
        raise ValueError(f"gate_window: shape and strides must equal kv_window's {tuple(kv_window.shape)} "
                         f"{kv_window.stride()}, got {tuple(gate_window.shape)} {gate_window.stride()}")
    _, Pc = _pages("entries", entries, kv.dtype, D, device)
    check_tensor("cu_seqlens", cu_seqlens, dtype=torch.int32, ndim=1, device=device)
    if cu_seqlens.shape[0] < 2 or not cu_seqlens.is_contiguous():
        raise ValueError(f"cu_seqlens: expected a contiguous [B + 1] (B >= 1), got shape {tuple(cu_seqlens.shape)}")
    B = cu_seqlens.shape[0] - 1
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(B,), device=device)
    if not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens: must be contiguous, got strides {seq_lens.stride()}")
    for name, table in (("window_table", window_table), ("entry_table", entry_table)):
        check_tensor(name, table, dtype=torch.int32, ndim=2, device=device)
        if table.shape[0] < B or table.shape[1] == 0:
            raise ValueError(f"{name}: expected [>= B, max_pages] = [>= {B}, >= 1], got shape {tuple(table.shape)}")
    check_tensor("ape", ape, dtype=torch.float32, shape=(M, width), device=device)
    if not ape.is_contiguous():
        raise ValueError(f"ape: must be contiguous, got strides {ape.stride()}")
    check_tensor("norm_weight", norm_weight, dtype=DTYPES, shape=(D,), device=device)
    check_tensor("cos", cos, dtype=DTYPES, ndim=2, device=device)
    if not 0 < cos.shape[1] <= D // 2:
        raise ValueError(f"cos: expected [entries, R] with 1 <= R <= D / 2 = {D // 2} (R rope pairs), got shape "
                         f"{tuple(cos.shape)}")
    check_tensor("sin", sin, dtype=cos.dtype, shape=tuple(cos.shape), device=device)
    if sin.stride() != cos.stride():
        raise ValueError(f"sin: strides must equal cos's {cos.stride()}, got {sin.stride()}")
    max_q = check_size("max_q", max_q)
    shape = {"B": B, "N": T, "D": D, "M": M, "C": C}
    phase = "decode" if max_q == 1 else "prefill"
    config = LAUNCH.launch_config(phase, shape, device) if config is None else LAUNCH.validate(config, shape)
    meta = dict(D=D, R=cos.shape[1], M=M, C=C, PW=Pw, PC=Pc, BLOCK_D=next_pow2(D), BLOCK_S=config["BLOCK_S"],
                num_warps=config["num_warps"])
    strides = (kv.stride(0), kv_window.stride(1), window_table.stride(0), entry_table.stride(0), entries.stride(1),
               cos.stride(0))
    return _Plan(B, meta, strides, max_q)


def check_compress_values(kv, window_table, entry_table, cu_seqlens, seq_lens, num_window_pages: int,
                          num_entry_pages: int, cos_rows: int, plan: _Plan) -> int:
    """The value checks (one transfer): ``cu_seqlens`` rises from 0 to T, no sequence has more rows than
    ``max_q`` or than its ``seq_lens``; the window-table entries of the pages a closing window reads and the
    entry-table entries of the pages its entry goes to lie inside their caches, within the tables' widths; every
    entry closing has a row of ``cos``. Returns the most rows of a sequence."""
    M, C, Pw, Pc = (plan.meta[k] for k in ("M", "C", "PW", "PC"))
    checks, T, B = DeviceChecks(), kv.shape[0], seq_lens.shape[0]
    cu, lens = cu_seqlens.long(), seq_lens.long()
    n = cu[1:] - cu[:-1]
    start = lens - n
    first, last = start // M, lens // M
    closes = last > first
    lo = ((first - (C - 1)) * M).clamp_min(0)  # the first token a closing window reads
    checks.fail_if(lambda: (cu[0] != 0) | (cu[-1] != T) | (n < 0), f"cu_seqlens: must rise from 0 to T = {T}")
    checks.fail_if(lambda: start < 0, "seq_lens: a sequence has fewer tokens than its rows in cu_seqlens")
    if plan.max_q is not None:
        checks.fail_if(lambda: n > plan.max_q, f"max_q: a sequence has more than {plan.max_q} rows")

    def bad_pages(table, lo, hi, P, num_pages):  # entries of pages holding positions [lo, hi) of closing sequences
        col = torch.arange(table.shape[1], device=table.device)[None, :] * P
        used = closes[:, None] & (col < hi[:, None]) & (col + P > lo[:, None])
        past = closes & (hi > lo) & (hi > table.shape[1] * P)  # positions past the table
        return (used & ((table[:B] < 0) | (table[:B] >= num_pages))).any() | past

    checks.fail_if(lambda: bad_pages(window_table, lo, start, Pw, num_window_pages),
                   f"window_table: a page a closing window reads is outside [0, {num_window_pages}) or the table")
    checks.fail_if(lambda: bad_pages(entry_table, first, last, Pc, num_entry_pages),
                   f"entry_table: a page a new entry goes to is outside [0, {num_entry_pages}) or the table")
    checks.fail_if(lambda: closes & (last > cos_rows), f"cos: {cos_rows} rows, fewer than the entries closing")
    if plan.max_q is None:
        checks.fetch("max_q", n.max())
    found = checks.run()
    return plan.max_q if plan.max_q is not None else max(found["max_q"][0], 0)


_PLANS = PlanCache()


def compress_entries(kv: torch.Tensor, gate: torch.Tensor, kv_window: torch.Tensor, gate_window: torch.Tensor,
                     window_table: torch.Tensor, entries: torch.Tensor, entry_table: torch.Tensor,
                     cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *, ratio: int, overlap: bool, eps: float,
                     max_q: int | None = None, check_values: bool = True, config: dict | None = None) -> None:
    """Write the compressed entries of the windows that close in this step into ``entries`` (in place).

    Args:
        kv, gate: ``[T, c D]`` bf16 / fp16 / fp32, the step's new tokens' compressor inputs (``wkv x``, ``wgate x``),
            packed by sequence; ``c`` 2 with ``overlap`` (CSA: ``Ca`` columns ``[0, D)``, ``Cb`` ``[D, 2D)``), else 1.
        kv_window, gate_window: ``[num_pages, P_w, c D]`` (kv's dtype): the window stream's inputs of earlier tokens;
            a closing window reads its tokens before the step there (at most ``c x ratio - 1`` before the step's
            first), position ``i`` of sequence ``b`` at row ``window_table[b, i // P_w] * P_w + i % P_w``.
        window_table: ``[>= B, max_pages]`` int32.
        entries: ``[num_pages, P_c, D]`` (kv's dtype): the compressed cache; entry ``w`` of sequence ``b`` (window
            ``[w ratio, (w + 1) ratio)``) goes to row ``entry_table[b, w // P_c] * P_c + w % P_c``; nothing else is
            written.
        entry_table: ``[>= B, max_pages]`` int32.
        cu_seqlens: ``[B + 1]`` int32: sequence ``b``'s tokens are rows ``cu[b] .. cu[b + 1]`` of ``kv``, ``gate``.
        seq_lens: ``[B]`` int32: each sequence's tokens after this step (its new ones last).
        ape: ``[ratio, c D]`` fp32, the position bias added to the gates.
        norm_weight: ``[D]``: the entries' RMS-norm weight (applied in fp32).
        cos, sin: ``[>= entries, R]`` (one dtype and strides; the values as given): row ``w`` rotates entry ``w``'s
            last ``2 R`` dims as interleaved pairs (DeepSeek-V4: the compress RoPE at position ``w x ratio``, where
            its window starts, rounded to the activation dtype).
        ratio: tokens a window (``m``); overlap: CSA's two series over ``2 m`` slots; eps: the norm's epsilon.
        max_q: the most tokens of one sequence (default: read off ``cu_seqlens``, one transfer).
        check_values: check on the device (one transfer, before any launch) what the kernel relies on and raise a
            ValueError naming the argument: ``cu_seqlens`` rises from 0 to T, ``seq_lens`` holds each sequence's new
            rows, no sequence has more than ``max_q``, the table entries of every page read or written lie in their
            caches (and within the tables), ``cos`` has a row for every entry closing. ``False`` (CUDA graphs, hot
            loops) checks none of these and, with ``max_q`` given, never waits on the device; a broken promise
            makes the kernel read or write outside the tensors.
        config: launch parameters (default: the tuning database's, else the registered default).

    Non-finite values are not checked; they go through the pooling as in the reference: a NaN in a token's inputs
    makes NaN the entry of every window that reads it, never a finite number (a gate of -inf: a weight of 0).
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: must be a finite real number > 0, got {eps!r}")
    tensors = (kv, gate, kv_window, gate_window, window_table, entries, entry_table, cu_seqlens, seq_lens, ape,
               norm_weight, cos, sin)
    key, plan = _PLANS.find(tensors, (ratio, int(overlap) if isinstance(overlap, bool) else None, max_q), config)
    if plan is None:
        plan = _PLANS.put(key, _checked_plan(*tensors, ratio, overlap, max_q, config))
    most = plan.max_q
    if check_values:
        most = check_compress_values(kv, window_table, entry_table, cu_seqlens, seq_lens, kv_window.shape[0],
                                     entries.shape[0], cos.shape[0], plan)
    elif most is None:
        most = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if kv.shape[0] == 0 or most <= 0:
        return
    launch_with(compress_kernel, (plan.B, cdiv(most, plan.meta["M"])), plan.meta, kv, gate, kv_window, gate_window,
                window_table, entries, entry_table, cu_seqlens, seq_lens, ape, norm_weight, cos, sin, float(eps),
                *plan.strides)
