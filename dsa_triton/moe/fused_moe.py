"""Fused MXFP4 grouped GEMM (the decode path): weights dequantized in registers, read once per row block.

``y_sorted[r] = x_row(r) @ W[e(r)].T`` for every routed row ``r`` sorted by expert (:class:`.permute.ExpertSort`),
with ``W[e]`` given as MXFP4 ``blocks[E, N, K/32, 16]`` / ``scales[E, N, K/32]``.

One program owns (row block, N tile, K split). Row blocks come from the block-aligned layout
(:meth:`ExpertSort.aligned`): one expert per block, padding rows -1, blocks past the end -1 (the program
returns at once), so the grid size is a host-side bound and nothing syncs. The tile is computed
transposed, ``acc[BLOCK_N, BLOCK_M]`` (the weights are the long side, tokens the short one):

- weights are loaded as int32 words ``[BLOCK_N, BLOCK_K / 8]``; word ``w`` of row ``n`` holds k = 8w .. 8w + 7,
  nibble ``i`` (bits 4i..4i+3) being k = 8w + i. One shift and two masks turn nibbles ``c`` and ``c + 4``
  of every word into two fp16 values (E2M1 value * 2^-14, exact: the E2M1 subnormal 0.5 lands on an fp16
  subnormal), so each word yields eight weight "classes" k = 8w + c, c = 0..7;
- each class is scaled in fp32 by ``2^(s - 127 + 14)`` (built from the E8M0 bits) and multiplied with the
  matching activations ``x[rows, 8w + c]``: ``tl.dot`` when ``BLOCK_M >= 16`` (tokens padded to the block),
  else an FMA accumulation ``[BLOCK_N, BLOCK_K / 8, BLOCK_M]`` reduced once at the end (GEMV style);
- ``SPLIT_K > 1`` splits K over the grid and adds fp32 partials with atomics (fills the GPU when there are
  few row blocks and N tiles).

Scale bytes above 240 (blocks beyond 2^113) make the dequantized weights inf: far outside any model's range.
"""
from __future__ import annotations

import sys
import weakref

import torch
import triton
import triton.language as tl

from .. import registry
from ..checks import check_kernel_device, check_tensor
from ..registry import Cost, bucket
from .fused_moe_reference import fused_moe_gemm_torch
from .mxfp4 import mxfp4_dequantize, random_mxfp4
from . import permute
from .permute import ExpertSort, sort_by_expert

GPU_SMS = 132  # H200: the default config splits K until the grid has two programs per SM


@triton.jit
def _e2m1_pair(words, c: tl.constexpr):
    """fp16 ``E2M1 * 2^-14`` of nibbles ``c`` and ``c + 4`` of int32 ``words``: (k = 8w + c, k = 8w + c + 4)."""
    t = words >> (4 * c)
    bits = ((t & 0x70007) << 9) | ((t & 0x80008) << 12)  # magnitude -> fp16 exponent/mantissa, sign -> bit 15
    low = bits.to(tl.int16).to(tl.float16, bitcast=True)
    high = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return low, high


@triton.jit
def _multiply_add(acc, w16, multiplier, x_ptrs, x_mask, USE_DOT: tl.constexpr):
    """acc += (w16 * multiplier)[BLOCK_N, WORDS] @ x[WORDS, BLOCK_M] (tensor cores or FMA)."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    w = w16.to(tl.float32) * multiplier
    if USE_DOT:
        acc = tl.dot(w.to(x.dtype), x, acc)
    else:
        acc += w[:, :, None] * x.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _fused_moe_kernel(
    x_ptr, x_row_ptr, w_ptr, s_ptr, y_ptr, padded_rows_ptr, block_expert_ptr,
    N, K_WORDS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    GATHER: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    WORDS: tl.constexpr = BLOCK_K // 8
    rows = tl.load(padded_rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # sorted row, -1 = pad
    row_ok = rows >= 0
    if GATHER:
        x_rows = tl.load(x_row_ptr + rows, mask=row_ok, other=0)  # the token of each sorted row
    else:
        x_rows = rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    split_words = tl.cdiv(K_WORDS, SPLIT_K * WORDS) * WORDS
    k_begin = tl.program_id(2) * split_words
    k_end = tl.minimum(k_begin + split_words, K_WORDS)

    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    s_rows = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn
    x_cols = x_ptr + x_rows[None, :].to(tl.int64) * stride_xm + 8 * tl.arange(0, WORDS)[:, None]  # [WORDS, BLOCK_M]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, WORDS, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, WORDS):
        kw = k0 + tl.arange(0, WORDS)
        k_ok = kw < k_end
        w_mask = n_ok[:, None] & k_ok[None, :]
        words = tl.load(w_rows + kw[None, :], mask=w_mask, other=0)
        s = tl.load(s_rows + (kw // 4)[None, :], mask=w_mask, other=0)  # one E8M0 byte per 4 words
        multiplier = (tl.minimum(s.to(tl.int32) + 14, 255) << 23).to(tl.float32, bitcast=True)  # 2^(s-113)
        x_mask = k_ok[:, None] & row_ok[None, :]
        x_tile = x_cols + 8 * k0
        for c in tl.static_range(4):
            low, high = _e2m1_pair(words, c)
            acc = _multiply_add(acc, low, multiplier, x_tile + c, x_mask, USE_DOT)
            acc = _multiply_add(acc, high, multiplier, x_tile + c + 4, x_mask, USE_DOT)
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(acc, axis=1)
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    y_mask = n_ok[:, None] & row_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, out, mask=y_mask)
    else:
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


# -- the public op ---------------------------------------------------------------------------------
def problem_shape(sort: ExpertSort, n: int, k: int, gather_tokens: bool) -> dict[str, int]:
    """The registry shape of one grouped GEMM: tokens, experts, top_k, N, K and whether rows gather tokens."""
    return {"T": sort.num_rows // sort.top_k, "E": sort.num_experts, "top_k": sort.top_k, "N": n, "K": k,
            "gather": int(gather_tokens)}


def _check(x, sort, blocks, scales, gather_tokens) -> tuple[int, int]:
    if not isinstance(sort, ExpertSort):
        raise ValueError(f"sort: expected an ExpertSort (from sort_by_expert), got {type(sort).__name__}")
    check_tensor("blocks", blocks, dtype=torch.uint8, ndim=4)
    num_experts, n, groups, width = blocks.shape
    if width != 16 or num_experts != sort.num_experts:
        raise ValueError(f"blocks: expected shape [E = {sort.num_experts}, N, K/32, 16], got {tuple(blocks.shape)}")
    if blocks.stride(-2) != 16 or blocks.data_ptr() % 4:
        raise ValueError(f"blocks: each row's K/32 x 16 bytes must be contiguous and 4-byte aligned, "
                         f"got strides {blocks.stride()}")
    device = check_kernel_device("blocks", blocks)
    check_tensor("scales", scales, dtype=torch.uint8, shape=(num_experts, n, groups), device=device)
    k = 32 * groups
    rows = sort.num_rows // sort.top_k if gather_tokens else sort.num_rows
    check_tensor("x", x, dtype=(torch.float16, torch.bfloat16), shape=(rows, k), device=device)
    if sort.expert_offsets.device != device:
        raise ValueError(f"sort: on {sort.expert_offsets.device}, but blocks are on {device}")
    return n, k


def fused_moe_gemm(x: torch.Tensor, sort: ExpertSort, blocks: torch.Tensor, scales: torch.Tensor, *,
                   gather_tokens: bool = True, config: dict | None = None) -> torch.Tensor:
    """Grouped GEMM of routed rows with per-expert MXFP4 weights, dequantized in registers.

    - ``x``: fp16/bf16 ``[T, K]`` when ``gather_tokens`` (sorted row r reads token ``sort.sorted_token[r]``:
      the gate_up GEMM) or ``[M, K]`` already in sorted order (the down GEMM); ``M = T * top_k``;
    - ``sort``: :func:`.permute.sort_by_expert` of the routing;
    - ``blocks`` uint8 ``[E, N, K/32, 16]`` (rows contiguous), ``scales`` uint8 ``[E, N, K/32]``;
    - ``config``: a ``moe_fused_gemm`` launch config; None reads the tuning database for this shape.

    Returns ``y_sorted [M, N]`` in ``x``'s dtype, rows in ``sort``'s expert order.
    """
    n, k = _check(x, sort, blocks, scales, gather_tokens)
    shape = problem_shape(sort, n, k, gather_tokens)
    config = SPEC.launch_config("decode", shape, x.device) if config is None else SPEC.validate(dict(config), shape)
    return _launch(x, sort, blocks, scales, gather_tokens, config)


def _launch(x, sort, blocks, scales, gather_tokens, config) -> torch.Tensor:
    m, n, split = sort.num_rows, blocks.shape[1], config["SPLIT_K"]
    y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1
         else torch.empty(m, n, dtype=x.dtype, device=x.device))
    if m == 0:
        return y.to(x.dtype)
    alignment = sort.aligned(config["BLOCK_M"])
    words = blocks.view(torch.int32).flatten(-2)  # [E, N, K/8]
    grid = (alignment.num_blocks, triton.cdiv(n, config["BLOCK_N"]), split)
    _fused_moe_kernel[grid](
        x, sort.sorted_token, words, scales, y, alignment.padded_rows, alignment.block_expert,
        n, words.shape[-1],
        x.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
        GATHER=gather_tokens, ATOMIC=split > 1,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT_K=split,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return y.to(x.dtype) if split > 1 else y


# -- registry entry --------------------------------------------------------------------------------
SPACE = {
    "BLOCK_M": (1, 2, 4, 16, 32, 64),  # < 16: FMA (GEMV style); >= 16: tl.dot with tokens padded to the block
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (64, 128, 256, 512),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2, 3, 4),
}


def _constraint(config, shape) -> str | None:
    bm, bn, bk, warps = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_warps"]
    words = bk // 8
    if bm >= 16 and words < 16:
        return "tl.dot needs BLOCK_K / 8 >= 16 (BLOCK_K >= 128)"
    if bm > max(16, bucket(shape["T"] * shape["top_k"])):
        return "BLOCK_M exceeds the routed rows"
    if bn > max(16, bucket(shape["N"])) or bk > max(128, bucket(shape["K"])):
        return "BLOCK_N or BLOCK_K exceeds the matrix"
    if config["SPLIT_K"] > triton.cdiv(shape["K"], bk):
        return "SPLIT_K leaves a split without a K tile"
    per_thread = bn * words * (bm if bm < 16 else 1) / (32 * warps)  # weight words (and FMA partial sums)
    if per_thread > 64 or (bm >= 16 and bn * bm / (32 * warps) > 128):
        return "tile too large for the registers of num_warps warps"
    return None


def expected_active_experts(shape) -> float:
    """Experts that get at least one of T * top_k routes when each token picks top_k distinct ones uniformly."""
    e, k, t = shape["E"], shape["top_k"], shape["T"]
    return e * (1.0 - (1.0 - k / e) ** t)


def _default(phase, shape):
    routed = shape["T"] * shape["top_k"]
    per_expert = routed / expected_active_experts(shape)
    block_m = 1 if per_expert < 1.2 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block_n = min(64, max(16, bucket(shape["N"])))
    block_k = min(256, max(128, bucket(shape["K"])))
    warps = 4
    while block_n * block_k // 8 * (block_m if block_m < 16 else 1) > 64 * 32 * warps:
        block_k //= 2
    programs = (routed if block_m == 1 else min(shape["E"], routed)) * triton.cdiv(shape["N"], block_n)
    split = 1
    while programs * split < 2 * GPU_SMS and 2 * split <= min(8, triton.cdiv(shape["K"], block_k)):
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": warps, "num_stages": 3}


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
    return {"x": x, "sort": sort, "weights": ExpertWeights.random(shape["E"], shape["N"], shape["K"], device),
            "gather": gather, "active": active}


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
    w = inputs["weights"].dense(inputs["x"].dtype)
    sort = inputs["sort"]
    rows = inputs["x"][sort.sorted_token] if inputs["gather"] else inputs["x"]
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
