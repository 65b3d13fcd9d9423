"""SwiGLU of the gate_up GEMM's output in one launch, optionally written class-major for the fused down GEMM.

``y = silu(gate) * up`` in fp32 from ``h[M, 2I]`` (gate columns ``0 .. I-1``, up ``I .. 2I-1``), rounded to the
output dtype. With ``class_major=True`` the output is ``[M, 4, I/4]`` (``y[m, c, q]`` = column ``4q + c``), the
layout :func:`.fused_moe_gemm.fused_moe_gemm` reads its activations in: the down GEMM then needs no transpose of its
own (the layout costs nothing here: the same bytes are written, in another order). Replaces the three torch
kernels of the reference (silu, mul, conversion) with one. An elementwise op at a fixed tile (1024 columns
of a row per program, 4 warps): not a tuned kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_kernel_device, check_out, check_tensor
from ..hostmath import cdiv
from ..launch import launch_with
from ..library import dsa_op
from ..plans import cached

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_Q = 256  # column quarters (4 columns each) per program


@triton.jit
def _swiglu_kernel(h_ptr, y_ptr, I, stride_h, stride_y, CLASS_MAJOR: tl.constexpr, BLOCK_Q: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    c = tl.arange(0, 4)
    cols = 4 * q[:, None] + c[None, :]  # [BLOCK_Q, 4], contiguous along the row
    ok = cols < I
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + I + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    if CLASS_MAJOR:  # column 4q + c -> [c, q]
        dest = c[None, :] * (I // 4) + q[:, None]
    else:
        dest = cols
    tl.store(y_ptr + row * stride_y + dest, y.to(y_ptr.dtype.element_ty), mask=ok)


@cached
def _swiglu_meta(class_major: bool, block_q: int) -> dict:
    return dict(CLASS_MAJOR=class_major, BLOCK_Q=block_q, num_warps=4)


def swiglu(h: torch.Tensor, dtype: torch.dtype | None = None, class_major: bool = False, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``h`` fp32/fp16/bf16 ``[M, 2I]`` (gate | up, last dim contiguous) -> ``silu(gate) * up`` in ``dtype``
    (None: ``h``'s; fp32/fp16/bf16): ``[M, I]``, or ``[M, 4, I/4]`` with ``y[m, c, q]`` = column ``4q + c``
    when ``class_major`` (then ``I`` must be a multiple of 4). Reference: :func:`.activation_reference.swiglu_torch`.
    ``out``: optional contiguous tensor of that shape and dtype to write (and return).
    Nothing is read on the host: a NaN or infinity in ``h`` propagates through the arithmetic (NaN in, NaN out).
    """
    check_tensor("h", h, dtype=DTYPES, ndim=2)
    check_kernel_device("h", h)
    rows, width = h.shape
    if width % 2:
        raise ValueError(f"h: the last dimension holds gate and up halves and must be even, got {width}")
    inter = width // 2
    if class_major and inter % 4:
        raise ValueError(f"h: class_major output needs I = {inter} (half the last dimension) a multiple of 4")
    dtype = h.dtype if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    shape = (rows, 4, inter // 4) if class_major else (rows, inter)
    y = torch.empty(shape, dtype=dtype, device=h.device) if out is None else check_out(out, shape, dtype, h.device)
    if rows and inter:
        launch_with(_swiglu_kernel, (rows, cdiv(inter, 4 * BLOCK_Q)), _swiglu_meta(class_major, BLOCK_Q),
                    h, y, inter, h.stride(0), inter)
    return y


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("swiglu")
def swiglu_op(h: torch.Tensor, dtype: torch.dtype | None = None, class_major: bool = False, check_values: bool = True,
              config: str | None = None) -> torch.Tensor:
    """:func:`dt.swiglu`: ``h[M, 2I]`` -> ``[M, I]`` (or ``[M, 4, I/4]`` class-major) in ``dtype`` (None: h's).
    A fixed-tile elementwise op: ``config`` is accepted and unused."""
    return swiglu(h, dtype, class_major)


@swiglu_op.register_fake
def _(h, dtype=None, class_major=False, check_values=True, config=None):
    inter = h.shape[1] // 2
    shape = (h.shape[0], 4, inter // 4) if class_major else (h.shape[0], inter)
    return h.new_empty(shape, dtype=dtype or h.dtype)


@dsa_op("swiglu_out", mutates_args=("out",))
def swiglu_out(h: torch.Tensor, out: torch.Tensor, class_major: bool = False, check_values: bool = True,
               config: str | None = None) -> None:
    """:func:`dt.swiglu` into ``out`` (``[M, I]``, or ``[M, 4, I/4]`` class-major; contiguous; its dtype is the
    output's)."""
    check_tensor("out", out, dtype=(torch.float32, torch.float16, torch.bfloat16), contiguous_last=False)
    swiglu(h, out.dtype, class_major, out=out)


@swiglu_out.register_fake
def _(h, out, class_major=False, check_values=True, config=None):
    return None
