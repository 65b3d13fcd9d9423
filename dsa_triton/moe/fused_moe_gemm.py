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
  (:func:`.formats.class_major`; given so by the caller, as the layer's down GEMM gets them from
  :func:`.activation.swiglu`, or copied so per call, ``X_COPY=1``: one small transpose kernel) or split in
  registers from a contiguous load of ``x[rows, K]`` itself (``X_COPY=0``: no second kernel, but more registers a
  thread on sm_90 and a slower GEMM kernel than on class-major rows);
- bf16 activations on the GPU: two neighbouring quarters are one 32-bit register, and a few integer ops per
  class (inline PTX) turn it into a bf16x2 pair ``code * 2^-126`` (exact: the E2M1 subnormal 0.5 lands on a
  bf16 subnormal); one bf16x2 multiply by ``2^(s - 1 - 64)`` scales it, and the fp32 result is multiplied by
  ``2^64`` at the end. Exact for scale bytes 66..192 (blocks 2^-61 .. 2^65); smaller ones (all-zero blocks often
  carry 0) flush toward zero, an error under 2^-58 per weight;
- elsewhere (fp16 activations, the interpreter): the nibble becomes an fp16 ``code * 2^-14``, widened to fp32,
  multiplied by ``2^(s - 113)`` and rounded to the activation dtype: exact for fp16 scale bytes 104..140 (blocks
  2^-23 .. 2^13; the largest weight 6 * 2^13 = 49152 fits fp16, 6 * 2^14 would not), smaller ones round to fp16
  subnormals (an error under 2^-25 per weight); bf16 (the interpreter) up to 240;
- scale bytes above the path's bound, :func:`scale_max` (and 0xFF, NaN), raise ``ValueError`` (read once per
  scales tensor and version): no weight is ever infinite, so no output is NaN where the true one is finite;
- ``SPLIT_K > 1`` splits K over the grid and adds fp32 partials with atomics (fills the GPU when there are
  few row blocks and N tiles).

The kernels are in :mod:`.fused_moe_gemm_kernels`, the launch parameters in :data:`LAUNCH`, the oracle in
:mod:`.fused_moe_gemm_reference`.
"""
from __future__ import annotations

import math
import weakref

import torch

from ..checks import check_kernel_device, check_out, check_tensor
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..hostmath import cdiv
from ..launch import launch_with
from ..registry import LaunchSpace, bucket
from .formats import class_major
from .fused_moe_gemm_kernels import _fused_moe_kernel
from .permute import ExpertSort

GPU_SMS = 132  # H200: the default config splits K until the grid has a program per SM
# largest scale byte by dequantization path (:func:`scale_path`): bf16 on the GPU (FAST: weights times 2^-64 in
# bf16), fp16 activations (weights rounded to fp16: 6 * 2^(140 - 127) is its largest block), bf16 elsewhere
SCALE_MAX = {"bf16 gpu": 192, "fp16": 140, "bf16": 240}


SPACE = {
    "BLOCK_M": (8, 16, 32, 64),  # routed rows per block, padded (8: mma.sync m16n8k16; 16+: wgmma where it fits)
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (64, 128, 256, 512),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5, 6),
    # [rows, K] activations: 1 copied class-major per call (the GEMM kernel is faster on class-major rows); 0 classes
    # split in registers (one kernel less, a slower GEMM kernel). No effect on class-major activations (the
    # registry's down-GEMM inputs, as the layer passes them)
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

    Decode is bound by the MXFP4 bytes: 16-row blocks run on wgmma, which ptxas serializes (the A registers are
    rewritten between wgmmas), and narrower weight tiles or a split K add work without reading the weights faster.
    N under 64 narrows the weight tile to N (16 or 32 columns), and the warps to those that keep 128 of the tile's
    rows x columns each (the constraint's 16 x 8 mma tile per warp): 2 or more, so 16 columns take 16-row blocks.
    """
    routed = shape["T"] * shape["top_k"]
    per_expert = routed / max(expected_active_experts(shape), 1.0)
    block_m = 8 if per_expert <= 8 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block_n, block_k = min(64, max(16, bucket(shape["N"]))), min(512, max(64, bucket(shape["K"])))
    block_m = max(block_m, 256 // block_n)  # a 16 x 8 mma tile for each of 2 warps at least
    warps = min(4, block_n * block_m // 128)
    blocks = expected_active_experts(shape) * math.ceil(per_expert / block_m)
    if block_m == 64:  # 3 stages of 64 x 512 x tiles exceed the shared memory
        block_k = min(block_k, 256)
    programs = blocks * cdiv(shape["N"], block_n)
    split = 1
    while programs * split < GPU_SMS and 2 * split <= min(8, cdiv(shape["K"], block_k)):
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": warps, "num_stages": 3, "X_COPY": 1}


LAUNCH = LaunchSpace(
    name="fused_moe_gemm",
    phases=("decode",),
    space=SPACE,
    default=_default,
    fixed_dims=("E", "top_k", "N", "K"),  # "gather" (1: gate_up, 0: down) is only an input detail
    bucketed_dims=("T",),
    constraint=_constraint,
)


def gemm_shape(tokens: int, experts: int, top_k: int, n: int, k: int, gather_tokens: bool) -> dict[str, int]:
    """The registry shape of one grouped GEMM: tokens, experts, top_k, N, K and whether rows gather tokens."""
    return {"T": tokens, "E": experts, "top_k": top_k, "N": n, "K": k, "gather": int(gather_tokens)}


def problem_shape(sort: ExpertSort, n: int, k: int, gather_tokens: bool) -> dict[str, int]:
    """:func:`gemm_shape` of a sort's routing."""
    return gemm_shape(sort.num_rows // sort.top_k, sort.num_experts, sort.top_k, n, k, gather_tokens)


def launch_config(shape: dict[str, int], device: torch.device) -> dict:
    """The ``fused_moe_gemm`` config a call without ``config`` launches with for ``shape`` (:func:`gemm_shape`):
    the tuning database's, else the registry default."""
    return LAUNCH.launch_config("decode", shape, device)


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
                   out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped GEMM of routed rows with per-expert MXFP4 weights, dequantized in registers.

    - ``x``: fp16/bf16 ``[T, K]`` when ``gather_tokens`` (sorted row r reads token ``sort.sorted_token[r]``:
      the gate_up GEMM) or ``[M, K]`` already in sorted order (the down GEMM); ``M = T * top_k``; or either
      class-major, ``[T or M, 4, K/4]`` (:func:`.activation_reference.class_major`, e.g. from
      ``activation.swiglu(h, class_major=True)``): read as is, with no copy per call;
    - ``sort``: :func:`.permute.sort_by_expert` of the routing;
    - ``blocks`` uint8 ``[E, N, K/32, 16]`` (rows contiguous), ``scales`` uint8 ``[E, N, K/32]``, bytes at most
      :func:`scale_max` (192 for bf16 on the GPU, 140 for fp16 activations, 240 for bf16 in the interpreter);
    - ``config``: a ``fused_moe_gemm`` launch config; None reads the tuning database for this shape (its
      ``X_COPY`` applies to ``[rows, K]`` activations only);
    - ``out_dtype``: ``x``'s dtype (None) or ``torch.float32`` (the fp32 sums unrounded, no conversion op);
    - ``out``: optional ``[M, N]`` tensor in ``out_dtype`` (last dim contiguous, any row stride) to write (and
      return).

    Returns ``y_sorted [M, N]`` in ``out_dtype``, rows in ``sort``'s expert order. No host sync after the first
    call per scales tensor (its range check), so a warmed-up call can be captured in a CUDA graph.

    Non-finite input: a scale byte above :func:`scale_max` (0xFF is NaN in E8M0; past it a weight would overflow
    the activation dtype) is rejected by that range check (``ValueError`` naming ``scales``); ``x`` is not read on
    the host: a NaN or infinity in it propagates to the output rows that read it (NaN in, NaN out, never a finite
    wrong number). A sum past fp16's range is inf in an fp16 ``out_dtype`` (fp32 keeps it).
    """
    # checks, config and launch once per (tensor metadata, sort sizes, gather, config); none kept for a sort that is
    # not an ExpertSort (the checks name it)
    gather_tokens = bool(gather_tokens)  # (the kernel's GATHER constexpr: one specialization for 1 and True)
    key, plan = None, None
    if isinstance(sort, ExpertSort):
        key, plan = _PLANS.find((x, blocks, scales, sort.expert_offsets),
                                (sort.num_experts, sort.num_rows, sort.top_k, int(gather_tokens)), config)
    if plan is None:
        n, k = _check(x, sort, blocks, scales, gather_tokens)
        shape = problem_shape(sort, n, k, gather_tokens)
        config = launch_config(shape, x.device) if config is None else LAUNCH.validate(config, shape)
        plan = _PLANS.put(key, FusedLaunch(x, k, gather_tokens, config))
    if blocks.data_ptr() % 4:  # not in the plan's key
        raise ValueError("blocks: the data must be 4-byte aligned (read as int16 pairs)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype is not x.dtype and out_dtype is not torch.float32:
        raise ValueError(f"out_dtype: expected None, {x.dtype} or torch.float32, got {out_dtype}")
    if out is not None:
        check_out(out, (sort.num_rows, blocks.shape[1]), out_dtype, x.device, contiguous=False)
    check_scale_bytes(scales, scale_max(x))
    return _launch(x, sort, blocks, scales, plan, out_dtype, out)


class FusedLaunch:
    """A checked call's config and the keyword arguments of its launch, fixed by its plan's key: x's dtype, device
    and dimensions, K, ``gather_tokens`` and the config."""

    def __init__(self, x: torch.Tensor, k: int, gather_tokens: bool, config: dict) -> None:
        self.config = config
        # class-major [rows, 4, K/4] ([c, q] of 4q + c) as given, or copied so (X_COPY); else x itself
        self.copy = x.dim() == 2 and config["X_COPY"]
        split, fast = config["SPLIT_K"], fast_path(x)
        self.meta = dict(
            GATHER=gather_tokens, ATOMIC=split > 1, EVEN_K=(k // 4) % (split * config["BLOCK_K"] // 4) == 0,
            FAST=fast, DOT_F32=not fast and x.dtype == torch.bfloat16 and x.device.type != "cuda",
            X_COPY=x.dim() == 3 or bool(self.copy), BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
            BLOCK_K=config["BLOCK_K"], SPLIT_K=split,
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )


_PLANS = PlanCache(1024)  # the FusedLaunch by tensor metadata, sort sizes, gather and the caller's config


_scales_checked: dict[int, tuple] = {}  # id(scales) -> (weakref to it, version, bound) once its range was read


def check_scale_bytes(scales: torch.Tensor, bound: int, name: str = "scales") -> None:
    """Raise ``ValueError`` naming ``name`` if a byte of the E8M0 ``scales`` exceeds ``bound`` (0xFF is NaN). Reads
    the tensor (one sync) once per tensor, in-place version and bound; skipped inside a CUDA-graph capture."""
    seen = _scales_checked.get(id(scales))
    if seen is not None and seen[0]() is scales and seen[1:] == (scales._version, bound):
        return
    if scales.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if scales.numel():
        largest = int(scales.max())
        if largest > bound:
            raise ValueError(f"{name}: bytes must be at most {bound} on this path (blocks up to 2^{bound - 127}; "
                             f"0xFF is NaN), got {largest}")
    if len(_scales_checked) > 4096:
        _scales_checked.clear()
    _scales_checked[id(scales)] = (weakref.ref(scales), scales._version, bound)


def fast_path(x: torch.Tensor) -> bool:
    """bf16 activations on the GPU take the inline-PTX dequantization (scale bytes up to 192)."""
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def scale_path(x: torch.Tensor) -> str:
    """The dequantization path of activations ``x``, a key of :data:`SCALE_MAX`."""
    return "bf16 gpu" if fast_path(x) else "fp16" if x.dtype == torch.float16 else "bf16"


def scale_max(x: torch.Tensor) -> int:
    """The largest scale byte the path of activations ``x`` takes: every weight it dequantizes is finite."""
    return SCALE_MAX[scale_path(x)]


def _launch(x, sort, blocks, scales, plan: FusedLaunch, out_dtype, out=None) -> torch.Tensor:
    """The launch into ``out`` (given, checked) or a new tensor. ``SPLIT_K > 1`` adds fp32 partials: into a zeroed
    fp32 ``out``, else into fp32 zeros rounded to ``out_dtype`` after."""
    config = plan.config
    m, n, split = sort.num_rows, blocks.shape[1], config["SPLIT_K"]
    if split == 1 or (out is not None and out.dtype == torch.float32):
        y = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out
        if split > 1:
            y.zero_()
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y.to(out_dtype) if out is None else out
    alignment = sort.aligned(config["BLOCK_M"])
    quarters = blocks.view(torch.int16).flatten(-2)  # [E, N, K/4]
    x_classes = class_major(x) if plan.copy else x  # (rows contiguous)
    grid = (alignment.num_blocks, cdiv(n, config["BLOCK_N"]), split)
    launch_with(
        _fused_moe_kernel, grid, plan.meta,
        x_classes, sort.sorted_token, quarters, scales, y, alignment.padded_rows, alignment.block_expert,
        n, quarters.shape[-1],
        x_classes.stride(0), quarters.stride(0), quarters.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
    )
    if out is None:
        return y.to(out_dtype)
    if y is not out:
        out.copy_(y)
    return out


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

def _check_sort(x, expert_offsets, sorted_token, sorted_expert, blocks, top_k, gather_tokens, check_values) -> None:
    """The sort's tensors: metadata always; with ``check_values``, their values (one transfer)."""
    experts = blocks.shape[0]
    check_tensor("expert_offsets", expert_offsets, dtype=torch.int32, shape=(experts + 1,), device=x.device)
    rows = sorted_expert.shape[0] if sorted_expert.dim() == 1 else -1
    check_tensor("sorted_expert", sorted_expert, dtype=torch.int32, ndim=1, device=x.device)
    check_tensor("sorted_token", sorted_token, dtype=torch.int32, shape=(rows,), device=x.device)
    if type(top_k) is not int or top_k <= 0 or rows % top_k:
        raise ValueError(f"top_k: must be a positive integer dividing the {rows} sorted rows, got {top_k!r}")
    if check_values and rows:
        tokens = x.shape[0] if gather_tokens else rows // top_k
        offsets = expert_offsets.long()
        bad = torch.stack([(offsets[0] != 0) | (offsets[-1] != rows) | (offsets[1:] < offsets[:-1]).any(),
                           ((sorted_token < 0) | (sorted_token >= tokens)).any(),
                           ((sorted_expert < 0) | (sorted_expert >= experts)).any()]).tolist()
        for failed, message in zip(bad, (f"expert_offsets: must rise from 0 to the {rows} sorted rows",
                                          f"sorted_token: tokens must lie in [0, {tokens})",
                                          f"sorted_expert: experts must lie in [0, {experts})")):
            if failed:
                raise ValueError(message)


@dsa_op("fused_moe_gemm")
def fused_moe_gemm_op(x: torch.Tensor, expert_offsets: torch.Tensor, sorted_token: torch.Tensor,
                      sorted_expert: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, top_k: int,
                      gather_tokens: bool = True, out_dtype: torch.dtype | None = None, check_values: bool = True,
                      config: str | None = None) -> torch.Tensor:
    """:func:`dt.fused_moe_gemm`: ``y_sorted [M, N]`` in ``out_dtype`` (None: ``x``'s). The sort is given by the
    tensors the GEMM reads: ``expert_offsets [E + 1]``, ``sorted_token [M]``, ``sorted_expert [M]`` (int32, fields
    of ``ExpertSort``), and ``top_k`` (``M = T * top_k``)."""
    return _fused_moe(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens, out_dtype,
                      check_values, config, None)


def _fused_moe(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens, out_dtype,
               check_values, config, out):
    _check_sort(x, expert_offsets, sorted_token, sorted_expert, blocks, top_k, gather_tokens, check_values)
    unread = sorted_expert  # sorted_slot / slot_row / slot_weight: the GEMM reads only the row count of them
    sort = ExpertSort(blocks.shape[0], top_k, expert_offsets, unread, sorted_token, sorted_expert, unread, unread)
    return fused_moe_gemm(x, sort, blocks, scales, gather_tokens=gather_tokens, config=op_config(config),
                          out_dtype=out_dtype, out=out)


@fused_moe_gemm_op.register_fake
def _(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens=True, out_dtype=None,
      *args, **kwargs):
    return x.new_empty((sorted_expert.shape[0], blocks.shape[1]), dtype=out_dtype or x.dtype)


@dsa_op("fused_moe_gemm_out", mutates_args=("out",))
def fused_moe_gemm_out(x: torch.Tensor, expert_offsets: torch.Tensor, sorted_token: torch.Tensor,
                       sorted_expert: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, top_k: int,
                       out: torch.Tensor, gather_tokens: bool = True, check_values: bool = True,
                       config: str | None = None) -> None:
    """:func:`dt.fused_moe_gemm` into ``out[M, N]`` (last dim contiguous) in ``x``'s dtype or fp32 (the
    ``out_dtype``)."""
    check_tensor("out", out, dtype=(x.dtype, torch.float32), contiguous_last=False)
    _fused_moe(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens, out.dtype,
               check_values, config, out)


@fused_moe_gemm_out.register_fake
def _(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, out, *args, **kwargs):
    return None
