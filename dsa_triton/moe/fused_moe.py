"""Fused MXFP4 grouped GEMM (the decode path): weights dequantized in registers, read once per row block.

``y_sorted[r] = x_row(r) @ W[e(r)].T`` for every routed row ``r`` sorted by expert (:class:`.permute.ExpertSort`),
with ``W[e]`` given as MXFP4 ``blocks[E, N, K/32, 16]`` / ``scales[E, N, K/32]``.

One program owns (row block, N tile, K split). Row blocks come from the block-aligned layout
(:meth:`ExpertSort.aligned`): one expert per block, padding rows -1, blocks past the end -1 (the program
returns at once), so the grid size is a host-side bound and nothing syncs. The tile is computed
transposed on tensor cores, ``acc[BLOCK_N, BLOCK_M] += W[BLOCK_N, k] @ x[k, BLOCK_M]``: the weights are the
long side (the MMA's A operand, from registers), the routed rows the short one (padded to ``BLOCK_M``: 8 rows
run on mma.sync m16n8k16, 16 and more on wgmma where the tile allows).

- the codes are read as int16 *quarters* ``[BLOCK_N, BLOCK_K / 4]`` (quarter ``q`` of a row holds k = 4q .. 4q+3,
  nibble ``c`` being k = 4q + c): each nibble position ``c`` is a weight *class*, and the tile is four dots, one
  per class, against the activations of that class: from class-major activations ``x[rows, 4, K/4]``
  (:func:`.activation_reference.class_major`; given so by the caller, as the layer's down GEMM gets them from
  :func:`.activation.swiglu`, or copied so per call, ``X_COPY=1``: one small transpose kernel) or split in
  registers from a contiguous load of ``x[rows, K]`` itself (``X_COPY=0``: no second kernel, ~10-55 more
  registers a thread on sm_90; H200 T = 1 down: kernel 29.0 us vs 23.6 on class-major rows);
- bf16 activations on the GPU: two neighbouring quarters are one 32-bit register, and a few integer ops per
  class (inline PTX) turn it into a bf16x2 pair ``code * 2^-126`` (exact: the E2M1 subnormal 0.5 lands on a
  bf16 subnormal); one bf16x2 multiply by ``2^(s - 1 - 64)`` scales it, and the fp32 result is multiplied by
  ``2^64`` at the end (sm_90 loop: 3.1-3.4 instructions per weight, addressing included). Exact for scale
  bytes 66..192 (blocks 2^-61 .. 2^65); smaller ones (all-zero blocks often carry 0) flush toward zero, an
  error under 2^-58 per weight;
- elsewhere (fp16 activations, the interpreter): the nibble becomes an fp16 ``code * 2^-14``, widened to fp32,
  multiplied by ``2^(s - 113)`` and rounded to the activation dtype (scale bytes up to 240);
- scale bytes above the path's :data:`SCALE_MAX` (and 0xFF, NaN) raise ``ValueError`` (read once per scales
  tensor and version);
- ``SPLIT_K > 1`` splits K over the grid and adds fp32 partials with atomics (fills the GPU when there are
  few row blocks and N tiles).
"""
from __future__ import annotations

import math
import sys
import weakref

import torch
import triton
import triton.language as tl

from .. import registry
from ..checks import PlanCache, check_kernel_device, check_tensor
from ..hostmath import cdiv
from ..registry import Cost, bucket
from .activation_reference import class_major
from .fused_moe_reference import fused_moe_gemm_torch
from .mxfp4 import mxfp4_dequantize
from .mxfp4_spec import random_mxfp4
from . import permute
from .permute import ExpertSort, sort_by_expert

GPU_SMS = 132  # H200: the default config splits K until the grid has a program per SM


FAST_SHIFT = tl.constexpr(64)  # bf16 path: weights computed as W * 2^-64 (in bf16 range), the fp32 sums scaled back
SCALE_MAX = {True: 192, False: 240}  # largest scale byte of the bf16 GPU path (FAST) and of the other path

# Nibble c (the tuple's index) of both halves of a 32-bit register (two int16 quarters) -> a bf16x2 pair
# ``code * 2^-126``: the magnitude bits go to bits 6..8 (exponent low bits + mantissa top bit) of each half,
# the sign to bit 15.
_E2M1_BF16X2 = tl.constexpr((
    "{.reg .b32 t; and.b32 t, $1, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 $0, t, 0x81C081C0;}",
    "{.reg .b32 t; and.b32 t, $1, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 $0, t, 0x81C081C0;}",
    "{.reg .b32 t; shr.b32 t, $1, 2; and.b32 t, t, 0x03C003C0; mul.lo.u32 t, t, 0x41; and.b32 $0, t, 0x81C081C0;}",
    "{.reg .b32 t, u; shr.b32 t, $1, 6; and.b32 t, t, 0x01C001C0; and.b32 u, $1, 0x80008000; or.b32 $0, t, u;}",
))


@triton.jit
def _class_weights(quarters, scales, c: tl.constexpr, dtype: tl.constexpr, FAST: tl.constexpr):
    """Weights of class ``c`` (k = 4q + c) of int16 ``quarters[BLOCK_N, Q]`` with their E8M0 ``scales`` (uint8,
    same shape), in ``dtype``: times 2^-64 on the FAST path (bf16, inline PTX), exact otherwise."""
    if FAST:
        code = tl.inline_asm_elementwise(_E2M1_BF16X2[c], "=r,r", [quarters], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
        factor = ((scales.to(tl.int16) + (126 - FAST_SHIFT)) << 7).to(tl.bfloat16, bitcast=True)  # 2^(s-1-64)
        w = code * factor
    else:
        nibble = quarters >> (4 * c)
        bits = ((nibble & 7) << 9) | ((nibble & 8) << 12)  # fp16 code * 2^-14 (the sign lands on bit 15)
        multiplier = ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 113)
        w = (bits.to(tl.float16, bitcast=True).to(tl.float32) * multiplier).to(dtype)
    return w


@triton.jit
def _x_classes_in_place(x_cols, k0, k_end, row_ok, Q: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr):
    """The four classes ``x[:, 4q + c]`` (c = 0..3) of the K tile at quarter ``k0``, each ``[Q, BLOCK_M]``, split
    in registers from one contiguous load of ``x`` (``x_cols``: the rows' starts, ``[1, BLOCK_M]``)."""
    kk = tl.max_contiguous(tl.multiple_of(4 * k0 + tl.arange(0, 4 * Q), 4 * Q), 4 * Q)
    if EVEN_K:
        mask = row_ok[None, :] & (k0 < k_end)
    else:
        mask = (kk < 4 * k_end)[:, None] & row_ok[None, :]
    x = tl.load(x_cols + kk[:, None], mask=mask, other=0.0)  # [4Q, BLOCK_M]
    x = tl.permute(tl.reshape(x, (Q, 2, 2, BLOCK_M)), (0, 3, 1, 2))  # [q, row, a, b]: k = 4q + 2a + b
    even, odd = tl.split(x)  # b = 0, 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _fused_moe_kernel(
    x_ptr, x_row_ptr, w_ptr, s_ptr, y_ptr, padded_rows_ptr, block_expert_ptr,
    N, K_QUARTERS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    GATHER: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr,
    X_COPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0) * BLOCK_M)  # a strided view: each block's first position
    if expert < 0:
        return
    Q: tl.constexpr = BLOCK_K // 4  # quarters (int16) per row of a K tile
    G: tl.constexpr = BLOCK_K // 32  # scale groups per row of a K tile
    rows = tl.load(padded_rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # sorted row, -1 = pad
    row_ok = rows >= 0
    if GATHER:
        x_rows = tl.load(x_row_ptr + rows, mask=row_ok, other=0)  # the token of each sorted row
    else:
        x_rows = rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    split = tl.cdiv(K_QUARTERS, SPLIT_K * Q) * Q
    k_begin = tl.program_id(2) * split
    k_end = tl.minimum(k_begin + split, K_QUARTERS)

    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    s_rows = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn
    x_cols = x_ptr + x_rows.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, Q):
        kq = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, Q), Q), Q)
        kg = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, G), G), G)
        if EVEN_K:  # a mask constant along k keeps the loads vectors
            w_mask = n_ok[:, None] & (k0 < k_end)
            s_mask = w_mask
            x_mask = row_ok[None, :] & (k0 < k_end)
        else:
            w_mask = n_ok[:, None] & (kq < k_end)[None, :]
            s_mask = n_ok[:, None] & (kg < tl.cdiv(k_end, 8))[None, :]
            x_mask = (kq < k_end)[:, None] & row_ok[None, :]
        quarters = tl.load(w_rows + kq[None, :], mask=w_mask, other=0)
        group_scales = tl.load(s_rows + kg[None, :], mask=s_mask, other=0)
        scales = tl.reshape(tl.broadcast_to(group_scales[:, :, None], (BLOCK_N, G, 8)), (BLOCK_N, Q))
        if not X_COPY:
            x_classes = _x_classes_in_place(x_cols, k0, k_end, row_ok, Q, BLOCK_M, EVEN_K)
        for c in tl.static_range(4):
            if X_COPY:  # class-major copy [rows, 4, K/4]
                x = tl.load(x_cols + c * K_QUARTERS + kq[:, None], mask=x_mask, other=0.0)
            else:
                x = x_classes[c]
            w = _class_weights(quarters, scales, c, x_ptr.dtype.element_ty, FAST)
            if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; fp32 of the same bf16 values is exact
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
            else:
                acc = tl.dot(w, x, acc)
    if FAST:
        acc = acc * (2.0 ** FAST_SHIFT)
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    y_mask = n_ok[:, None] & row_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# -- the public op ---------------------------------------------------------------------------------
def gemm_shape(tokens: int, experts: int, top_k: int, n: int, k: int, gather_tokens: bool) -> dict[str, int]:
    """The registry shape of one grouped GEMM: tokens, experts, top_k, N, K and whether rows gather tokens."""
    return {"T": tokens, "E": experts, "top_k": top_k, "N": n, "K": k, "gather": int(gather_tokens)}


def problem_shape(sort: ExpertSort, n: int, k: int, gather_tokens: bool) -> dict[str, int]:
    """:func:`gemm_shape` of a sort's routing."""
    return gemm_shape(sort.num_rows // sort.top_k, sort.num_experts, sort.top_k, n, k, gather_tokens)


def _check(x, sort, blocks, scales, gather_tokens) -> tuple[int, int]:
    if not isinstance(sort, ExpertSort):
        raise ValueError(f"sort: expected an ExpertSort (from sort_by_expert), got {type(sort).__name__}")
    check_tensor("blocks", blocks, dtype=torch.uint8, ndim=4)
    num_experts, n, groups, width = blocks.shape
    if width != 16 or num_experts != sort.num_experts:
        raise ValueError(f"blocks: expected shape [E = {sort.num_experts}, N, K/32, 16], got {tuple(blocks.shape)}")
    if blocks.stride(-2) != 16:  # (the 4-byte alignment is checked on every call)
        raise ValueError(f"blocks: each row's K/32 x 16 bytes must be contiguous, got strides {blocks.stride()}")
    device = check_kernel_device("blocks", blocks)
    check_tensor("scales", scales, dtype=torch.uint8, shape=(num_experts, n, groups), device=device)
    k = 32 * groups
    rows = sort.num_rows // sort.top_k if gather_tokens else sort.num_rows
    if isinstance(x, torch.Tensor) and x.dim() == 3:  # class-major
        check_tensor("x", x, dtype=(torch.float16, torch.bfloat16), shape=(rows, 4, k // 4), device=device)
        if x.stride(1) != k // 4:
            raise ValueError(f"x: class-major rows [4, K/4] must be contiguous, got strides {x.stride()}")
    else:
        check_tensor("x", x, dtype=(torch.float16, torch.bfloat16), shape=(rows, k), device=device)
    if sort.expert_offsets.device != device:
        raise ValueError(f"sort: on {sort.expert_offsets.device}, but blocks are on {device}")
    return n, k


def fused_moe_gemm(x: torch.Tensor, sort: ExpertSort, blocks: torch.Tensor, scales: torch.Tensor, *,
                   gather_tokens: bool = True, config: dict | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Grouped GEMM of routed rows with per-expert MXFP4 weights, dequantized in registers.

    - ``x``: fp16/bf16 ``[T, K]`` when ``gather_tokens`` (sorted row r reads token ``sort.sorted_token[r]``:
      the gate_up GEMM) or ``[M, K]`` already in sorted order (the down GEMM); ``M = T * top_k``; or either
      class-major, ``[T or M, 4, K/4]`` (:func:`.activation_reference.class_major`, e.g. from
      ``activation.swiglu(h, class_major=True)``): read as is, with no copy per call;
    - ``sort``: :func:`.permute.sort_by_expert` of the routing;
    - ``blocks`` uint8 ``[E, N, K/32, 16]`` (rows contiguous), ``scales`` uint8 ``[E, N, K/32]``, bytes at most
      :data:`SCALE_MAX` (192 for bf16 on the GPU, else 240);
    - ``config``: a ``moe_fused_gemm`` launch config; None reads the tuning database for this shape (its
      ``X_COPY`` applies to ``[rows, K]`` activations only);
    - ``out_dtype``: ``x``'s dtype (None) or ``torch.float32`` (the fp32 sums unrounded, no conversion op).

    Returns ``y_sorted [M, N]`` in ``out_dtype``, rows in ``sort``'s expert order. No host sync after the first
    call per scales tensor (its range check), so a warmed-up call can be captured in a CUDA graph.
    """
    if isinstance(sort, ExpertSort):  # checks and config once per (tensor metadata, sort sizes, gather, config)
        key, plan = _PLANS.find((x, blocks, scales, sort.expert_offsets),
                                (sort.num_experts, sort.num_rows, sort.top_k, int(bool(gather_tokens))), config)
    else:  # not a sort: the checks name it
        key, plan = None, None
    if plan is None:
        shape = problem_shape(sort, *_check(x, sort, blocks, scales, gather_tokens), gather_tokens)
        plan = _PLANS.put(key, SPEC.launch_config("decode", shape, x.device) if config is None
                          else SPEC.validate(dict(config), shape))
    if blocks.data_ptr() % 4:  # not in the plan's key
        raise ValueError("blocks: the data must be 4-byte aligned (read as int16 pairs)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype is not x.dtype and out_dtype is not torch.float32:
        raise ValueError(f"out_dtype: expected None, {x.dtype} or torch.float32, got {out_dtype}")
    check_scale_range(scales, fast_path(x))
    return _launch(x, sort, blocks, scales, gather_tokens, plan, out_dtype)


_PLANS = PlanCache(1024)  # the launch config by tensor metadata, sort sizes, gather and the caller's config


_scales_checked: dict[int, tuple] = {}  # id(scales) -> (weakref to it, version, path) once its range was read


def check_scale_range(scales: torch.Tensor, fast: bool) -> None:
    """Raise ``ValueError`` naming ``scales`` if a byte exceeds the path's :data:`SCALE_MAX`. Reads the tensor
    (one sync) once per tensor, in-place version and path; skipped inside a CUDA-graph capture."""
    seen = _scales_checked.get(id(scales))
    if seen is not None and seen[0]() is scales and seen[1:] == (scales._version, fast):
        return
    if scales.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if scales.numel():
        largest = int(scales.max())
        if largest > SCALE_MAX[fast]:
            raise ValueError(f"scales: bytes must be at most {SCALE_MAX[fast]} on this path (blocks up to "
                             f"2^{SCALE_MAX[fast] - 127}), got {largest}")
    if len(_scales_checked) > 4096:
        _scales_checked.clear()
    _scales_checked[id(scales)] = (weakref.ref(scales), scales._version, fast)


def fast_path(x: torch.Tensor) -> bool:
    """bf16 activations on the GPU take the inline-PTX dequantization (scale bytes up to 192)."""
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def _launch(x, sort, blocks, scales, gather_tokens, config, out_dtype) -> torch.Tensor:
    m, n, split = sort.num_rows, blocks.shape[1], config["SPLIT_K"]
    y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1
         else torch.empty(m, n, dtype=out_dtype, device=x.device))
    if m == 0:
        return y.to(out_dtype)
    alignment = sort.aligned(config["BLOCK_M"])
    quarters = blocks.view(torch.int16).flatten(-2)  # [E, N, K/4]
    k_quarters = quarters.shape[-1]
    # class-major [rows, 4, K/4] ([c, q] of 4q + c) as given, or copied so (X_COPY); else x itself (rows contiguous)
    x_classes = class_major(x) if x.dim() == 2 and config["X_COPY"] else x
    fast = fast_path(x)
    grid = (alignment.num_blocks, cdiv(n, config["BLOCK_N"]), split)
    _fused_moe_kernel[grid](
        x_classes, sort.sorted_token, quarters, scales, y, alignment.padded_rows, alignment.block_expert,
        n, k_quarters,
        x_classes.stride(0), quarters.stride(0), quarters.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
        GATHER=gather_tokens, ATOMIC=split > 1, EVEN_K=k_quarters % (split * config["BLOCK_K"] // 4) == 0,
        FAST=fast, DOT_F32=not fast and x.dtype == torch.bfloat16 and x.device.type != "cuda",
        X_COPY=x_classes.dim() == 3, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"], SPLIT_K=split,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return y.to(out_dtype)


# -- registry entry --------------------------------------------------------------------------------
SPACE = {
    "BLOCK_M": (8, 16, 32, 64),  # routed rows per block, padded (8: mma.sync m16n8k16; 16+: wgmma where it fits)
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (64, 128, 256, 512),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5, 6),
    # [rows, K] activations: 1 copied class-major per call; 0 classes split in registers (one kernel less). H200
    # T = 1 down, graphs: 0 33.3 us at 8x64x256 vs 1 34.6 at the default (kernels alone 29.0 vs 23.6 us).
    # No effect on class-major activations (the registry's down-GEMM inputs, as the layer passes them)
    "X_COPY": (0, 1),
}


def _constraint(config, shape) -> str | None:
    bm, bn, bk, warps = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_warps"]
    if bm > max(16, bucket(shape["T"] * shape["top_k"])):
        return "BLOCK_M exceeds the routed rows"
    if bn > max(16, bucket(shape["N"])) or bk > max(64, bucket(shape["K"])):
        return "BLOCK_N or BLOCK_K exceeds the matrix"
    if config["SPLIT_K"] > cdiv(shape["K"], bk):
        return "SPLIT_K leaves a split without a K tile"
    if config["num_stages"] * (2 * bk * bm + bn * bk // 2 + bn * bk // 32) > 200 * 1024:
        return "pipelined x, weight and scale tiles exceed 200 KB of shared memory"
    if bn * bk > 256 * 32 * warps or bn * bm > 64 * 32 * warps:
        return "tile too large for the registers of num_warps warps"
    if bn * bk < 8 * 32 * warps or bn * bm < 128 * warps:
        return "tile too small for num_warps warps (a 16 x 8 mma tile and pairs of code quarters per thread)"
    return None


def expected_active_experts(shape) -> float:
    """Experts that get at least one of T * top_k routes when each token picks top_k distinct ones uniformly."""
    e, k, t = shape["E"], shape["top_k"], shape["T"]
    return e * (1.0 - (1.0 - k / e) ** t)


def _default(phase, shape):
    """8-row blocks (mma.sync m16n8k16) while experts average up to 8 rows, 64 x 512 weight tiles, 4 warps,
    3 stages; K split only when the grid would leave SMs idle.

    H200 sweep (results/h200/sweep-moe-fused-gemm-20261130.json, E=256 top-8, 24 configs at T >= 8, 22 at
    T = 1): 8 x 64 x 512 / 4 warps / 3 stages was the fastest or within 1.3% of it for gate_up and down at
    T = 8, 32, 128 (74-83% of copy bandwidth on the MXFP4 bytes); the best 16-row blocks (wgmma, serialized by
    ptxas since the A registers are rewritten between wgmmas) were 12-25% slower, 8-row 64 x 128 and 128 x 128
    tiles 31-77% slower, split-K 2 slower everywhere. At T = 1 every config timed 119-180 us, the host's launch
    path rather than the kernel. 32-row blocks: 2 configs, 39-94% slower; 64-row blocks not measured.
    """
    routed = shape["T"] * shape["top_k"]
    per_expert = routed / max(expected_active_experts(shape), 1.0)
    block_m = 8 if per_expert <= 8 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    blocks = expected_active_experts(shape) * math.ceil(per_expert / block_m)
    block_n, block_k = min(64, max(16, bucket(shape["N"]))), min(512, max(64, bucket(shape["K"])))
    if block_m == 64:  # 3 stages of 64 x 512 x tiles exceed the shared memory
        block_k = min(block_k, 256)
    programs = blocks * cdiv(shape["N"], block_n)
    split = 1
    while programs * split < GPU_SMS and 2 * split <= min(8, cdiv(shape["K"], block_k)):
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 3, "X_COPY": 1}


def _cost(phase, shape) -> Cost:
    """Floor: the MXFP4 bytes of the experts expected to get rows (4.25 bits per weight), x once, y once."""
    rows = shape["T"] * shape["top_k"]
    weight_bytes = expected_active_experts(shape) * shape["N"] * shape["K"] * 17 / 32
    x_bytes = (shape["T"] if shape.get("gather", 1) else rows) * shape["K"] * 2
    return Cost(bytes=weight_bytes + x_bytes + rows * shape["N"] * 2, flops=2.0 * rows * shape["N"] * shape["K"])


def _bench_shapes(phase, gpu):
    if gpu:  # DeepSeek-V3.2: 256 experts, top-8, hidden 7168, moe_intermediate 2048
        return [{"T": t, "E": 256, "top_k": 8, "N": n, "K": k, "gather": g}
                for n, k, g in ((4096, 7168, 1), (7168, 2048, 0)) for t in (1, 8, 32, 128)]
    return [{"T": 3, "E": 5, "top_k": 2, "N": 48, "K": 96, "gather": 1},
            {"T": 1, "E": 7, "top_k": 3, "N": 40, "K": 64, "gather": 0}]


class ExpertWeights:
    """Random MXFP4 expert weights shared by every input set of one shape (they dwarf the L2 anyway) and,
    for the baselines, their dense copy made on first use. Held weakly: freed with the last input set."""

    _live: "weakref.WeakValueDictionary[tuple, ExpertWeights]" = weakref.WeakValueDictionary()

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        self.blocks, self.scales = blocks, scales
        self._dense: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def random(cls, experts: int, n: int, k: int, device: torch.device) -> "ExpertWeights":
        key = (experts, n, k, str(device))
        found = cls._live.get(key)
        if found is None:
            blocks, scales = random_mxfp4((experts, n), k, device, seed=7, spread=2)
            found = cls(blocks, scales - 6)  # scales 2^-8 .. 2^-4: weights of a trained layer's magnitude
            cls._live[key] = found
        return found

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """``[E, N, K]`` in ``dtype`` (the MXFP4 dequantize kernel), kept for later calls."""
        if dtype not in self._dense:
            self._dense[dtype] = mxfp4_dequantize(self.blocks, self.scales, dtype)
        return self._dense[dtype]


def random_routing(tokens: int, experts: int, top_k: int, device: torch.device, gen: torch.Generator):
    """``(weights [T, top_k] fp32, ids [T, top_k] int32)``: top_k distinct experts per token, uniformly."""
    ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    return torch.rand(tokens, top_k, generator=gen, device=device).softmax(dim=1), ids


def _make_inputs(phase, shape, device, seed):
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    weights, ids = random_routing(shape["T"], shape["E"], shape["top_k"], device, gen)
    sort = sort_by_expert(ids, weights, shape["E"], check_ids=False)
    gather = bool(shape.get("gather", 1))
    rows = shape["T"] if gather else sort.num_rows
    x = torch.randn(rows, shape["K"], generator=gen, device=device).to(dtype)
    bounds = sort.expert_offsets.tolist()
    active = [(e, a, b) for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    # the down GEMM gets class-major rows, as the layer's swiglu writes them; the baseline reads x_rows
    return {"x": x if gather else class_major(x), "x_rows": x, "sort": sort, "gather": gather, "active": active,
            "weights": ExpertWeights.random(shape["E"], shape["N"], shape["K"], device)}


def _run(inputs, config):
    w = inputs["weights"]
    return fused_moe_gemm(inputs["x"], inputs["sort"], w.blocks, w.scales, gather_tokens=inputs["gather"], config=config)


def _reference(inputs):
    w = inputs["weights"]
    return fused_moe_gemm_torch(inputs["x"], inputs["sort"], w.blocks, w.scales, inputs["gather"])


def compare_rows(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-2) -> str | None:
    """None when ``out`` matches ``ref`` (fp32) to ``rtol`` of the reference's largest magnitude."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.float()
    if not torch.isfinite(out).all():
        return "non-finite values in the output"
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return None if err <= rtol * scale + 1e-3 else f"max abs error {err:.3g} vs reference max {scale:.3g}"


def bf16_expert_loop(inputs) -> torch.Tensor:
    """Baseline: per active expert, ``torch.mm`` (cuBLAS) on pre-dequantized bf16 weights."""
    x = inputs["x_rows"]
    w = inputs["weights"].dense(x.dtype)
    sort = inputs["sort"]
    rows = x[sort.sorted_token] if inputs["gather"] else x
    y = rows.new_empty(sort.num_rows, w.shape[1])
    for e, start, end in inputs["active"]:
        torch.mm(rows[start:end], w[e].t(), out=y[start:end])
    return y


SPEC = registry.register(registry.KernelSpec(
    name="moe_fused_gemm",
    phases=("decode",),
    space=SPACE,
    default=_default,
    fixed_dims=("E", "top_k", "N", "K"),  # "gather" (1: gate_up, 0: down) is only an input detail
    bucketed_dims=("T",),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_rows,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=bf16_expert_loop,
    baseline_name="cuBLAS bf16 mm per active expert (pre-dequantized)",
    source_modules=(sys.modules[__name__], permute),
))
