"""Kernels of the prefill grouped GEMM (:mod:`.fp8_grouped_gemm`): the activation quantization and the two routes.

- :func:`_quantize_rows_kernel`: ``x`` to e4m3 with one power-of-two scale per row (oracle
  :func:`.fp8_grouped_gemm_reference.quantize_rows_fp8_torch`, bit for bit), optionally in the registers route's
  interleaved k order (:func:`.mxfp4_to_fp8_kernels.interleave_blocks`);
- :func:`_grouped_gemm_kernel`: the workspace route's FP8 GEMM of one stage, weights from workspace slots;
- :func:`_fused_gemm_kernel`: the registers route, MXFP4 codes converted to e4m3 on their way to the tensor cores.

Both GEMMs take row tiles of ``BLOCK_M`` rows of one expert x ``BLOCK_N`` output columns from a schedule
``tiles`` (slot, first row, end row), ``GROUP_M`` row tiles per N column for L2 reuse.

The kernels keep their leading underscore: profiles and recorded launches name them so.
"""
import triton
import triton.language as tl

from ..fp8_rounding import to_e4m3
from .mxfp4_kernels import widen_to_fp32
from .mxfp4_to_fp8_kernels import (e4m3_pairs, fast_tables, interleave_blocks, pair_words, reference_scale,
                                   words_to_fp8)


@triton.jit
def _store_e4m3(q_ptrs, scaled, mask, INTERLEAVED: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    q = to_e4m3(scaled, SOFTWARE_ROUND)
    if INTERLEAVED:  # K a multiple of 128: ``mask`` is the same over each 128-k group, interleaved or not
        q = interleave_blocks(q, 4)
    tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _non_finite_rows(x):
    """int32 ``[R]``: 1 where the fp32 row ``x[R, C]`` holds NaN or inf (exponent bits all set; a bit test, which no
    NaN-dropping maximum or compiler folding can lose)."""
    return tl.max(((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          ONE_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):
    """``BLOCK_M`` rows per program; ``ONE_PASS`` (``BLOCK_K >= K``): each row tile is read once and kept in
    registers, else read twice, ``BLOCK_K`` at a time (the row maximum, then the quantization). A row holding NaN
    or inf gets scale NaN and elements 0: every product of it is NaN, as the exact one would be."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)[:, None]
    if ONE_PASS:
        k = tl.arange(0, BLOCK_K)
        inside = (rows < M)[:, None] & (k < K)[None, :]
        x = widen_to_fp32(tl.load(x_ptr + rows64 * stride_x + k[None, :], mask=inside, other=0.0))
        amax = tl.max(tl.abs(x), axis=1)
        bad = _non_finite_rows(x)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        bad = tl.zeros([BLOCK_M], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = widen_to_fp32(tl.load(x_ptr + rows64 * stride_x + k[None, :],
                                      mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0))
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            bad = tl.maximum(bad, _non_finite_rows(x))
    bits = amax.to(tl.int32, bitcast=True)
    # smallest e with amax <= 448 * 2^e: amax = 1.f * 2^E gives E - 8, one more when 1.f > 1.75
    e = tl.maximum(((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32), -126)
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    zero = (bad > 0)[:, None]
    if ONE_PASS:
        _store_e4m3(q_ptr + rows64 * stride_q + k[None, :], tl.where(zero, 0.0, x * inv_scale), inside, INTERLEAVED,
                    SOFTWARE_ROUND)
    else:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            inside = (rows < M)[:, None] & (k < K)[None, :]
            x = widen_to_fp32(tl.load(x_ptr + rows64 * stride_x + k[None, :], mask=inside, other=0.0))
            _store_e4m3(q_ptr + rows64 * stride_q + k[None, :], tl.where(zero, 0.0, x * inv_scale), inside,
                        INTERLEAVED, SOFTWARE_ROUND)
    scale = tl.where(bad > 0, float("nan"), ((e + 127) << 23).to(tl.float32, bitcast=True))
    tl.store(s_ptr + rows, scale, mask=rows < M)


@triton.jit
def _tile(tiles_ptr, n_mtiles, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's row tile ``(slot, first row, end row)`` and N tile: ``GROUP_M`` row tiles per N column."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_mtiles - first_m, GROUP_M)
    mt = first_m + (pid % per_group) % group_m
    slot = tl.load(tiles_ptr + mt * 3).to(tl.int64)
    return slot, tl.load(tiles_ptr + mt * 3 + 1), tl.load(tiles_ptr + mt * 3 + 2), (pid % per_group) // group_m


@triton.jit
def _grouped_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, tiles_ptr, n_mtiles, N, K,
                         stride_xm, stride_we, stride_wn, stride_swe, stride_swn, stride_swg, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, ROW_SCALED: tl.constexpr):
    """``ROW_SCALED``: the weights' group scales are equal along each row (converted against the row's reference):
    the tensor cores accumulate all of K and the row scale applies once, after the loop."""
    slot, row0, row_end, nt = _tile(tiles_ptr, n_mtiles, N, BLOCK_N, GROUP_M)  # slot: in this stage's half
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, row_end - 1).to(tl.int64)  # clamped: no row or column masks on the loads
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + kk[None, :]
    w_ptrs = w_ptr + slot * stride_we + cols_in[None, :] * stride_wn + kk[:, None]  # [BLOCK_K, BLOCK_N]
    sw_ptrs = sw_ptr + slot * stride_swe + cols_in * stride_swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_in = k0 + kk < K
            a = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        if ROW_SCALED:
            acc = tl.dot(a, b, acc)
        else:
            acc += tl.dot(a, b) * tl.load(sw_ptrs + (k0 // 128) * stride_swg)[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if ROW_SCALED:
        acc *= tl.load(sw_ptrs)[None, :]
    acc *= tl.load(sx_ptr + rows_in)[:, None]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _fused_tile(x_ptr, sx_ptr, pair_rows, scale_rows, ref, y_ptr, row0, row_end, cols, N, K, KB, stride_xm,
                stride_ym, BLOCK_M: tl.constexpr, W_SMEM: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr,
                UNROLL: tl.constexpr):
    """Rows ``row0 + [0, BLOCK_M)`` (below ``row_end``) x the weight rows ``cols`` of one expert (``pair_rows``,
    ``scale_rows``, ``ref``: theirs): the k loop and the store."""
    rows = row0 + tl.arange(0, BLOCK_M)
    rows_in = tl.minimum(rows, row_end - 1).to(tl.int64)  # clamped: the loads need no masks
    x_rows = x_ptr + rows_in[:, None] * stride_xm
    p, b, kk = tl.arange(0, 16), tl.arange(0, 4), tl.arange(0, 128)
    if W_SMEM:
        acc = tl.zeros((BLOCK_M, cols.shape[0]), dtype=tl.float32)
    else:
        acc = tl.zeros((cols.shape[0], BLOCK_M), dtype=tl.float32)
    for g in tl.range(0, tl.cdiv(KB, 4), loop_unroll_factor=UNROLL):  # one 128-k group (four 32-blocks) per step
        if EVEN_K:  # x_ptr then holds :func:`interleave_blocks` order: the converted words are put in it
            pairs = tl.load(pair_rows + g * 16 + p[None, :])
            s = tl.load(scale_rows + g * 4 + b[None, :])
            xt = tl.load(x_rows + g * 128 + kk[None, :])
        else:
            pairs = tl.load(pair_rows + g * 16 + p[None, :], mask=(g * 16 + p < KB * 4)[None, :], other=0)
            s = tl.load(scale_rows + g * 4 + b[None, :], mask=(g * 4 + b < KB)[None, :], other=0)
            xt = tl.load(x_rows + g * 128 + kk[None, :], mask=(g * 128 + kk < K)[None, :], other=0.0)
        lo, hi = fast_tables(tl.minimum(ref[:, None] - s.to(tl.int32), 11))  # the clamp only touches padding blocks
        first, second = e4m3_pairs(pairs, lo, hi, PTX)
        w8 = words_to_fp8(pair_words(first, second, EVEN_K))
        if W_SMEM:
            acc = tl.dot(xt, tl.trans(w8), acc)
        else:
            acc = tl.dot(w8, tl.trans(xt), acc)
    sx = tl.load(sx_ptr + rows_in)
    if W_SMEM:
        out = acc * sx[:, None] * reference_scale(ref)[None, :]
    else:
        out = tl.trans(acc * reference_scale(ref)[:, None] * sx[None, :])
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], out.to(y_ptr.dtype.element_ty),
             mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _fused_gemm_kernel(x_ptr, sx_ptr, pairs_ptr, scales_ptr, ref_ptr, y_ptr, tiles_ptr, experts_ptr, n_mtiles,
                       N, K, KB, stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_re, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                       W_SMEM: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr, UNROLL: tl.constexpr):
    """``acc[BLOCK_N, BLOCK_M]`` = weights (converted in registers: the MMA's register operand) x tokens^T, or with
    ``W_SMEM`` ``acc[BLOCK_M, BLOCK_N]`` = tokens x weights^T (the converted tile stored to shared memory as the
    second operand: sm_90 SASS then issues a k-step's four wgmma back to back instead of waiting after each).
    ``UNROLL=2`` unrolls the k loop twice: with software pipelining, ptxas then issues the register-operand
    wgmmas of a step back to back too (unrolled once, 2-4 stages serialize them at 64 x 128 / 4 warps: advisory
    C7515). An expert's last tile holding at most ``BLOCK_M / 2`` rows runs as a tile of ``BLOCK_M / 2`` rows (from
    32 rows): half the MMA and the token loads, the same conversion."""
    slot, row0, row_end, nt = _tile(tiles_ptr, n_mtiles, N, BLOCK_N, GROUP_M)
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    if slot < 0:  # rows of no expert (a schedule planned on the device): zeros; its padding tiles have no rows
        rows = row0 + tl.arange(0, BLOCK_M)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                 tl.zeros((BLOCK_M, BLOCK_N), y_ptr.dtype.element_ty),
                 mask=(rows < row_end)[:, None] & (cols < N)[None, :])
        return
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    ref = tl.load(ref_ptr + expert * stride_re + cols_in).to(tl.int32)  # each weight row's largest block scale
    pair_rows = pairs_ptr + expert * stride_ce + cols_in[:, None] * stride_cn  # int32: eight codes each
    scale_rows = scales_ptr + expert * stride_se + cols_in[:, None] * stride_sn
    HALF_M: tl.constexpr = BLOCK_M // 2 if BLOCK_M >= 32 else BLOCK_M  # (a dot needs 16 rows)
    if row_end - row0 <= BLOCK_M // 2:
        _fused_tile(x_ptr, sx_ptr, pair_rows, scale_rows, ref, y_ptr, row0, row_end, cols, N, K, KB, stride_xm,
                    stride_ym, HALF_M, W_SMEM, EVEN_K, PTX, UNROLL)
    else:
        _fused_tile(x_ptr, sx_ptr, pair_rows, scale_rows, ref, y_ptr, row0, row_end, cols, N, K, KB, stride_xm,
                    stride_ym, BLOCK_M, W_SMEM, EVEN_K, PTX, UNROLL)
