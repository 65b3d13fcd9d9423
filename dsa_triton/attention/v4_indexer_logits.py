"""DeepSeek-V4's Lightning-indexer logits over compressed keys: ``dt.v4_indexer_logits``.

``score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) * softmax_scale`` (transformers' ``DeepseekV4IndexerScorer``:
queries and keys in the activation dtype, products in fp32) for the compressed entries ``s < limits[t]`` of row
``t``'s sequence, ``-inf`` elsewhere, the keys paged (the CSA stream's indexer keys, through a block table). Top-k
of the logits: :func:`dsa_triton.topk_indices`. DeepSeek-V3.2's FP8 indexer (:mod:`.indexer_logits`) runs the same
kernel: here over keys in q's dtype, the softmax scale standing in for its key scales (a row of the scale a key,
kept per cache size). Launch configs come from the tuning database through the registry (:data:`LAUNCH`, the
parameters of :data:`.indexer_logits.LAUNCH`) unless ``config`` is given.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch

from ..checks import check_kernel_device, check_out, check_tensor
from ..hostmath import next_pow2
from ..plans import PlanCache
from ..registry import LaunchSpace
from .indexer_checks import DeviceChecks, QueryRows, check_block_table, check_size
from .indexer_logits import LAUNCH as FP8_LAUNCH, LogitsLaunch, call_cu, logits_shape, made_cu, tile_error
from .indexer_logits_kernels import DENSE

DTYPES = (torch.bfloat16, torch.float16)
KEY_BYTES = 2
MAX_PAGES_A_CHUNK = 4096  # page-table entries a program holds (CHUNK / P)


def _default(phase: str, shape) -> dict:
    """Decode: a sequence's rows in one program, 128-key tiles; prefill: 2 rows, 64-key tiles; the longest chunk of at
    most ``MAX_PAGES_A_CHUNK`` pages, then fewer stages until the tiles fit."""
    block_m = next_pow2(shape["Q"]) if phase == "decode" else 2
    block_n, warps = (128, 8) if block_m == 1 else (64, 4)
    chunk = min(16384, MAX_PAGES_A_CHUNK * shape["P"])
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "CHUNK": max(chunk, block_n), "num_warps": warps,
              "num_stages": 3}
    while config["num_stages"] > 1 and _constraint(config, shape):
        config["num_stages"] -= 1
    return config


def _constraint(config: dict, shape) -> str | None:
    if config["CHUNK"] % config["BLOCK_N"]:
        return "CHUNK must be a multiple of BLOCK_N"
    if config["CHUNK"] // shape["P"] > MAX_PAGES_A_CHUNK:
        return f"CHUNK / P = {config['CHUNK'] // shape['P']} pages a program (> {MAX_PAGES_A_CHUNK})"
    return tile_error(config["BLOCK_N"], config["BLOCK_M"], shape["H"], shape["DK"], config["num_warps"],
                      config["num_stages"], key_bytes=KEY_BYTES)


LAUNCH = LaunchSpace(name="v4_indexer_logits", phases=FP8_LAUNCH.phases, space=FP8_LAUNCH.space, default=_default,
                     fixed_dims=FP8_LAUNCH.fixed_dims, bucketed_dims=FP8_LAUNCH.bucketed_dims,
                     constraint=_constraint)


@functools.lru_cache(maxsize=16)
def _scale_rows(num_slots: int, scale: float, device: torch.device) -> torch.Tensor:
    """``[num_slots]`` fp32 of ``scale``: the kernel's key scales (one allocation per cache size and scale)."""
    return torch.full((num_slots,), scale, dtype=torch.float32, device=device)


def _check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values: bool) -> QueryRows:
    """q ``[T, H, DK]`` bf16 / fp16 (heads dense rows), weights ``[T, H]`` fp32, limits ``[T]`` int32 (>= 0), cu
    ``[B + 1]`` int32 rising from 0 to T (default: one sequence)."""
    check_tensor("q", q, dtype=DTYPES, ndim=3)
    device = check_kernel_device("q", q)
    T, H, DK = q.shape
    if H > 1 and q.stride(1) < DK:
        raise ValueError(f"q: heads must be dense rows of DK elements, got strides {q.stride()}")
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=device)
    check_tensor("limits", limits, dtype=torch.int32, shape=(T,), device=device)
    if not limits.is_contiguous():
        raise ValueError(f"limits: must be contiguous, got strides {limits.stride()}")
    if cu_seqlens_q is None:
        cu_seqlens_q, max_q = torch.tensor([0, T], dtype=torch.int32, device=device), T
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1, device=device)
    if cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q: needs B + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
    cu = cu_seqlens_q.contiguous()
    rows = QueryRows(device, T, H, DK, cu, DeviceChecks(check_values), check_size("max_q", max_q))
    rows.checks.fail_if(lambda: (cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any(),
                        f"cu_seqlens_q: must rise from 0 to T = {T}")
    if max_q is not None:
        rows.checks.fail_if(lambda: (cu[1:] - cu[:-1]) > max_q, f"max_q: a sequence has more than {max_q} rows")
    rows.checks.fail_if(lambda: limits < 0, "limits: must be >= 0")
    return rows


def _checked_plan(q, weights, k, limits, block_table, seq_lens, cu_seqlens_q, num_cols, max_q, check_values,
                  config) -> tuple:
    """Every check (the value checks in one transfer); returns the launch and the ``cu`` made for an absent one."""
    rows = _check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values)
    check_tensor("k", k, dtype=q.dtype, ndim=3, device=rows.device)
    num_pages, P, DK = k.shape
    if P < 1 or P & (P - 1):
        raise ValueError(f"k: page size (dimension 1) must be a power of two, got {P}")
    if DK != rows.DK:
        raise ValueError(f"k: last dimension must be DK = {rows.DK}, got shape {tuple(k.shape)}")
    if num_pages > 1 and k.stride(0) != P * k.stride(1):
        raise ValueError(f"k: pages must be evenly strided (stride(0) == P * stride(1)), got strides {k.stride()}")
    check_block_table(rows, block_table, seq_lens, limits, num_pages, P)
    rows.finish(limits, need_max_limit=num_cols is None)
    L = check_size("num_cols", num_cols, rows.max_limit)
    phase, shape = logits_shape(rows, L, P)
    config = LAUNCH.launch_config(phase, shape, rows.device) if config is None else LAUNCH.validate(config, shape)
    strides = (q.stride(0), q.stride(1), weights.stride(0), k.stride(1), block_table.stride(0), L, 0)
    launch = LogitsLaunch(DENSE, rows.T, rows.H, rows.DK, rows.B, rows.max_q, L, strides, config, P, paged=True)
    return launch, made_cu(rows, cu_seqlens_q)


_PLANS = PlanCache()


def v4_indexer_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, limits: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float, *,
                      cu_seqlens_q: torch.Tensor | None = None, num_cols: int | None = None, max_q: int | None = None,
                      check_values: bool = True, config: dict | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V4 indexer logits ``[T, num_cols]`` fp32, ``-inf`` outside ``[0, limits[t])``.

    Args:
        q: ``[T, H, DK]`` bf16 / fp16 indexer queries (64 x 128 in DeepSeek-V4, rotated), packed by sequence.
        weights: ``[T, H]`` fp32 head weights (DeepSeek-V4: ``weights_proj(x) x H^-0.5``).
        k: ``[num_pages, P, DK]`` in q's dtype: the compressed indexer keys (P a power of two); entry ``i`` of
            sequence ``b`` at row ``block_table[b, i // P] * P + i % P``.
        limits: ``[T]`` int32: row ``t`` scores entries ``0 .. limits[t] - 1`` (DeepSeek-V4: ``(position + 1) //
            ratio``, the entries whose window closed at or before the token).
        block_table: ``[>= B, max_pages]`` int32; seq_lens: ``[>= B]`` int32, entries in each sequence.
        softmax_scale: multiplies each relu'd product (DeepSeek-V4: ``DK^-0.5``).
        cu_seqlens_q: ``[B + 1]`` int32: rows of sequence ``b`` are ``cu[b] .. cu[b + 1]`` (default: one sequence).
        num_cols: output width ``L`` (default ``max(limits)``); limits past it are cut at it.
        max_q: the most rows of one sequence (default: read off ``cu_seqlens_q``).
        check_values: check on the device (one transfer, before any launch) and raise a ValueError naming the
            argument: ``cu_seqlens_q`` rises from 0 to T, no sequence has more than ``max_q`` rows, ``limits >= 0``,
            ``seq_lens`` within the table and no row's limit past its sequence's, every block-table entry of a page
            in use inside ``k``. ``False`` skips them (with ``num_cols`` and ``max_q`` given the call never waits on
            the device: CUDA-graph safe); a broken promise makes the kernel read or write outside the tensors.
        config: launch parameters (default: the tuning database's, else the registered default).
        out: optional ``[T, num_cols]`` fp32 contiguous tensor to write (and return).

    Non-finite values are not checked: a NaN in q, a weight or a key makes NaN every logit it enters (relu keeps
    NaN), never a finite number.
    """
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: must be a finite real number, got {softmax_scale!r}")
    key = plan = None
    if not check_values and num_cols is not None and (cu_seqlens_q is None or max_q is not None):  # no device value
        key, plan = _PLANS.find((q, weights, k, limits, block_table, seq_lens, cu_seqlens_q, out), (num_cols, max_q),
                                config)
    if plan is None:
        plan = _checked_plan(q, weights, k, limits, block_table, seq_lens, cu_seqlens_q, num_cols, max_q,
                             check_values, config)
        if out is not None:
            check_out(out, plan[0].shape, torch.float32, q.device)
        plan = _PLANS.put(key, plan)
    launch, made = plan
    cu = call_cu(made, cu_seqlens_q)
    scales = _scale_rows(k.shape[0] * k.shape[1], float(softmax_scale), k.device)
    if out is None:
        out = torch.empty(launch.shape, dtype=torch.float32, device=q.device)
    return launch(q, weights, k, k, scales, out, cu, limits, cu, block_table, cu, cu)
