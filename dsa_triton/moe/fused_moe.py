"""Fused MXFP4 grouped GEMM (the decode path): weights dequantized in registers, read once per row block.

``y_sorted[r] = x_row(r) @ W[e(r)].T`` for every routed row ``r`` sorted by expert (:class:`.permute.ExpertSort`),
with ``W[e]`` given as MXFP4 ``blocks[E, N, K/32, 16]`` / ``scales[E, N, K/32]``.

One program owns (row block, N tile, K split). Row blocks come from the block-aligned layout
(:meth:`ExpertSort.aligned`): one expert per block, padding rows -1, blocks past the end -1 (the program
returns at once), so the grid size is a host-side bound and nothing syncs. The tile is computed
transposed, ``acc[BLOCK_N, BLOCK_M]`` (the weights are the long side, tokens the short one):

- weights are loaded as int32 words ``[BLOCK_N, BLOCK_K / 8]`` (16-byte loads); word ``w`` of row ``n`` holds
  k = 8w .. 8w + 7, nibble ``i`` (bits 4i..4i+3) being k = 8w + i. Two shifts and two masks turn nibbles
  ``c`` and ``c + 4`` of every word into two fp16 values (E2M1 value * 2^-14, exact: the E2M1 subnormal 0.5
  lands on an fp16 subnormal), so each word yields eight weight "classes" k = 8w + c, c = 0..7;
- the activations are read from a class-major copy ``x[rows, 8, K/8]`` (one small transpose per call), so
  class ``c`` of a tile is a contiguous vector;
- ``BLOCK_M = 1`` (GEMV style, about one row per expert): the eight classes of a word are multiplied and
  summed in fp32, then scaled once per word by ``2^(s - 127 + 14)`` (built from the E8M0 bits);
  ``num_stages > 1`` here means: load the next tile into registers before this one's arithmetic;
- ``BLOCK_M >= 16``: each class is scaled in fp32, rounded to the activation dtype and multiplied on tensor
  cores (``tl.dot``, tokens padded to the block);
- ``SPLIT_K > 1`` splits K over the grid and adds fp32 partials with atomics (fills the GPU when there are
  few row blocks and N tiles).

Scale bytes above 240 (blocks beyond 2^113) make the dequantized weights inf: far outside any model's range.
"""
from __future__ import annotations

import math
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

GPU_SMS = 132  # H200: the default config splits K until the grid has a program per SM


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` is a constexpr function: slow to call on the host)."""
    return -(-a // b)


@triton.jit
def _e2m1_pair(words, c: tl.constexpr):
    """fp16 ``E2M1 * 2^-14`` of nibbles ``c`` and ``c + 4`` of int32 ``words``: (k = 8w + c, k = 8w + c + 4).

    The nibble's magnitude bits go to fp16 bits 9..11 (exponent low bits + mantissa top bit), its sign to bit 15:
    a shifted copy of the word per destination, one mask each (the E2M1 subnormal 0.5 lands on an fp16 subnormal).
    """
    if c < 3:
        magnitude = words << (9 - 4 * c)
    else:
        magnitude = words >> 3
    sign = words << (12 - 4 * c)
    bits = (magnitude & 0x0E000E00) | (sign & -0x7FFF8000)  # -0x7FFF8000 == 0x80008000 as int32
    low = bits.to(tl.int16).to(tl.float16, bitcast=True)
    high = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return low, high


@triton.jit
def _k_mask(k0, k_end, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """Word offsets ``[WORDS]`` of the K tile at ``k0`` and which are inside the split (``[WORDS]`` mask, or the
    tile's scalar when every split is whole tiles: a mask constant along k keeps loads 16-byte vectors)."""
    kw = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, WORDS), WORDS), WORDS)
    if EVEN_K:
        k_ok = k0 < k_end
    else:
        k_ok = kw < k_end
    return kw, k_ok


@triton.jit
def _weight_tile(w_rows, s_rows, k0, k_end, n_ok, WORDS: tl.constexpr, EVEN_K: tl.constexpr,
                 GROUP_SCALES: tl.constexpr):
    """Words ``[BLOCK_N, WORDS]`` of the tile at word ``k0`` and their scale multipliers 2^(s - 113) (one E8M0
    byte per 4 words). ``GROUP_SCALES`` loads the bytes once per group and broadcasts them to the words
    (fewer loads where rows spread over many threads: the tensor-core layouts), else one gather per word."""
    kw, k_ok = _k_mask(k0, k_end, WORDS, EVEN_K)
    if EVEN_K:
        mask = n_ok[:, None] & k_ok
    else:
        mask = n_ok[:, None] & k_ok[None, :]
    words = tl.load(w_rows + kw[None, :], mask=mask, other=0)
    if GROUP_SCALES:
        groups, g_ok = _k_mask(k0 // 4, tl.cdiv(k_end, 4), WORDS // 4, EVEN_K)
        if EVEN_K:
            g_mask = n_ok[:, None] & g_ok
        else:
            g_mask = n_ok[:, None] & g_ok[None, :]
        s = tl.load(s_rows + groups[None, :], mask=g_mask, other=0)
    else:
        s = tl.load(s_rows + (kw // 4)[None, :], mask=mask, other=0)
    multiplier = (tl.minimum(s.to(tl.int32) + 14, 255) << 23).to(tl.float32, bitcast=True)  # 2^(s-113)
    if GROUP_SCALES:
        multiplier = tl.reshape(tl.broadcast_to(multiplier[:, :, None], (w_rows.shape[0], WORDS // 4, 4)),
                                (w_rows.shape[0], WORDS))
    return words, multiplier


@triton.jit
def _x_class(x_rows_ptr, c: tl.constexpr, kw, K_WORDS, row_ok, k_ok, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations of weight class ``c`` (k = 8 kw + c) from the class-major copy ``x[rows, 8, K/8]``:
    ``[WORDS, BLOCK_M]`` for tl.dot, ``[BLOCK_M (= 1), WORDS]`` for the FMA path."""
    if USE_DOT:
        if EVEN_K:
            mask = row_ok[None, :] & k_ok
        else:
            mask = k_ok[:, None] & row_ok[None, :]
        x = tl.load(x_rows_ptr[None, :] + c * K_WORDS + kw[:, None], mask=mask, other=0.0)
    else:
        if EVEN_K:
            mask = row_ok[:, None] & k_ok
        else:
            mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows_ptr[:, None] + c * K_WORDS + kw[None, :], mask=mask, other=0.0)
    return x


@triton.jit
def _fused_moe_kernel(
    x_ptr, x_row_ptr, w_ptr, s_ptr, y_ptr, padded_rows_ptr, block_expert_ptr,
    N, K_WORDS,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    GATHER: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    USE_DOT: tl.constexpr = BLOCK_M > 1
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
    x_rows_ptr = x_ptr + x_rows.to(tl.int64) * stride_xm
    if USE_DOT:  # tensor cores; the compiler pipelines the loads (num_stages)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, WORDS):
            kw, k_ok = _k_mask(k0, k_end, WORDS, EVEN_K)
            words, multiplier = _weight_tile(w_rows, s_rows, k0, k_end, n_ok, WORDS, EVEN_K, True)
            for c in tl.static_range(4):
                low, high = _e2m1_pair(words, c)
                x_low = _x_class(x_rows_ptr, c, kw, K_WORDS, row_ok, k_ok, USE_DOT, EVEN_K)
                acc = tl.dot((low.to(tl.float32) * multiplier).to(x_low.dtype), x_low, acc)
                x_high = _x_class(x_rows_ptr, c + 4, kw, K_WORDS, row_ok, k_ok, USE_DOT, EVEN_K)
                acc = tl.dot((high.to(tl.float32) * multiplier).to(x_high.dtype), x_high, acc)
        out = acc
    else:  # GEMV: the eight classes of a word summed unscaled, one multiply-add by the word's scale. PREFETCH
        # issues the next tile's loads before this tile's arithmetic (the pipeliner leaves dot-free loops alone)
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        if PREFETCH:
            words, multiplier = _weight_tile(w_rows, s_rows, k_begin, k_end, n_ok, WORDS, EVEN_K, False)
        for k0 in range(k_begin, k_end, WORDS):
            kw, k_ok = _k_mask(k0, k_end, WORDS, EVEN_K)
            if PREFETCH:
                next_words, next_multiplier = _weight_tile(w_rows, s_rows, k0 + WORDS, k_end, n_ok, WORDS, EVEN_K, False)
            else:
                words, multiplier = _weight_tile(w_rows, s_rows, k0, k_end, n_ok, WORDS, EVEN_K, False)
            part = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
            for c in tl.static_range(4):
                low, high = _e2m1_pair(words, c)
                x_low = _x_class(x_rows_ptr, c, kw, K_WORDS, row_ok, k_ok, USE_DOT, EVEN_K)
                part += low.to(tl.float32) * x_low.to(tl.float32)
                x_high = _x_class(x_rows_ptr, c + 4, kw, K_WORDS, row_ok, k_ok, USE_DOT, EVEN_K)
                part += high.to(tl.float32) * x_high.to(tl.float32)
            acc += part * multiplier
            if PREFETCH:
                words, multiplier = next_words, next_multiplier
        out = tl.sum(acc, axis=1)[:, None]
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
    k_words = words.shape[-1]
    x_classes = x.view(x.shape[0], k_words, 8).transpose(1, 2).contiguous()  # [rows, 8, K/8]: k = 8w + c -> [c, w]
    grid = (alignment.num_blocks, _cdiv(n, config["BLOCK_N"]), split)
    gemv = config["BLOCK_M"] == 1  # num_stages > 1 means: prefetch the next tile into registers
    _fused_moe_kernel[grid](
        x_classes, sort.sorted_token, words, scales, y, alignment.padded_rows, alignment.block_expert,
        n, k_words,
        x_classes.stride(0), words.stride(0), words.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
        GATHER=gather_tokens, ATOMIC=split > 1, EVEN_K=k_words % (split * config["BLOCK_K"] // 8) == 0,
        PREFETCH=gemv and config["num_stages"] > 1,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT_K=split,
        num_warps=config["num_warps"], num_stages=1 if gemv else config["num_stages"],
    )
    return y.to(x.dtype) if split > 1 else y


# -- registry entry --------------------------------------------------------------------------------
SPACE = {
    "BLOCK_M": (1, 16, 32, 64),  # 1: FMA (GEMV style); >= 16: tl.dot with tokens padded to the block
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (64, 128, 256, 512),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2, 3, 4),
}


def _constraint(config, shape) -> str | None:
    bm, bn, bk, warps = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_warps"]
    words = bk // 8
    if bm > 1 and words < 16:
        return "tl.dot needs BLOCK_K / 8 >= 16 (BLOCK_K >= 128)"
    if bm == 1 and config["num_stages"] > 2:
        return "GEMV style: num_stages 1 (no prefetch) or 2 (prefetch the next tile) only"
    if bm > max(16, bucket(shape["T"] * shape["top_k"])):
        return "BLOCK_M exceeds the routed rows"
    if bn > max(16, bucket(shape["N"])) or bk > max(128, bucket(shape["K"])):
        return "BLOCK_N or BLOCK_K exceeds the matrix"
    if config["SPLIT_K"] > _cdiv(shape["K"], bk):
        return "SPLIT_K leaves a split without a K tile"
    if bm > 1 and config["num_stages"] * (2 * bk * bm + bn * bk // 2 + bn * bk // 32) > 200 * 1024:
        return "pipelined x, weight and scale tiles exceed 200 KB of shared memory"
    per_thread = bn * words / (32 * warps)  # weight words per thread; GEMV keeps as many fp32 partial sums
    if per_thread > (32 if bm == 1 else 64) or bn * bm / (32 * warps) > 128:
        return "tile too large for the registers of num_warps warps"
    return None


def expected_active_experts(shape) -> float:
    """Experts that get at least one of T * top_k routes when each token picks top_k distinct ones uniformly."""
    e, k, t = shape["E"], shape["top_k"], shape["T"]
    return e * (1.0 - (1.0 - k / e) ** t)


def _default(phase, shape):
    """GEMV style (BLOCK_M = 1) while experts average under 1.2 rows, else tensor cores with 16..64-row blocks.

    Tiles from the sm_90 SASS of this kernel (loop instructions per weight: GEMV 128 x 128 about 5.3 at 80
    registers, 64 x 256 about 5.7; tensor cores 16 x 128 x 128 about 6.7, the weights fed to wgmma from
    registers). A GEMV grid under four programs per SM takes 64 x 256 tiles (twice the programs, so each
    scheduler has warps to switch to while loads are in flight); K is split only when the grid would still
    leave SMs idle.
    """
    routed = shape["T"] * shape["top_k"]
    per_expert = routed / max(expected_active_experts(shape), 1.0)
    block_m = 1 if per_expert < 1.2 else 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    blocks = routed if block_m == 1 else expected_active_experts(shape) * math.ceil(per_expert / block_m)
    block_n, block_k, stages = min(128, max(16, bucket(shape["N"]))), 128, 1 if block_m == 1 else 3
    if block_m == 1 and blocks * _cdiv(shape["N"], block_n) < 4 * GPU_SMS:
        block_n, block_k = min(64, block_n), min(256, max(128, bucket(shape["K"])))
    programs = blocks * _cdiv(shape["N"], block_n)
    split = 1
    while programs * split < GPU_SMS and 2 * split <= min(8, _cdiv(shape["K"], block_k)):
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": stages}


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
