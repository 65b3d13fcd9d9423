"""Registry entries of :func:`~dsa_triton.sparse_attention_decode` and :func:`~dsa_triton.sparse_attention_prefill`,
over a cache in q's dtype (``fp8`` 0) or the FP8 latent cache (``fp8`` 1: 656 bytes a selected token for DSA,
dequantized in the kernel; baseline: gather, dequantize, einsum).

Shapes: decode ``B`` (index rows), ``S`` (tokens sharing one index set), ``H``, ``D``, ``Dv``, ``k``, ``fp8``;
prefill ``T``, ``H``, ``D``, ``Dv``, ``k``, ``fp8``. Problem-only dims (not in the key): ``L`` cache tokens per
sequence (decode) or in the cache (prefill), ``P`` page size, ``logical`` = 1 for logical positions plus a
block table (else physical slots).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import formats, sparse_attention, sparse_attention_kernels
from .formats import fp8_latent_bytes, fp8_latent_quantize
from .sparse_attention import _rows
from .sparse_attention_reference import (gather_einsum, slots_from_indices, sparse_attention_decode_torch,
                                         sparse_attention_prefill_torch)

def random_paged_cache(seqs: int, L: int, P: int, D: int, dtype: torch.dtype, g: torch.Generator):
    """``kv[seqs * pages + 1, P, D]`` on ``g``'s device holding ``seqs`` sequences of ``L`` random rows on shuffled
    pages (page 0 spare), every other slot NaN; ``block_table[seqs, pages]`` int32."""
    pages = cdiv(L, P)
    kv = torch.full((seqs * pages + 1, P, D), float("nan"), dtype=dtype, device=g.device)
    table = (torch.randperm(seqs * pages, generator=g, device=g.device) + 1).view(seqs, pages).to(torch.int32)
    positions = torch.arange(L, device=g.device)
    live = (table.long()[:, positions // P] * P + positions % P).flatten()
    kv.view(-1, D)[live] = torch.randn(live.numel(), D, generator=g, device=g.device).to(dtype)
    return kv, table


def random_fp8_paged_cache(seqs: int, L: int, P: int, D: int, d_v: int, g: torch.Generator):
    """:func:`random_paged_cache` as an FP8 latent cache (``d_v`` latent values a row): uint8 ``kv[pages, P, bytes]``
    whose unused slots hold NaN-equivalent bytes (NaN scales and rope values), and the block table."""
    kv, table = random_paged_cache(seqs, L, P, D, torch.float32, g)
    return fp8_latent_quantize(kv, d_v), table


def _make_inputs(phase: str):
    def make_inputs(_phase, shape, device, seed: int) -> dict:
        """Random q and cache rows, generated on ``device``; unused slots (and a spare page 0) NaN. On the CPU some
        rows are padded with -1 (one row of three has no valid index); on the GPU every index is valid."""
        device = torch.device(device)
        g = torch.Generator(device=device).manual_seed(seed)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
        randn = lambda *size: torch.randn(size, generator=g, device=device).to(dtype)
        R, M = _rows(phase, shape)
        k, D, P = shape["k"], shape["D"], shape.get("P", 64)
        L = shape.get("L", 2 * k)
        seqs = R if phase == "decode" else 1
        kv, table = (random_fp8_paged_cache(seqs, L, P, D, shape["Dv"], g) if shape["fp8"] else
                     random_paged_cache(seqs, L, P, D, dtype, g))
        logical = torch.rand(R, L, generator=g, device=device).argsort(dim=1)[:, :k]
        if device.type != "cuda":
            valid = (k * ((torch.arange(R) + 1) % 3)) // 2  # k/2, k, 0, ...
            keep = (torch.arange(k)[None, :] < valid[:, None]) & (torch.rand(R, k, generator=g) > 0.1)
            logical = torch.where(keep, logical, -1)
        slots = slots_from_indices(logical, table if phase == "decode" else table.expand(R, -1), P).to(torch.int32)
        paged = bool(shape.get("logical", 0))
        return {
            "q": randn(R, shape["H"], D) if phase == "prefill" or shape["S"] == 1 else randn(R, shape["S"], shape["H"], D),
            "kv_cache": kv,
            "indices": logical.to(torch.int32) if paged else slots,
            "block_table": table if paged else None,
            "slots": slots,
            "sm_scale": D ** -0.5,
            "d_v": shape["Dv"],
        }
    return make_inputs


def _op_args(inputs: dict) -> tuple:
    return inputs["q"], inputs["kv_cache"], inputs["indices"], inputs["sm_scale"], inputs["d_v"], inputs["block_table"]


def _compare(out, ref) -> str | None:
    """out within ``1e-3 + rtol |ref| + u m`` (bf16: rtol 1e-2, unit roundoff u = 2^-8; fp16: 2e-3, 2^-11), with
    ``m = sum_j p_j |v_j|`` the reference's third output when given: the kernels round the probabilities to the
    cache dtype before the value dot, which moves an output by up to ``u m`` (a row dominated by a few tokens does
    not average it down); lse within 1e-4 abs; -inf exactly where expected."""
    (o, lse), (ro, rlse, *magnitude) = out, ref
    if o.shape != ro.shape or lse.shape != rlse.shape:
        return f"shapes {tuple(o.shape)}, {tuple(lse.shape)} != reference {tuple(ro.shape)}, {tuple(rlse.shape)}"
    rtol, unit = (1e-2, 2.0 ** -8) if o.dtype == torch.bfloat16 else (2e-3, 2.0 ** -11)
    err = (o.float() - ro).abs()
    tol = 1e-3 + rtol * ro.abs() + (unit * magnitude[0] if magnitude else 0.0)
    bad = ~(err <= tol)  # NaN counts as bad
    if bad.any():
        return f"out: {int(bad.sum())} elements off (max abs error {err.nan_to_num(float('inf')).max().item():.3g})"
    empty = rlse == float("-inf")
    if not torch.equal(lse == float("-inf"), empty):
        return "lse: -inf where the reference is finite or the other way round"
    lerr = (lse[~empty] - rlse[~empty]).abs()
    if lerr.numel() and not bool((lerr <= 1e-4).all()):
        return f"lse: max abs error {lerr.nan_to_num(float('inf')).max().item():.3g} > 1e-4"
    return None


def _cost(phase: str):
    def cost(_phase, shape) -> Cost:
        """q and indices read once, each selected row once per index row (prefill: at most the cache once; a row is
        2 D bytes, or its FP8 bytes: 656 for DSA), out and lse written once; FLOPs of the two dots."""
        R, M = _rows(phase, shape)
        k, D, Dv = shape["k"], shape["D"], shape["Dv"]
        rows = R * k if phase == "decode" else min(R * k, shape.get("L", 2 * k))
        row_bytes = fp8_latent_bytes(Dv, D - Dv) if shape["fp8"] else 2 * D
        return Cost(bytes=2 * R * M * D + row_bytes * rows + 4 * R * k + 2 * R * M * Dv + 4 * R * M,
                    flops=2 * R * M * k * (D + Dv), flop_dtype="bf16")
    return cost


def _decode_shapes(_phase, gpu: bool) -> list[dict[str, int]]:
    """DSA dims over both caches on the GPU; on the CPU the FP8 cache also with a latent of two 128-value groups (the
    second partial)."""
    if gpu:
        dsa = {"S": 1, "D": 576, "Dv": 512, "k": 2048, "P": 64, "logical": 0}
        return [{"B": b, "H": h, **dsa, "logical": logical, "fp8": fp8}
                for fp8 in (0, 1) for b, h, logical in ((64, 128, 0), (8, 128, 0), (64, 16, 1))]
    return [{"B": 3, "S": 2, "H": 3, "D": 80, "Dv": 64, "k": 40, "L": 96, "P": 16, "logical": 1, "fp8": 0},
            {"B": 2, "S": 1, "H": 4, "D": 80, "Dv": 64, "k": 32, "P": 16, "logical": 0, "fp8": 0},
            {"B": 3, "S": 2, "H": 3, "D": 224, "Dv": 200, "k": 40, "L": 96, "P": 16, "logical": 1, "fp8": 1},
            {"B": 2, "S": 1, "H": 4, "D": 80, "Dv": 64, "k": 32, "P": 16, "logical": 0, "fp8": 1}]


def _prefill_shapes(_phase, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        # the rows spread over a 128K-token pool (151 MB in bf16): larger than the L2, as a long sequence's cache
        return [{"T": 4096, "H": 128, "D": 576, "Dv": 512, "k": 2048, "L": 131072, "P": 64, "logical": 0, "fp8": fp8}
                for fp8 in (0, 1)]
    return [{"T": 5, "H": 3, "D": 80, "Dv": 64, "k": 24, "L": 64, "P": 16, "logical": 1, "fp8": 0},
            {"T": 5, "H": 3, "D": 152, "Dv": 136, "k": 24, "L": 64, "P": 16, "logical": 1, "fp8": 1}]


def _spec(launch, oracle, shapes) -> KernelSpec:
    phase = launch.phases[0]

    def run(inputs: dict, config: dict):
        op = sparse_attention.sparse_attention_decode if phase == "decode" else sparse_attention.sparse_attention_prefill
        return op(*_op_args(inputs), config=config, check_values=False)

    def baseline(inputs: dict):
        q = inputs["q"]
        return gather_einsum(q.reshape(inputs["slots"].shape[0], -1, q.shape[-1]), inputs["kv_cache"].flatten(0, 1),
                             inputs["slots"], inputs["sm_scale"], inputs["d_v"])

    return registry.register(KernelSpec(
        launch=launch,
        make_inputs=_make_inputs(phase),
        run=run,
        reference=lambda inputs: oracle(*_op_args(inputs), magnitude=True),
        compare=_compare,
        cost=_cost(phase),
        bench_shapes=shapes,
        baseline=baseline,
        baseline_name="torch gather (+ dequantize over the FP8 cache) + einsum (bf16)",
        source_modules=(sparse_attention_kernels, sparse_attention, sys.modules[__name__], formats),
        model_dims=lambda m: [{"H": m.heads, "D": m.qk, "Dv": m.latent, "k": m.index_topk, "fp8": fp8}
                              for fp8 in (0, 1)],
        count_roles={"B": "batch"} if phase == "decode" else {"T": "tokens"},
    ))


DECODE_SPEC = _spec(sparse_attention.DECODE, sparse_attention_decode_torch, _decode_shapes)
PREFILL_SPEC = _spec(sparse_attention.PREFILL, sparse_attention_prefill_torch, _prefill_shapes)
