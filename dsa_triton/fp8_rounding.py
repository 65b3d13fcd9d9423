"""fp32 -> e4m3 in Triton kernels, to the nearest value, ties to even.

On the GPU the cast is one ``cvt.rn`` instruction. The Triton interpreter's own fp32 -> e4m3 cast rounds wrongly
near binade edges and ties, so in the interpreter the value is first rounded in fp32 arithmetic
(:func:`round_to_e4m3`), after which the cast is exact. The two agree bit for bit on the GPU
(``scripts/quantize_bench.py`` compares them).
"""
import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """Round fp32 ``x`` (|x| <= 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic (still fp32)."""
    bits = x.to(tl.int32, bitcast=True)
    ulp_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # e4m3: 3 mantissa bits, min normal 2^-6
    y = x * ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)  # exact: |y| < 16
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds y to an integer, ties to even
    y = tl.where(y == 0.0, x * 0.0, y)  # keep the sign of zero
    return y * ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, SOFTWARE: tl.constexpr):
    """fp32 ``x`` (|x| <= 448) -> e4m3: the GPU's cast, or with ``SOFTWARE`` (the interpreter)
    :func:`round_to_e4m3` first."""
    if SOFTWARE:
        return round_to_e4m3(x).to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
