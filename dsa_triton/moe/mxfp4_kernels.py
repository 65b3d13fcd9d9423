"""MXFP4 quantize / dequantize kernels and the E2M1 helpers the MXFP4 -> FP8 conversion and the prefill GEMM share.

One program of :func:`_quantize_kernel` / :func:`_dequantize_kernel` handles ``BLOCK_B`` consecutive 32-element
blocks of the flattened weight, so any leading shape ``[..., N, K]`` works; both match :mod:`.mxfp4_reference`
bit for bit (codes, scales and dequantized values).

The kernels keep their leading underscore: profiles and recorded launches name them so.
"""
import triton
import triton.language as tl


@triton.jit
def e2m1_code(x):
    """E2M1 code (int32 0..15) of fp32 ``x`` already divided by its block scale: nearest even, saturating at 6."""
    a = tl.abs(x)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    code += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return code | ((x < 0).to(tl.int32) << 3)


@triton.jit
def e2m1_bits(code, exp_field):
    """fp32 bit pattern (int32) of E2M1 ``code`` times ``2^(exp_field - 127)``; needs 2 <= exp_field <= 249.

    Built from the code's 2 exponent bits and 1 mantissa bit: magnitude m >= 2 is
    ``2^((m >> 1) - 1) * (1 + (m & 1) / 2)``, m = 1 is 0.5, m = 0 is 0.
    """
    mag = code & 7
    bits = (mag << 22) + ((exp_field - 1) << 23) - ((mag == 1).to(tl.int32) << 22)
    bits = tl.where(mag == 0, 0, bits)
    return bits | ((code & 8) << 28)


@triton.jit
def widen_to_fp32(x):
    """fp32 of a loaded fp32/fp16/bf16 tensor; bf16 is widened by its bits (exact, subnormals too, where the
    interpreter's cast is wrong)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _quantize_kernel(w_ptr, blocks_ptr, scales_ptr, n_blocks, BLOCK_B: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    inside = b < n_blocks
    w = widen_to_fp32(tl.load(w_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=inside[:, None], other=0.0))
    amax = tl.max(tl.abs(w), axis=1)
    # floor(log2(amax)) - 2 + 127, clamped at 0: the biased fp32 exponent of amax minus 2 (subnormals give 0)
    scale = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 2, 0)
    inv_scale = ((254 - scale) << 23).to(tl.float32, bitcast=True)  # 2^(127 - scale), a normal fp32
    code = e2m1_code(w * inv_scale[:, None])
    even, odd = tl.split(tl.reshape(code, [BLOCK_B, 16, 2]))
    packed = (even | (odd << 4)).to(tl.uint8)
    tl.store(blocks_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], packed, mask=inside[:, None])
    tl.store(scales_ptr + b, scale.to(tl.uint8), mask=inside)


@triton.jit
def _dequantize_kernel(blocks_ptr, scales_ptr, out_ptr, n_blocks, BLOCK_B: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    inside = b < n_blocks
    packed = tl.load(blocks_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], mask=inside[:, None], other=0).to(tl.int32)
    scale = tl.load(scales_ptr + b, mask=inside, other=127).to(tl.int32)
    # 2^(scale - 127) as max(scale, 1) in the exponent field, halved once more for scale 0 (a subnormal)
    factor = (tl.maximum(scale, 1) << 23).to(tl.float32, bitcast=True) * tl.where(scale == 0, 0.5, 1.0)
    lo = e2m1_bits(packed & 0xF, 127).to(tl.float32, bitcast=True)
    hi = e2m1_bits(packed >> 4, 127).to(tl.float32, bitcast=True)
    values = tl.reshape(tl.join(lo, hi), [BLOCK_B, 32]) * factor[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # every MXFP4 value has <= 2 significant bits, so bf16 is the fp32 pattern's top half (exact, and
        # right for bf16 subnormals, which the interpreter's cast gets wrong)
        out = (values.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = values.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], out, mask=inside[:, None])
