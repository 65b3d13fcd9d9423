"""Prefill grouped expert GEMM on FP8 tensor cores from MXFP4 weights: ``dt.fp8_grouped_gemm``.

``y_sorted[r] = x_sorted[r] @ W_e^T`` for the rows ``r`` of expert ``e`` (CSR ``expert_offsets``), MXFP4 weights.
Kernels: :mod:`.fp8_grouped_gemm_kernels`; launch configs: :data:`LAUNCH` (tiles ``BLOCK_M`` x ``BLOCK_N`` x
``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages``; the route, ``IN_REGISTERS``, and each route's own knobs,
:data:`REGISTERS_ROUTE_KNOBS` and :data:`WORKSPACE_ROUTE_KNOBS`, neutral on the other route; ``EXPERTS_PER_STAGE``
experts per workspace stage). One call:

1. quantizes ``x`` to e4m3 with one power-of-two scale per row (``_quantize_rows_kernel``; oracle
   :func:`.fp8_grouped_gemm_reference.quantize_rows_fp8_torch`, bit for bit), for the registers route in its
   interleaved k order (:func:`.mxfp4_to_fp8_kernels.interleave_blocks`: each thread's share of the MMA operand is
   then one 32-block's 16 contiguous code bytes);
2. reads ``expert_offsets`` on the host: the one sync (the tile schedule needs the per-expert row counts), on a
   side stream behind what produced them and not behind the quantization, which so runs while the host plans;
   or with ``check_values=False`` on the registers route plans the tiles on the device (:func:`plan_on_device`);
3. multiplies by one of two routes (config ``IN_REGISTERS``), both over row tiles of ``BLOCK_M`` rows of one
   expert x ``BLOCK_N`` output columns, ``GROUP_M`` row tiles per N column for L2 reuse (the tensor cores
   accumulate all of K at their own fp8 precision on the registers route and the row-scaled workspace route, as
   ``torch._scaled_mm(use_fast_accum=True)`` does; the per-group workspace route adds each BLOCK_K in fp32):

   - registers (1), ``_fused_gemm_kernel``: reads the MXFP4 codes and converts each weight tile to e4m3 on its
     way to the tensor cores (:func:`.mxfp4_to_fp8_kernels.e4m3_pairs`: three byte permutes per eight weights), the
     weights being the register operand of the MMA and the x tile the shared-memory one. Each weight row is taken
     relative to its largest block scale (:func:`.mxfp4_to_fp8.row_references`), so one scale per weight row and
     one per token apply after the K loop and the tensor cores accumulate the whole of K: the weights cross memory
     once, at 4.25 bits. Experts with a block more than 11 binades below its row's largest (rare in trained
     weights; exactness there needs per-group rescaling) take the workspace route;
   - workspace (0): stage ``s`` of ``EXPERTS_PER_STAGE`` experts is converted MXFP4 -> FP8 (:mod:`.mxfp4_to_fp8`,
     one fp32 scale per (row, 128-k group)) into half ``s % 2`` of a workspace lease on a side stream while the
     main stream runs the GEMM of stage ``s - 1`` from the other half (events order each half's conversion and
     GEMM; ``OVERLAP=0``: both on the main stream, in turn);
     ``_grouped_gemm_kernel`` adds ``dot(x_q, w_q^T) * sw[:, g]`` per 128-k group, the row scales of x after
     the loop. With ``ROW_SCALED`` the experts that fit their rows' references (as the registers route takes
     them) are converted against those references instead, so a row's group scales are equal and the GEMM is a
     plain FP8 GEMM with one weight scale per row after the loop (the faster route for many rows per expert,
     where the GEMM's tensor-core time outweighs the conversion's round trip); the other experts then follow,
     per group, in the same lease.

Why two streams rather than one persistent kernel for the workspace route: conversion is memory-bound integer
work, the GEMM tensor-core work; as two kernels on two streams the hardware runs conversion CTAs beside GEMM CTAs
with no hand-made synchronisation, each kernel keeps its tuned tiles, and the interpreter runs the same code in
order. Whether the overlap pays depends on the shape (``OVERLAP`` chooses, a tuned knob; measurements:
results/journal/moe.md): the GEMM fills every SM, so the overlap hides little of the shorter part. (The registers
route removes the round trip through memory.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import triton

from ..checks import check_kernel_device, check_out, check_tensor
from ..hostmath import cdiv
from ..launch import launch_with
from ..library import dsa_op, op_config
from ..plans import cached
from ..registry import LaunchSpace, bucket
from ..runtime import interpreting
from .fp8_grouped_gemm_kernels import _fused_gemm_kernel, _grouped_gemm_kernel, _quantize_rows_kernel
from .mxfp4_to_fp8 import check_experts_layout, check_scales, conversion_config, convert_experts, row_references
from .workspace import FP8Workspace, shared_workspace


# activation quantization: rows of up to QUANTIZE_TILE elements (padded to a power of two) are read once and kept in
# registers, a row tile of at least QUANTIZE_ROW elements a program (4 warps; up to 64 fp32 a thread); longer rows
# are read twice in steps of QUANTIZE_STEP (4 rows x 1024). Its rate against the copy bandwidth:
# scripts/quantize_bench.py (measured: results/journal/moe.md)
QUANTIZE_TILE = 8192
QUANTIZE_ROW = 2048
QUANTIZE_STEP = (4, 1024)


SPACE = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (32, 64, 128, 256),
    "BLOCK_K": (64, 128),  # divides the 128-k scale group
    "GROUP_M": (1, 4, 8, 16),
    "num_warps": (4, 8),
    # 1: no software pipelining, the registers route's wgmmas back to back on sm_90 (2-4 stages serialize them:
    # ptxas advisory C7515), at the cost of the prefetch: a choice to tune
    "num_stages": (1, 2, 3, 4, 5),
    "EXPERTS_PER_STAGE": (1, 2, 4, 8, 16, 32),  # workspace route
    "IN_REGISTERS": (0, 1),  # 1: the registers route (experts it cannot take still go through the workspace)
    # workspace route: 1 converts the experts that fit against their rows' references (one scale per row) and
    # runs a plain FP8 GEMM (no per-group rescaling in the k loop)
    "ROW_SCALED": (0, 1),
    # workspace route: 1 converts the next stage on a side stream while the GEMM of this one runs, 0 both on one
    # stream (which is faster depends on the matrix: a choice to tune, not a rule)
    "OVERLAP": (0, 1),
    # registers route: converted weights as the shared-memory MMA operand (which is faster depends on the tile:
    # a choice to tune)
    "W_SMEM": (0, 1),
    # registers route: k loop unrolled twice, its wgmmas back to back at any num_stages (sm_90 SASS); costs
    # registers, so fewer programs fit an SM
    "UNROLL": (1, 2),
}
WORKSPACE_LIMIT = 4 * 2**30  # bytes of two stages of FP8 experts
REGISTERS_ROUTE_KNOBS = {"W_SMEM": 0, "UNROLL": 1}  # the registers route's own knobs, at their workspace-route values
WORKSPACE_ROUTE_KNOBS = {"ROW_SCALED": 0, "OVERLAP": 1}  # the workspace route's own knobs, at registers-route values


def route_config(config: dict, in_registers: int, row_scaled: int = 0) -> dict:
    """``config`` for one route: ``IN_REGISTERS`` set (and ``ROW_SCALED`` on the workspace route; the registers
    route has no such choice, so ``row_scaled`` must then be 0), the other route's own knobs neutral."""
    if in_registers and row_scaled:
        raise ValueError("row_scaled is a choice of the workspace route (in_registers=0)")
    if in_registers:
        return {**config, "IN_REGISTERS": 1, **WORKSPACE_ROUTE_KNOBS}
    return {**config, "IN_REGISTERS": 0, **REGISTERS_ROUTE_KNOBS, "ROW_SCALED": row_scaled}


def _constraint(config, shape) -> str | None:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if config["IN_REGISTERS"] and bk != 128:
        return "the registers route steps through K by 128-k groups (BLOCK_K=128)"
    if not config["IN_REGISTERS"] and any(config[k] != v for k, v in REGISTERS_ROUTE_KNOBS.items()):
        return f"{', '.join(REGISTERS_ROUTE_KNOBS)} are choices of the registers route"
    if config["IN_REGISTERS"] and any(config[k] != v for k, v in WORKSPACE_ROUTE_KNOBS.items()):
        return f"{', '.join(WORKSPACE_ROUTE_KNOBS)} are choices of the workspace route"
    if config["num_stages"] * config["UNROLL"] * (bm + bn) * bk > 200 * 1024:
        return "x and w tiles of all pipeline stages (twice unrolled: twice as many) exceed 200 KB of shared memory"
    if bm * bn > 128 * 32 * config["num_warps"]:
        return "accumulator over 128 fp32 registers per thread"
    if bm > max(16, bucket(shape["M"])):
        return "BLOCK_M exceeds the routed rows"
    if config["EXPERTS_PER_STAGE"] > bucket(shape["E"]):
        return "a stage larger than the expert count"
    if 2 * config["EXPERTS_PER_STAGE"] * shape["N"] * shape["K"] > WORKSPACE_LIMIT:
        return "workspace (two stages of FP8 experts) over 4 GiB"
    return None


REGISTERS_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
WORKSPACE_TILE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def _default(phase, shape):
    """The registers route up to 256 routed rows per expert: 128 x 128 tiles and 4 warps from 128 rows per expert,
    64 x 128 below (fewer wasted rows in an expert's last tile). Above 256 rows per expert the row-scaled workspace
    route with :data:`WORKSPACE_TILE`: there the GEMM's tensor-core time outweighs the conversion's round trip
    through memory. (The measurements behind these bounds: results/journal/moe.md.)"""
    rows_tile = max(16, bucket(shape["M"]))  # the constraint's bound on BLOCK_M (few routed rows)
    if shape["M"] * shape["N"] * shape["K"] < 2**24:  # interpreter-sized: few programs, still two stages
        return route_config({"BLOCK_M": min(32, rows_tile), "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
                             "num_warps": 4, "num_stages": 2, "EXPERTS_PER_STAGE": min(2, bucket(shape["E"])),
                             **REGISTERS_ROUTE_KNOBS}, 1)
    stage = min(8, bucket(shape["E"]))
    while stage > 1 and 2 * stage * shape["N"] * shape["K"] > WORKSPACE_LIMIT:  # the constraint's bound
        stage //= 2
    rows_per_expert = shape["M"] / max(1, shape["E"])
    config = route_config({**REGISTERS_TILE, **REGISTERS_ROUTE_KNOBS, "EXPERTS_PER_STAGE": stage,
                           "BLOCK_M": min(128 if rows_per_expert >= 128 else 64, rows_tile)}, 1)
    if rows_per_expert > 256:
        config = {**route_config(config, 0, row_scaled=1), **WORKSPACE_TILE}
    return config


LAUNCH = LaunchSpace(name="fp8_grouped_gemm", phases=("prefill",), space=SPACE, default=_default,
                     fixed_dims=("E", "N", "K"), bucketed_dims=("M",), constraint=_constraint)


def interleaves(k: int, kb: int) -> bool:
    """Whether the registers route reads ``x`` in :func:`.mxfp4_to_fp8_kernels.interleave_blocks` order: K of whole
    128-k groups (``K = 32 kb``, ``kb`` a multiple of 4), its ``EVEN_K``."""
    return k == 32 * kb and kb % 4 == 0


@cached
def _quantize_meta(k: int, interleaved: bool, tile: int, row: int, step_m: int, step_k: int) -> dict:
    """The activation quantization's keyword arguments for rows of ``k``: rows of up to ``tile`` elements in
    registers, ``row`` elements or more a program (else steps of ``step_m`` rows x ``step_k``); software rounding
    in the interpreter (:mod:`..fp8_rounding`)."""
    one_pass = triton.next_power_of_2(k) <= tile
    block_k = triton.next_power_of_2(k) if one_pass else step_k
    block_m = max(1, row // block_k) if one_pass else step_m
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=one_pass, INTERLEAVED=interleaved,
                SOFTWARE_ROUND=interpreting(), num_warps=4)


def quantize_meta(k: int, interleaved: bool) -> dict:
    """The activation quantization's keyword arguments for rows of ``k`` under the module's current constants."""
    return _quantize_meta(k, interleaved, QUANTIZE_TILE, QUANTIZE_ROW, *QUANTIZE_STEP)


def quantize_activations_fp8(x: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[M, K]`` fp16/bf16/fp32 (rows contiguous) -> ``(q e4m3 [M, K], scale fp32 [M])``, launch only.
    ``interleaved`` (K a multiple of 128): ``q``'s k order is :func:`.mxfp4_to_fp8_kernels.interleave_blocks`'s."""
    m, k = x.shape
    if interleaved and k % 128:
        raise ValueError(f"x: the interleaved k order needs K a multiple of 128, got {k}")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        meta = quantize_meta(k, interleaved)
        launch_with(_quantize_rows_kernel, (cdiv(m, meta["BLOCK_M"]),), meta, x, q, s, m, k, x.stride(0), q.stride(0))
    return q, s


@dataclass(frozen=True)
class StagePlan:
    """Schedule of one route.

    - ``experts`` int32 ``[A]`` (device): the experts with rows (of those the route takes), in order;
    - ``tiles`` int32 ``[n_tiles, 3]`` (device): per row tile, (slot of its expert within its stage, first row,
      end row of the expert); slot -1 (registers route planned on the device only): rows of no expert, written
      as zeros;
    - ``stages``: per stage, (first, end) into ``experts`` and (first, end) into ``tiles``.
    """

    stage_size: int
    experts: torch.Tensor
    tiles: torch.Tensor
    stages: tuple[tuple[int, int, int, int], ...]


def plan_stages(offsets: list[int], block_m: int, stage_size: int | None, device: torch.device,
                take: list[bool] | None = None) -> StagePlan:
    """Row tiles of ``block_m`` rows per active expert (of those ``take`` marks), experts in stages of
    ``stage_size`` (None: one stage), built with numpy on the host and copied to ``device`` without waiting for it
    (pinned memory, asynchronous: the GPU may still be running earlier work)."""
    off = np.asarray(offsets, dtype=np.int64)
    counts = np.diff(off)
    chosen = counts > 0 if take is None else (counts > 0) & np.asarray(take, dtype=bool)
    active = np.flatnonzero(chosen)
    stage_size = stage_size or max(1, active.size)
    start, count = off[:-1][active], counts[active]
    tiles_per = (count + block_m - 1) // block_m
    tile_expert = np.repeat(np.arange(active.size), tiles_per)
    bounds = np.concatenate([[0], np.cumsum(tiles_per)])
    local = np.arange(tile_expert.size) - bounds[tile_expert]
    tiles = np.stack([tile_expert % stage_size, start[tile_expert] + local * block_m, (start + count)[tile_expert]], 1)
    packed = torch.from_numpy(np.concatenate([active, tiles.ravel()]).astype(np.int32))  # one host-to-device copy
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    n_active = active.size
    edges = list(range(0, n_active, stage_size)) + [n_active]
    bounds = bounds.tolist()
    stages = tuple((a, b, bounds[a], bounds[b]) for a, b in zip(edges[:-1], edges[1:]))
    return StagePlan(stage_size, packed[:n_active], packed[n_active:].view(-1, 3), stages)


def plan_on_device(expert_offsets: torch.Tensor, block_m: int, rows: int) -> StagePlan:
    """The registers route's schedule (every expert taken, one stage) from the device's ``expert_offsets`` without
    reading them on the host: torch ops only, so no sync and capturable in a CUDA graph. The row ranges before the
    first expert and after the last become zero tiles (slot -1), and the schedule is padded with empty ones (slot
    -1, no rows) to its bound ``cdiv(rows, block_m) + E + 2``. Offsets outside ``[0, rows]`` or decreasing are
    clamped into a non-decreasing sequence first, so unchecked values keep every row read in bounds."""
    e = expert_offsets.shape[0] - 1
    device = expert_offsets.device
    bounds = torch.cat([expert_offsets.new_zeros(1), expert_offsets, expert_offsets.new_full((1,), rows)])
    bounds = torch.cummax(bounds.long().clamp(0, rows), 0).values  # [E + 3]: segment s = [bounds[s], bounds[s+1])
    tiles_per = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m  # [E + 2]: zero rows, E experts, zero rows
    ends = torch.cumsum(tiles_per, 0)
    index = torch.arange(cdiv(rows, block_m) + e + 2, device=device)
    segment = torch.searchsorted(ends, index, right=True).clamp(max=e + 1)  # past the last tile: padding
    used = index < ends[-1]
    row0 = bounds[segment] + (index - (ends[segment] - tiles_per[segment])) * block_m
    slot = torch.where(used & (segment >= 1) & (segment <= e), segment - 1, -1)
    tiles = torch.stack([slot, torch.where(used, row0, 0), torch.where(used, bounds[segment + 1], 0)], dim=1)
    experts = torch.arange(e, dtype=torch.int32, device=device)
    return StagePlan(max(1, e), experts, tiles.to(torch.int32), ((0, e, 0, tiles.shape[0]),))


@cached
def _gemm_meta(block_m: int, block_n: int, block_k: int, group_m: int, even_k: bool, row_scaled: bool,
               num_warps: int, num_stages: int) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=even_k,
                ROW_SCALED=row_scaled, num_warps=num_warps, num_stages=num_stages)


def launch_gemm(xq, sx, w_half, s_half, y, tiles, config, row_scaled: bool = False) -> None:
    """The FP8 GEMM of one workspace stage: rows ``tiles`` of ``xq`` against the stage's experts in ``w_half`` /
    ``s_half`` (``row_scaled``: converted against their rows' references, one scale per row)."""
    n_mtiles = tiles.shape[0]
    n, k = y.shape[1], xq.shape[1]
    if n_mtiles == 0:
        return
    grid = (n_mtiles * cdiv(n, config["BLOCK_N"]),)
    meta = _gemm_meta(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["GROUP_M"],
                      k % config["BLOCK_K"] == 0, row_scaled, config["num_warps"], config["num_stages"])
    launch_with(
        _grouped_gemm_kernel, grid, meta, xq, sx, w_half, s_half, y, tiles, n_mtiles, n, k,
        xq.stride(0), w_half.stride(0), w_half.stride(1), s_half.stride(0), s_half.stride(1), s_half.stride(2),
        y.stride(0),
    )


@cached
def _fused_meta(block_m: int, block_n: int, group_m: int, w_smem: int, even_k: bool, ptx: bool, unroll: int,
                num_warps: int, num_stages: int) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m, W_SMEM=w_smem, EVEN_K=even_k, PTX=ptx,
                UNROLL=unroll, num_warps=num_warps, num_stages=num_stages)


def launch_fused(xq, sx, blocks, scales, ref, y, plan: StagePlan, config) -> None:
    """The registers route: every tile of ``plan`` (one stage) in one launch, weights read as MXFP4; ``xq`` in
    :func:`.mxfp4_to_fp8_kernels.interleave_blocks` order where :func:`interleaves`."""
    n_mtiles = plan.tiles.shape[0]
    (n, kb), k = scales.shape[1:], xq.shape[1]
    if n_mtiles == 0:
        return
    pairs = blocks.view(torch.int32)  # [E, N, K/32, 4]: eight codes per element
    grid = (n_mtiles * cdiv(n, config["BLOCK_N"]),)
    meta = _fused_meta(config["BLOCK_M"], config["BLOCK_N"], config["GROUP_M"], config["W_SMEM"], interleaves(k, kb),
                       xq.device.type == "cuda" and torch.version.hip is None, config["UNROLL"],
                       config["num_warps"], config["num_stages"])
    launch_with(
        _fused_gemm_kernel, grid, meta, xq, sx, pairs, scales, ref, y, plan.tiles, plan.experts, n_mtiles, n, k, kb,
        xq.stride(0), pairs.stride(0), pairs.stride(1), scales.stride(0), scales.stride(1), ref.stride(0),
        y.stride(0),
    )


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def run_stages(plan: StagePlan, blocks, scales, xq, sx, y, w_slots, s_slots, config, convert_config, *,
               unfit: torch.Tensor | None = None, row_ref: torch.Tensor | None = None, overlap: bool = True,
               convert: bool = True, gemm: bool = True) -> None:
    """Enqueue every stage: conversion into alternating workspace halves, GEMM from them.

    ``w_slots [S, N, K]`` / ``s_slots [S, N, G]``: the leased slots, ``S`` = one or two stages' worth.
    ``row_ref`` (uint8 ``[E, N]``, for experts that fit it): convert against each row's reference and accumulate
    all of K on the tensor cores (else one scale per (row, 128-k group), applied per k step).
    ``overlap`` puts the conversions on a side stream (CUDA only); ``convert`` / ``gemm`` = False leave
    that part out (to time the other alone).
    """
    size = plan.stage_size
    halves = [(w_slots[i:i + size], s_slots[i:i + size]) for i in range(0, w_slots.shape[0], size)]
    cuda = y.device.type == "cuda"
    main = torch.cuda.current_stream(y.device) if cuda else None
    side = _side_stream(y.device) if cuda and overlap else None
    if side is not None:
        side.wait_stream(main)  # the lease's ordering against earlier holders was enqueued on main
        converted = [torch.cuda.Event(), torch.cuda.Event()]
        consumed = [torch.cuda.Event(), torch.cuda.Event()]
    for i, (a0, a1, t0, t1) in enumerate(plan.stages):
        w_half, s_half = halves[i % len(halves)]
        if convert:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if side is not None and i >= 2:
                    side.wait_event(consumed[i % 2])
                convert_experts(blocks, scales, plan.experts[a0:a1], w_half, s_half, unfit, convert_config, row_ref)
                if side is not None:
                    converted[i % 2].record(side)
        if gemm:
            if side is not None:
                main.wait_event(converted[i % 2])
            launch_gemm(xq, sx, w_half, s_half, y, plan.tiles[t0:t1], config, row_ref is not None)
            if side is not None:
                consumed[i % 2].record(main)
    if side is not None:
        main.wait_stream(side)


def _check(x_sorted, expert_offsets, blocks, scales, workspace, unfit_counter) -> torch.device:
    check_tensor("x_sorted", x_sorted, dtype=(torch.float16, torch.bfloat16), ndim=2)
    device = check_kernel_device("x_sorted", x_sorted)
    check_tensor("blocks", blocks, dtype=torch.uint8, ndim=4, device=device)
    e, n, kb, width = blocks.shape
    if width != 16:
        raise ValueError(f"blocks: expected shape [E, N, K/32, 16], got {tuple(blocks.shape)}")
    check_tensor("scales", scales, dtype=torch.uint8, shape=(e, n, kb), device=device)
    check_experts_layout("experts", blocks, scales)
    if not 32 * (kb - 1) < x_sorted.shape[1] <= 32 * kb:
        raise ValueError(f"x_sorted: K = {x_sorted.shape[1]} does not match the weights' K/32 = {kb} blocks")
    check_tensor("expert_offsets", expert_offsets, dtype=(torch.int32, torch.int64), shape=(e + 1,), device=device)
    if workspace is not None and (not isinstance(workspace, FP8Workspace) or workspace.device != device):
        raise ValueError(f"workspace: expected an FP8Workspace on {device}")
    if unfit_counter is not None:
        check_tensor("unfit_counter", unfit_counter, dtype=torch.int32, shape=(1,), device=device)
    return device


def _host_offsets(expert_offsets: torch.Tensor, rows: int, after: torch.cuda.Event | None = None) -> list[int]:
    """``expert_offsets`` read on the host and checked (non-decreasing within ``[0, rows]``). ``after`` (CUDA): the
    copy runs on the side stream once the current stream has reached that event, so the host waits for the
    offsets' producers but not for the work enqueued since (the activation quantization then runs on the GPU while
    the host plans the tiles)."""
    if after is None:
        offsets = expert_offsets.tolist()
    else:
        side = _side_stream(expert_offsets.device)
        host = torch.empty(expert_offsets.shape, dtype=expert_offsets.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            side.wait_event(after)
            host.copy_(expert_offsets, non_blocking=True)
        side.synchronize()
        offsets = host.tolist()
    if offsets[0] < 0 or offsets[-1] > rows or any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(f"expert_offsets: must be non-decreasing within [0, {rows}], got {offsets[:8]}...{offsets[-2:]}")
    return offsets


def fp8_grouped_gemm(x_sorted: torch.Tensor, expert_offsets: torch.Tensor, blocks: torch.Tensor,
                     scales: torch.Tensor, *, config: dict | None = None, workspace: FP8Workspace | None = None,
                     unfit_counter: torch.Tensor | None = None, check_values: bool = True,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped GEMM of expert-sorted rows with MXFP4 weights on FP8 tensor cores (module docstring: the routes).

    - ``x_sorted`` bf16/fp16 ``[M, K]`` (rows contiguous), rows of expert ``e`` at
      ``expert_offsets[e] : expert_offsets[e + 1]`` (int32/int64 ``[E + 1]``, non-decreasing in ``[0, M]``);
    - ``blocks`` uint8 ``[E, N, K_w/32, 16]``, ``scales`` uint8 ``[E, N, K_w/32]``; ``K_w`` is ``K`` rounded up to 32
      (the padding columns are ignored). A 0xFF (NaN) scale: ``ValueError`` naming its block with ``check_values``
      (the scan is cached per tensor and in-place version), else NaN in the outputs of that weight row for the
      rows of its expert;
    - ``config``: a ``fp8_grouped_gemm`` config (None: the tuning database's for this shape);
    - ``workspace``: default the device's :func:`shared_workspace` (leased only when an expert takes the
      workspace route, whose conversions run on a side stream); one given must hold ``2 * EXPERTS_PER_STAGE``
      slots of ``[N, K_w]`` where an expert may take that route (whatever the offsets), else a ValueError naming
      it before any launch;
    - ``unfit_counter`` int32 ``[1]``: if given, the number of unfit blocks (see :mod:`.mxfp4_to_fp8_reference`) is
      added to it, no sync (the registers and row-scaled routes only take experts that have none).

    - ``check_values`` (default): read ``expert_offsets`` on the host (one sync, behind the activation
      quantization: the GPU quantizes while the host plans), check them and plan the tiles there. False, on the
      registers route with every expert fitting it (trained weights: see :func:`.mxfp4_to_fp8.row_references`,
      whose first call per weight syncs once): plan on the device (:func:`plan_on_device`), no sync, so the call can be
      captured in a CUDA graph and an eager caller's host work overlaps the GPU's; the offsets are trusted (kept in
      bounds, not checked). Otherwise as True.

    Returns ``y_sorted [M, N]`` in ``x_sorted``'s dtype (rows outside every expert are 0; a row of ``x_sorted``
    holding NaN or inf gives a NaN row), written into ``out`` when given (last dim contiguous, any row stride).
    """
    device = _check(x_sorted, expert_offsets, blocks, scales, workspace, unfit_counter)
    m, (e, n, kb) = x_sorted.shape[0], scales.shape
    shape = {"M": m, "E": e, "N": n, "K": 32 * kb}
    config = LAUNCH.launch_config("prefill", shape, device) if config is None else LAUNCH.validate(config, shape)
    if out is not None:
        check_out(out, (m, n), x_sorted.dtype, device, contiguous=False)
    if check_values:
        check_scales("scales", scales)
    y = torch.empty(m, n, dtype=x_sorted.dtype, device=device) if out is None else out
    with prefill_call(x_sorted, expert_offsets, blocks, scales, y, config, workspace, unfit_counter,
                      trusted=not check_values) as run:
        run()
    return y


@contextlib.contextmanager
def prefill_call(x_sorted, offsets: list[int] | torch.Tensor, blocks, scales, y, config, workspace=None, unfit=None,
                 trusted: bool = False):
    """Quantize ``x`` for the routes the config and the weights take, plan them, lease the workspace if an expert
    takes that route; yields ``run(overlap=, convert=, gemm=)``, which enqueues everything into ``y`` and may be
    called again while the lease is held (``overlap``: the config's ``OVERLAP`` unless given; ``convert`` /
    ``gemm`` = False leave that part of the workspace route out, to time the other); ``run.leased_slots``: the
    workspace slots the call holds (0 without a workspace route).

    ``offsets``: a checked host list, or the device tensor: ``trusted`` on the registers route with every expert
    fitting it, planned on the device (no sync); else read and checked on the host behind the quantization, and
    the rows outside every expert zeroed."""
    e, n, kb = scales.shape
    block_m, stage = config["BLOCK_M"], config["EXPERTS_PER_STAGE"]
    ref, fits = row_references(scales) if config["IN_REGISTERS"] or config["ROW_SCALED"] else (None, [False] * e)
    # the experts of each route (known before the offsets): the registers route or the row-scaled workspace route
    # takes those that fit their rows' references, the workspace route with a scale per (row, 128-k group) the rest
    fused_take = fits if config["IN_REGISTERS"] and any(fits) else None
    staged_takes = [] if config["IN_REGISTERS"] or not any(fits) else [(fits, ref)]
    if not all(fits):
        staged_takes.append(([not f for f in fits], None))
    if staged_takes and workspace is not None and not workspace.holds(2 * stage, n, 32 * kb):
        raise ValueError(f"workspace: the workspace route needs {2 * stage} slots of [{n}, {32 * kb}], got one of "
                         f"{workspace.slots} slots sized for {workspace.shapes}")
    on_device = isinstance(offsets, torch.Tensor) and trusted and fused_take is not None and all(fused_take)
    read_on_host = isinstance(offsets, torch.Tensor) and not on_device
    ready = None
    if read_on_host and y.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(y.device))
    # x in the k order of each route taken (one quantization where the orders agree), launched before the offsets
    # are read on the host
    interleaved = interleaves(x_sorted.shape[1], kb)
    fused_x = quantize_activations_fp8(x_sorted, interleaved) if fused_take is not None else None
    staged_x = None
    if staged_takes:
        staged_x = fused_x if fused_x is not None and not interleaved else quantize_activations_fp8(x_sorted)
    if read_on_host:
        offsets = _host_offsets(offsets, y.shape[0], ready)
    if not on_device:  # (a plan made on the device has tiles for these rows)
        y[: offsets[0]].zero_()
        y[offsets[-1]:].zero_()
    fused = None
    if fused_take is not None:
        fused = (plan_on_device(offsets, block_m, y.shape[0]) if on_device
                 else plan_stages(offsets, block_m, None, y.device, take=fused_take))
    staged = [(plan_stages(offsets, block_m, stage, y.device, take=take), row_ref) for take, row_ref in staged_takes]
    staged = [(plan, row_ref) for plan, row_ref in staged if plan.stages]
    with contextlib.ExitStack() as stack:
        if staged:
            slots = stage * min(2, max(len(plan.stages) for plan, _ in staged))
            workspace = workspace or shared_workspace(y.device, slots, n, 32 * kb)
            w_slots, s_slots = stack.enter_context(workspace.acquire(slots)).views(n, 32 * kb)
            convert_config = conversion_config(stage, n, 32 * kb, y.device)

        def run(overlap: bool | None = None, convert: bool = True, gemm: bool = True) -> None:
            if fused is not None and fused.stages and gemm:
                launch_fused(*fused_x, blocks, scales, ref, y, fused, config)
            for plan, row_ref in staged:
                run_stages(plan, blocks, scales, *staged_x, y, w_slots, s_slots, config, convert_config, unfit=unfit,
                           row_ref=row_ref, overlap=bool(config["OVERLAP"]) if overlap is None else overlap,
                           convert=convert, gemm=gemm)

        run.leased_slots = slots if staged else 0
        yield run


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

_HOST_READS = "the expert offsets, for the tile plan, unless the registers route takes every expert"


@dsa_op("fp8_grouped_gemm", mutates_args=("unfit_counter",), host_reads=_HOST_READS)
def fp8_grouped_gemm_op(x_sorted: torch.Tensor, expert_offsets: torch.Tensor, blocks: torch.Tensor,
                        scales: torch.Tensor, unfit_counter: torch.Tensor | None = None, check_values: bool = True,
                        config: str | None = None) -> torch.Tensor:
    """:func:`dt.fp8_grouped_gemm` on the shared workspace: ``y_sorted [M, N]`` in ``x_sorted``'s dtype;
    ``unfit_counter`` (int32 ``[1]``) is added to in place."""
    return fp8_grouped_gemm(x_sorted, expert_offsets, blocks, scales, config=op_config(config),
                            unfit_counter=unfit_counter, check_values=check_values)


@fp8_grouped_gemm_op.register_fake
def _(x_sorted, expert_offsets, blocks, scales, *args, **kwargs):
    return x_sorted.new_empty((x_sorted.shape[0], blocks.shape[1]))


@dsa_op("fp8_grouped_gemm_out", mutates_args=("out", "unfit_counter"), host_reads=_HOST_READS)
def fp8_grouped_gemm_out(x_sorted: torch.Tensor, expert_offsets: torch.Tensor, blocks: torch.Tensor,
                         scales: torch.Tensor, out: torch.Tensor, unfit_counter: torch.Tensor | None = None,
                         check_values: bool = True, config: str | None = None) -> None:
    """:func:`dt.fp8_grouped_gemm` into ``out[M, N]`` in ``x_sorted``'s dtype (last dim contiguous)."""
    fp8_grouped_gemm(x_sorted, expert_offsets, blocks, scales, config=op_config(config), unfit_counter=unfit_counter,
                     check_values=check_values, out=out)


@fp8_grouped_gemm_out.register_fake
def _(x_sorted, expert_offsets, blocks, scales, out, *args, **kwargs):
    return None
