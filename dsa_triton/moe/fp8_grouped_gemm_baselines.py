"""The baselines of the prefill grouped GEMM (``fp8_grouped_gemm``'s spec and the ``moe_prefill`` report): what a
user would run instead on the same routed rows (CSR over experts), torch on expert weights converted ahead of time.

- FP8: an offline e4m3 copy of every expert with one fp32 scale per expert, activations quantized with one
  scale, then ``torch._scaled_mm`` per active expert (cuBLASLt, fast accumulation), or ``torch._scaled_grouped_mm``
  in one call where this torch has it; the faster of the two is the baseline. Per-tensor scales because rowwise
  ``_scaled_mm`` is not supported on every cuBLAS stack (where it fails: results/journal/moe.md); the speed of the
  product should not depend on the scale granularity (expected, not measured);
- bf16: a bf16 copy of every expert, ``torch.mm`` per active expert (cuBLAS), or ``torch._grouped_mm``.

Each takes the active experts as host ``spans`` ``[(expert, first row, end row)]`` computed beforehand, so the
baselines pay no host sync (ours does one).
"""
from __future__ import annotations

import torch

from .formats import E4M3_MAX
from .mxfp4 import mxfp4_dequantize

Spans = list[tuple[int, int, int]]


def active_spans(expert_offsets: torch.Tensor) -> Spans:
    """``[(e, start, end)]`` for every expert with rows, from CSR offsets ``[E + 1]`` (reads them on the host)."""
    bounds = expert_offsets.tolist()
    return [(e, a, b) for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]


def tensorwise_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[...]`` -> ``(e4m3 [...], fp32 scale [])``, scale = amax / 448."""
    scale = (w.float().abs().amax() / E4M3_MAX).clamp(min=1e-30)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def offline_fp8_experts(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The offline FP8 copy: ``(w [E, N, K] e4m3, scale [E] fp32)``, built one expert at a time."""
    e, n, kb = scales.shape
    w8 = torch.empty(e, n, kb * 32, dtype=torch.float8_e4m3fn, device=blocks.device)
    s8 = torch.empty(e, dtype=torch.float32, device=blocks.device)
    for i in range(e):
        w8[i], s8[i] = tensorwise_fp8(mxfp4_dequantize(blocks[i], scales[i], torch.float32))
    return w8, s8


def padded_rows(xq: torch.Tensor, spans: Spans, multiple: int = 16) -> tuple[torch.Tensor, Spans, torch.Tensor]:
    """The rows of each active expert moved to a start that is a multiple of ``multiple`` and padded to one:
    ``torch._scaled_mm`` takes FP8 operands whose dims are all multiples of 16, so a per-expert loop runs on such a
    layout (an expert sort that pads its blocks gives it for free). Returns ``(xq_padded, padded spans, rows)``:
    ``rows[i]`` is the padded row of row ``i`` of ``xq`` (``y_padded[rows]`` gives ``y`` back)."""
    padded, rows, at = [], [], 0
    for e, a, b in spans:
        padded.append((e, at, at + b - a))
        rows += range(at, at + b - a)
        at += -(-(b - a) // multiple) * multiple
    index = torch.tensor(rows, dtype=torch.long, device=xq.device)
    xq_padded = xq.new_zeros((max(at, multiple), xq.shape[1]))
    xq_padded[index] = xq[: len(rows)]
    return xq_padded, padded, index


def expert_scales(s8: torch.Tensor) -> list[torch.Tensor]:
    """One 0-d scale tensor per expert, each its own allocation: cuBLASLt refuses an FP8 product whose scale pointer
    sits at an odd offset inside a tensor (``s8[e]``), with CUBLAS_STATUS_NOT_SUPPORTED."""
    return [s8[e].clone() for e in range(s8.shape[0])]


def scaled_mm_loop(xq: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, s8: list[torch.Tensor], spans: Spans,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``torch._scaled_mm`` per active expert: ``xq[M, K]`` e4m3 with scale ``sx[]``, ``w8[E, N, K]`` with the
    scales of :func:`expert_scales`; ``xq`` and ``spans`` as :func:`padded_rows` gives them (each span's start and
    length rounded up to a multiple of 16 rows, the padding rows computed and left in ``y``)."""
    y = torch.empty(xq.shape[0], w8.shape[1], dtype=out_dtype, device=xq.device)
    for e, a, b in spans:
        end = a - (-(b - a) // 16) * 16
        torch._scaled_mm(xq[a:end], w8[e].t(), scale_a=sx, scale_b=s8[e], out_dtype=out_dtype, use_fast_accum=True,
                         out=y[a:end])
    return y


def scaled_grouped_mm(xq: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, s8: torch.Tensor,
                      expert_offsets: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One ``torch._scaled_grouped_mm`` over all experts (rows past ``expert_offsets[-1]`` are not computed); the
    per-tensor scales handed over as the row / column vectors it takes."""
    e, n, _ = w8.shape
    return torch._scaled_grouped_mm(xq, w8.transpose(-2, -1), sx.expand(xq.shape[0]).contiguous(),
                                    s8[:, None].expand(e, n).contiguous(), offs=expert_offsets[1:].int(),
                                    out_dtype=out_dtype, use_fast_accum=True)


def mm_loop(x: torch.Tensor, w: torch.Tensor, spans: Spans) -> torch.Tensor:
    """``torch.mm`` per active expert on dense weights ``w[E, N, K]`` of ``x``'s dtype."""
    y = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for e, a, b in spans:
        torch.mm(x[a:b], w[e].t(), out=y[a:b])
    return y


def grouped_mm(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """One ``torch._grouped_mm`` (bf16) over all experts."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=expert_offsets[1:].int())
