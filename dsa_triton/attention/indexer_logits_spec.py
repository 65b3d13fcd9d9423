"""Registry entry of :func:`~dsa_triton.indexer_logits` (token level), and the random indexer inputs other specs
share (:func:`random_queries`, :func:`random_fp8_rows`, :func:`random_paged_keys`).

Shapes: ``B`` sequences, ``Q`` query rows per sequence, ``L`` keys per sequence, ``P`` page size (0: contiguous
keys), ``H`` heads, ``DK`` head dim.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import indexer_logits, indexer_logits_kernels, indexer_logits_reference
from .formats import fp8_quantize_rows
from .indexer_logits_reference import indexer_logits_torch


def random_queries(T: int, H: int, DK: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 queries ``[T, H, DK]`` and weights ``[T, H]`` with the q scales folded in, as DeepSeek-V3.2
    does; on the generator's device."""
    q8, q_scale = fp8_quantize_rows(torch.randn(T, H, DK, generator=g, device=g.device))
    w = torch.randn(T, H, generator=g, device=g.device) * q_scale * (H * DK) ** -0.5
    return q8, w


def random_fp8_rows(n: int, DK: int, g: torch.Generator, chunk: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random FP8 key rows ``[n, DK]`` and their scales ``[n]`` on the generator's device, made
    ``chunk`` rows at a time (bounded temporaries at 8M keys)."""
    k8 = torch.empty(n, DK, dtype=torch.float8_e4m3fn, device=g.device)
    scale = torch.empty(n, dtype=torch.float32, device=g.device)
    for r in range(0, n, chunk):
        k8[r:r + chunk], scale[r:r + chunk] = fp8_quantize_rows(
            torch.randn(min(chunk, n - r), DK, generator=g, device=g.device, dtype=torch.bfloat16))
    return k8, scale


def random_paged_keys(B: int, L: int, P: int, DK: int, g: torch.Generator, spare_pages: int = 1):
    """A poisoned FP8 K cache ``(k, k_scale, block_table, seq_lens)`` holding ``L`` random keys for each
    of ``B`` sequences on shuffled pages (every slot no sequence owns is NaN)."""
    device = g.device
    pages_per_seq = cdiv(L, P)
    num_pages = B * pages_per_seq + spare_pages
    k8, scale = random_fp8_rows(num_pages * P, DK, g)
    k, k_scale = k8.view(num_pages, P, DK), scale.view(num_pages, P)
    table = torch.randperm(num_pages, generator=g, device=device)[: B * pages_per_seq].view(B, pages_per_seq).int()
    unused = torch.ones(num_pages * P, dtype=torch.bool, device=device)
    pos = torch.arange(L, device=device)
    unused[(table.long()[:, pos // P] * P + pos % P).reshape(-1)] = False
    k.view(-1, DK).view(torch.uint8)[unused] = 0x7F  # e4m3 NaN
    k_scale.view(-1)[unused] = float("nan")
    return k, k_scale, table, torch.full((B,), L, dtype=torch.int32, device=device)


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    B, Q, L, P, H, DK = (shape[n] for n in ("B", "Q", "L", "P", "H", "DK"))
    q, w = random_queries(B * Q, H, DK, g)
    # row j of a sequence's Q rows sees the first L - Q + 1 + j keys (causal, the last chunk of a prefill)
    limits = (L - Q + 1 + torch.arange(Q, device=device)).clamp_min(0).repeat(B).int()
    cu = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=device)
    inputs = {"q": q, "weights": w, "limits": limits, "cu_seqlens_q": cu, "num_cols": L, "max_q": Q}
    if P:
        inputs["k"], inputs["k_scale"], inputs["block_table"], inputs["seq_lens"] = random_paged_keys(B, L, P, DK, g)
    else:
        inputs["k"], inputs["k_scale"] = random_fp8_rows(B * L, DK, g)
        inputs["key_starts"] = torch.arange(0, B * L, L, dtype=torch.int32, device=device)
    return inputs


def _call_args(inputs: dict) -> tuple[tuple, dict]:
    kw = {n: inputs[n] for n in ("cu_seqlens_q", "block_table", "seq_lens", "key_starts", "num_cols") if n in inputs}
    return (inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"], inputs["limits"]), kw


def _run(inputs: dict, config: dict) -> torch.Tensor:
    """The kernel as a decode loop calls it: sizes given, value checks off (the inputs are valid)."""
    args, kw = _call_args(inputs)
    return indexer_logits.indexer_logits(*args, **kw, max_q=inputs["max_q"], check_values=False, config=config)


def _reference(inputs: dict, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    args, kw = _call_args(inputs)
    kw.pop("seq_lens", None)
    return indexer_logits_torch(*args, kw.pop("num_cols"), **kw, compute_dtype=compute_dtype)


def compare_logits(out: torch.Tensor, ref: torch.Tensor, rtol: float = 2e-3) -> str | None:
    """Same shape, ``-inf`` at the same places, no NaN, finite values within ``rtol`` of the row's scale."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if out.numel() == 0:
        return None
    if bool(out.isnan().any()):
        return f"{int(out.isnan().sum())} NaN in the output"
    if not torch.equal(out.isneginf(), ref.isneginf()):
        return f"-inf at {int((out.isneginf() != ref.isneginf()).sum())} places that differ from the reference"
    finite = ref.isfinite()
    scale = ref.where(finite, 0.0).abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    err = ((out - ref).where(finite, 0.0).abs() / scale).max().item() if out.numel() else 0.0
    return None if err <= rtol else f"max error {err:.2e} of the row scale (tolerance {rtol:.0e})"


def _cost(phase: str, shape) -> Cost:
    B, Q, L, H, DK = (shape[n] for n in ("B", "Q", "L", "H", "DK"))
    T = B * Q
    pairs = B * sum(max(0, L - Q + 1 + j) for j in range(Q))  # valid (row, key) pairs
    key_bytes = B * L * (DK + 4)
    return Cost(bytes=key_bytes + T * H * (DK + 4) + T * L * 4, flops=2.0 * pairs * H * DK, flop_dtype="fp8")


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        if phase == "decode":
            return [{"B": 64, "Q": 1, "L": 131072, "P": 64, "H": 64, "DK": 128},
                    {"B": 64, "Q": 2, "L": 131072, "P": 64, "H": 64, "DK": 128}]
        return [{"B": 1, "Q": 4096, "L": 16384, "P": 0, "H": 64, "DK": 128}]
    if phase == "decode":
        return [{"B": 3, "Q": 2, "L": 70, "P": 16, "H": 8, "DK": 32}]
    return [{"B": 2, "Q": 9, "L": 40, "P": 0, "H": 8, "DK": 32}]


SPEC = registry.register(KernelSpec(
    launch=indexer_logits.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_logits,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=lambda inputs: _reference(inputs, torch.bfloat16),
    baseline_name="torch dequantize + bf16 einsum",
    model_dims=lambda m: [{"P": m.page, "H": m.index_heads, "DK": m.index_dim}],
    count_roles={"B": "batch", "Q": "tokens", "L": "context"},
    source_modules=(indexer_logits_reference, indexer_logits_kernels, indexer_logits, sys.modules[__name__]),
))
