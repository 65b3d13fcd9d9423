"""MXFP4 -> FP8 conversion kernel (:func:`_convert_kernel`) and the register-side helpers the prefill GEMM's
registers route shares with it.

One program converts ``BLOCK_N`` rows x ``GROUPS`` 128-k groups of one expert: it reads the groups' E8M0 scales,
takes ``ref = max - 6`` per group and ``d`` = binades of each block below its group's top, and writes the group
scale ``2^(ref - 127)`` (or, given each row's reference exponent, ``ROW_REF``, the same for every group of the
row: one scale per row). Values are ``e2m1 * 2^(6 - d)`` in e4m3, made from the code bits by byte permutes, eight
per 32 bits of codes (:func:`e4m3_pairs`: PTX ``prmt`` against each block's 8-byte table of its E2M1 magnitudes,
and one more ``prmt`` placing the sign bits), about 1.1 integer operations per value, so the kernel stays bound by
memory. The tables: where every ``d <= 11`` in the tile (every value a normal e4m3 number, every block fits) a
closed form (:func:`fast_tables`); otherwise each magnitude is cast to e4m3 once per block (:func:`exact_tables`:
nearest even, subnormal or zero far below), and a block is unfit when one of its codes picks a magnitude the cast
changed; unfit blocks are counted with one atomic add per program.

For the fused prefill GEMM (:mod:`.fp8_grouped_gemm_kernels`), which converts weight tiles on their way to the
tensor cores instead of through a workspace: :func:`e4m3_pairs` with :func:`fast_tables` turns each 32 bits of
codes into two words of four e4m3 bytes, :func:`pair_words` puts them in k order or in the registers route's
(:func:`interleave_blocks`), :func:`words_to_fp8` turns those words into an FP8 tile.

The kernels keep their leading underscore: profiles and recorded launches name them so.
"""
import triton
import triton.language as tl

from .mxfp4_kernels import e2m1_bits

_SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 (bit 7 of each byte) as an int32


@triton.jit
def reference_scale(top):
    """fp32 ``2^(top - 133)`` of int32 ``top`` (a block scale byte, 0..254): the scale of e4m3 values whose reference
    is ``top - 6``; a subnormal fp32 for top < 7, so built from two normal factors. ``top`` 255 (E8M0 0xFF, NaN)
    gives NaN, so a NaN block that reaches a kernel unchecked makes its row's products NaN, not finite."""
    scale = ((tl.maximum(top, 7) - 6) << 23).to(tl.float32, bitcast=True) \
        * ((tl.minimum(top, 7) + 120) << 23).to(tl.float32, bitcast=True)
    return tl.where(top > 254, float("nan"), scale)


@triton.jit
def byte_permute(lo, hi, sel, PTX: tl.constexpr):
    """int32 lanes: byte ``i`` of the result is byte ``nibble i of sel`` (0..7) of the 8 bytes ``hi:lo`` (PTX ``prmt``;
    where PTX is not available, as in the interpreter, the same in plain integer operations)."""
    if PTX:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sel], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        out = tl.zeros_like(sel)
        for i in tl.static_range(4):
            s = (sel >> (4 * i)) & 7
            out |= (((tl.where(s < 4, lo, hi) >> ((s & 3) * 8)) & 0xFF) << (8 * i))
        return out


@triton.jit
def fast_tables(d):
    """int32 ``(lo, hi)`` ``[R, B]``: the e4m3 bytes of E2M1 magnitudes 0..3 and 4..7 times 2^(6 - d), for ``d`` int32
    ``[R, B]`` in 0..11 (all normal): 0 .5 1 1.5 | 2 3 4 6 times 2^6 are e4m3 0x00 60 68 6C | 70 74 78 7C, and d
    lowers every nonzero byte's exponent."""
    return 0x6C686000 - d * 0x08080800, 0x7C787470 - d * 0x08080808


@triton.jit
def exact_tables(d):
    """``(lo, hi, lossy)`` for any ``d >= 0``: each magnitude times 2^(6 - d) cast to e4m3 (nearest even; subnormal,
    or zero, far below) and an 8-bit mask of the magnitudes the cast changed (bit m: magnitude m is unfit)."""
    rows: tl.constexpr = d.shape[0]
    blocks: tl.constexpr = d.shape[1]
    m = tl.arange(0, 8)[None, None, :]
    bits = e2m1_bits(m, (133 - tl.minimum(d, 120))[:, :, None])  # [R, B, 8] (d capped: the pattern stays normal)
    byte = bits.to(tl.float32, bitcast=True).to(tl.float8e4nv).to(tl.int8, bitcast=True).to(tl.int32) & 0xFF
    lo, hi = tl.split(tl.sum(tl.reshape(byte << (8 * (m % 4)), [rows, blocks, 2, 4]), axis=3))
    return lo, hi, tl.sum(_lost_in_e4m3(bits) << m, axis=2)


@triton.jit
def per_block(table, words):
    """``table`` ``[R, B]`` repeated over each block's words: ``[R, W]`` like ``words`` (each block's ``W / B`` words
    contiguous)."""
    rows: tl.constexpr = words.shape[0]
    blocks: tl.constexpr = table.shape[1]
    return tl.reshape(tl.broadcast_to(table[:, :, None], [rows, blocks, words.shape[1] // blocks]), words.shape)


@triton.jit
def interleave_blocks(t, UNIT: tl.constexpr):
    """``t [R, C]`` in k order, ``UNIT`` elements per four k (1 for words of four e4m3 bytes, 4 for bytes; C a
    multiple of ``32 UNIT``) -> the same values with each 128-k group's four 32-blocks interleaved four k at a time:
    quarter ``a`` (0..7) of block ``b`` (0..3) moves from ``8 b + a`` to ``4 a + b``. The registers route's k order:
    a thread's share of the MMA operand (four k at ``4 q`` and ``4 q + 16`` of each k32 step) is then one block's
    contiguous 16 bytes instead of eight 2-byte pieces 8 bytes apart (8 shared-memory loads a 128-k step instead of
    36 in the sm_90 SASS, and no bank conflicts)."""
    rows: tl.constexpr = t.shape[0]
    cols: tl.constexpr = t.shape[1]
    grouped = tl.reshape(t, [rows * cols // (32 * UNIT), 4, 8, UNIT])
    return tl.reshape(tl.permute(grouped, (0, 2, 1, 3)), [rows, cols])


@triton.jit
def e4m3_pairs(pairs, lo, hi, PTX: tl.constexpr):
    """e4m3 words of E2M1 codes: ``pairs`` int32 ``[R, 4 B]`` (32 bits: eight codes, low nibble first) of ``B``
    32-blocks in k order, with their blocks' tables ``lo``/``hi`` ``[R, B]`` -> ``(first, second)``, int32
    ``[R, 4 B]`` each: four e4m3 bytes of a pair's low four codes, and of its high four. A magnitude is a byte
    permute of the table by the code with its sign bit cleared (``prmt`` reads a selector's low 16 bits: the low
    four need no shift); the sign bits move from bit ``4 i + 3`` of the pair to bit ``8 i + 7`` of a word through
    one byte permute of the pair and the pair shifted left by 4 (bytes ``4 0 5 1``, then ``6 2 7 3``), masked into
    the magnitudes: nine integer operations per eight values."""
    lo_w, hi_w = per_block(lo, pairs), per_block(hi, pairs)
    magnitude = pairs & 0x77777777
    shifted = pairs << 4
    first = byte_permute(lo_w, hi_w, magnitude, PTX) \
        | (byte_permute(pairs, shifted, tl.full(pairs.shape, 0x1504, tl.int32), PTX) & _SIGN_BITS)
    second = byte_permute(lo_w, hi_w, magnitude >> 16, PTX) \
        | (byte_permute(pairs, shifted, tl.full(pairs.shape, 0x3726, tl.int32), PTX) & _SIGN_BITS)
    return first, second


@triton.jit
def pair_words(first, second, INTERLEAVED: tl.constexpr):
    """:func:`e4m3_pairs`' words ``[R, C]`` each -> ``[R, 2 C]`` in k order (word ``2 c`` is ``first[c]``, ``2 c + 1``
    is ``second[c]``), or with ``INTERLEAVED`` (C a multiple of 16: whole 128-k groups) in :func:`interleave_blocks`
    order (the same sm_90a SASS as permuting the pairs' halves directly: register renaming only)."""
    words = tl.reshape(tl.join(first, second), [first.shape[0], 2 * first.shape[1]])
    if INTERLEAVED:
        words = interleave_blocks(words, 1)
    return words


@triton.jit
def unfit_blocks(pairs, lossy):
    """Blocks (``[R, B]`` int32, 1 = unfit) with a code whose magnitude is marked in their ``lossy`` mask; ``pairs``
    as :func:`e4m3_pairs` takes them."""
    hit = tl.zeros_like(pairs)
    mask = per_block(lossy, pairs)
    for i in tl.static_range(8):
        hit |= (mask >> ((pairs >> (4 * i)) & 7)) & 1
    return tl.max(tl.reshape(hit, [pairs.shape[0], lossy.shape[1], pairs.shape[1] // lossy.shape[1]]), axis=2)


@triton.jit
def words_to_fp8(words):
    """int32 ``[R, W]`` of four e4m3 bytes each (first k in the low byte) -> float8e4nv ``[R, 4 W]``: the bytes
    shifted out and interleaved. Tensor operations only, so any layout the compiler picks keeps the k order; a
    packed inline-asm reread of the words as bytes depends on which registers the layout groups (wrong at K not a
    multiple of 128 with 64-wide N tiles and pipelining, which the interpreter, taking no PTX, cannot show)."""
    rows: tl.constexpr = words.shape[0]
    width: tl.constexpr = words.shape[1] * 4
    b0, b1 = (words & 0xFF).to(tl.int8), ((words >> 8) & 0xFF).to(tl.int8)
    b2, b3 = ((words >> 16) & 0xFF).to(tl.int8), ((words >> 24) & 0xFF).to(tl.int8)
    out = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [rows, width])
    return out.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _lost_in_e4m3(bits):
    """1 where the fp32 pattern ``bits`` (a value with <= 2 significant bits, |v| <= 448) is not exact in e4m3."""
    biased = (bits >> 23) & 0xFF
    half_bit = (bits >> 22) & 1  # 1.5 * 2^u: its lowest set bit is 2^(u - 1)
    return (((bits & 0x7FFFFFFF) != 0) & (biased < 118 + half_bit)).to(tl.int32)  # lowest bit < 2^-9


@triton.jit
def _convert_kernel(pairs_ptr, scales_ptr, ids_ptr, ref_ptr, w_words_ptr, s_ptr, unfit_ptr, N, KB, NG,
                    stride_ce, stride_cn, stride_se, stride_sn, stride_re, stride_we, stride_wn, stride_oe, stride_on,
                    stride_og, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, COUNT_UNFIT: tl.constexpr,
                    ROW_REF: tl.constexpr, PTX: tl.constexpr):
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(2) * (GROUPS * 4) + tl.arange(0, GROUPS * 4)
    inside = (n < N)[:, None] & (kb < KB)[None, :]  # [BLOCK_N, GROUPS * 4] blocks
    s = tl.load(scales_ptr + expert * stride_se + n[:, None] * stride_sn + kb[None, :], mask=inside, other=0).to(tl.int32)
    if ROW_REF:  # every group of a row relative to the row's given reference: one scale per row
        row_ref = tl.load(ref_ptr + expert * stride_re + n, mask=n < N, other=0).to(tl.int32)
        top = tl.broadcast_to(row_ref[:, None], [BLOCK_N, GROUPS])
    else:
        top = tl.max(tl.reshape(s, [BLOCK_N, GROUPS, 4]), axis=2)  # [BLOCK_N, GROUPS]
    top_per_block = tl.reshape(tl.broadcast_to(top[:, :, None], [BLOCK_N, GROUPS, 4]), [BLOCK_N, GROUPS * 4])
    d = tl.where(inside, top_per_block - s, 0)  # binades below the group's top block
    pair_rows = pairs_ptr + expert * stride_ce + n.to(tl.int64)[:, None] * stride_cn  # int32: eight codes each
    p = tl.program_id(2) * (GROUPS * 16) + tl.arange(0, GROUPS * 16)
    pairs = tl.load(pair_rows + p[None, :], mask=(n < N)[:, None] & (p < KB * 4)[None, :], other=0)
    if tl.max(tl.max(d, axis=1), axis=0) <= 11:
        lo, hi = fast_tables(d)
    else:
        lo, hi, lossy = exact_tables(d)
        if COUNT_UNFIT:
            tl.atomic_add(unfit_ptr, tl.sum(tl.sum(unfit_blocks(pairs, lossy), axis=1), axis=0))
    first, second = e4m3_pairs(pairs, lo, hi, PTX)
    j = tl.program_id(2) * (GROUPS * 32) + tl.arange(0, GROUPS * 32)  # k = 4j .. 4j + 3 in word j
    tl.store(w_words_ptr + slot * stride_we + n.to(tl.int64)[:, None] * stride_wn + j[None, :],
             pair_words(first, second, False), mask=(n < N)[:, None] & (j < KB * 8)[None, :])
    g = tl.program_id(2) * GROUPS + tl.arange(0, GROUPS)
    tl.store(s_ptr + slot * stride_oe + n[:, None] * stride_on + g[None, :] * stride_og, reference_scale(top),
             mask=(n < N)[:, None] & (g < NG)[None, :])
