"""Registry entries of :func:`~dsa_triton.sparse_attention_decode` and :func:`~dsa_triton.sparse_attention_prefill`,
over a cache in q's dtype (``fp8`` 0), the FP8 latent cache (``fp8`` 1: 656 bytes a selected token for DSA) or
MODEL1 FP8 pages (``fp8`` 2: 584 bytes for DeepSeek-V4's 512 values), dequantized in the kernel (baseline: gather,
dequantize, einsum).

Shapes: decode ``B`` (index rows), ``S`` (tokens sharing one index set), ``H``, ``D``, ``Dv``, ``k``, ``fp8``;
prefill ``T``, ``H``, ``D``, ``Dv``, ``k``, ``fp8``; ``k`` counts both index sets. Problem-only dims (not in the
key): ``L`` cache tokens per sequence (decode) or in the cache (prefill), ``P`` page size, ``logical`` = 1 for
logical positions plus a block table (else physical slots); DeepSeek-V4's: ``k2`` the second set's width (of
``k``; 0: none), ``L2`` and ``P2`` its cache's tokens and page size, ``sink`` = 1 for attention sinks,
``lengths`` = 1 for ``topk_length`` and ``extra_topk_length``, ``Dr`` a MODEL1 cache's rope values (default 64).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import formats, sparse_attention, sparse_attention_kernels
from .formats import (MODEL1_ROPE, fp8_latent_bytes, fp8_latent_quantize, model1_bytes, model1_cache,
                      model1_quantize)
from .sparse_attention import _rows
from .sparse_attention_reference import (gather_einsum, length_masked, slots_from_indices,
                                         sparse_attention_decode_torch, sparse_attention_prefill_torch)

V4_ARGS = ("attn_sink", "topk_length", "extra_kv_cache", "extra_indices", "extra_topk_length", "extra_block_table")


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


def random_model1_paged_cache(seqs: int, L: int, P: int, D: int, g: torch.Generator, d_rope: int = MODEL1_ROPE):
    """:func:`random_paged_cache` as MODEL1 FP8 pages (``D - d_rope`` quantized values a token) with FlashMLA's page
    stride (:func:`.formats.model1_cache`): unused tokens hold NaN bytes (scale 0xFF, NaN rope values)."""
    kv, table = random_paged_cache(seqs, L, P, D, torch.float32, g)
    cache = model1_cache(kv.shape[0], P, D - d_rope, d_rope, device=g.device)
    cache.copy_(model1_quantize(kv, d_rope))
    return cache, table


def _random_cache(shape, seqs: int, L: int, P: int, dtype: torch.dtype, g: torch.Generator):
    """The cache of the shape's ``fp8`` kind (and its block table)."""
    D = shape["D"]
    if shape["fp8"] == 2:
        return random_model1_paged_cache(seqs, L, P, D, g, shape.get("Dr", MODEL1_ROPE))
    return random_fp8_paged_cache(seqs, L, P, D, shape["Dv"], g) if shape["fp8"] else \
        random_paged_cache(seqs, L, P, D, dtype, g)


def _index_set(R: int, L: int, k: int, table: torch.Tensor, P: int, decode: bool, logical: bool,
               g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(indices, slots, block_table)`` of ``R`` rows of ``k`` distinct positions below ``L``; on the CPU some
    -1 (one row of three has no valid index), on the GPU every index valid."""
    device = g.device
    positions = torch.rand(R, max(L, k), generator=g, device=device).argsort(dim=1)[:, :k]
    positions = torch.where(positions < L, positions, -1)
    if device.type != "cuda":
        valid = (k * ((torch.arange(R) + 1) % 3)) // 2  # k/2, k, 0, ...
        keep = (torch.arange(k)[None, :] < valid[:, None]) & (torch.rand(R, k, generator=g) > 0.1)
        positions = torch.where(keep, positions, -1)
    slots = slots_from_indices(positions, table if decode else table.expand(R, -1), P).to(torch.int32)
    return (positions.to(torch.int32) if logical else slots), slots, (table if logical else None)


def _make_inputs(phase: str):
    def make_inputs(_phase, shape, device, seed: int) -> dict:
        """Random q and cache rows, generated on ``device``; unused slots (and a spare page 0) NaN. On the CPU some
        rows are padded with -1 (one row of three has no valid index); on the GPU every index is valid. With
        ``k2`` a second index set (``k - k2`` in the first) over its own cache; ``sink``: sinks per head (on the
        CPU +inf, -inf and finite ones); ``lengths``: lengths per row (on the CPU partial, full and 0)."""
        device = torch.device(device)
        g = torch.Generator(device=device).manual_seed(seed)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
        randn = lambda *size: torch.randn(size, generator=g, device=device).to(dtype)  # noqa: E731
        R, M = _rows(phase, shape)
        k2 = shape.get("k2", 0)
        k, D, P = shape["k"] - k2, shape["D"], shape.get("P", 64)
        L = shape.get("L", 2 * k)
        seqs, decode, logical = (R if phase == "decode" else 1), phase == "decode", bool(shape.get("logical", 0))
        kv, table = _random_cache(shape, seqs, L, P, dtype, g)
        indices, slots, block_table = _index_set(R, L, k, table, P, decode, logical, g)
        inputs = {
            "q": randn(R, shape["H"], D) if phase == "prefill" or shape["S"] == 1 else randn(R, shape["S"], shape["H"], D),
            "kv_cache": kv, "indices": indices, "block_table": block_table, "slots": slots,
            "sm_scale": D ** -0.5, "d_v": shape["Dv"],
            **dict.fromkeys(V4_ARGS),
        }
        cpu = device.type != "cuda"
        if k2:
            P2, L2 = shape.get("P2", P), shape.get("L2", 2 * k2)
            kv2, table2 = _random_cache(shape, seqs, L2, P2, dtype, g)
            inputs["extra_kv_cache"] = kv2
            inputs["extra_indices"], inputs["extra_slots"], inputs["extra_block_table"] = _index_set(
                R, L2, k2, table2, P2, decode, logical, g)
        if shape.get("lengths", 0):
            for name, width in (("topk_length", k), ("extra_topk_length", k2)):
                if width:
                    full = torch.full((R,), width, dtype=torch.int32, device=device)
                    partial = torch.randint(0, width + 1, (R,), generator=g, device=device, dtype=torch.int32)
                    inputs[name] = torch.where(torch.arange(R, device=device) % 2 == 0, partial, full) if cpu else full
        if shape.get("sink", 0):
            sink = torch.randn(shape["H"], generator=g, device=device)
            if cpu and shape["H"] >= 3:
                sink[0], sink[1] = float("inf"), float("-inf")
            inputs["attn_sink"] = sink
        return inputs
    return make_inputs


def _op_args(inputs: dict) -> tuple:
    return inputs["q"], inputs["kv_cache"], inputs["indices"], inputs["sm_scale"], inputs["d_v"], inputs["block_table"]


def _v4_args(inputs: dict) -> dict:
    """The DeepSeek-V4 keyword arguments of the inputs (None where off)."""
    return {name: inputs.get(name) for name in V4_ARGS}


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
        2 D bytes, or its FP8 bytes: 656 for DSA, 584 for DeepSeek-V4's MODEL1), out and lse written once; FLOPs of
        the two dots."""
        R, M = _rows(phase, shape)
        k, D, Dv, k2 = shape["k"], shape["D"], shape["Dv"], shape.get("k2", 0)
        sets = [(k - k2, shape.get("L", 2 * (k - k2)))] + ([(k2, shape.get("L2", 2 * k2))] if k2 else [])
        rows = sum(R * width if phase == "decode" else min(R * width, L) for width, L in sets)
        fp8 = shape["fp8"]
        rope = shape.get("Dr", MODEL1_ROPE)
        row_bytes = model1_bytes(D - rope, rope) if fp8 == 2 else fp8_latent_bytes(Dv, D - Dv) if fp8 else 2 * D
        return Cost(bytes=2 * R * M * D + row_bytes * rows + 4 * R * k + 2 * R * M * Dv + 4 * R * M,
                    flops=2 * R * M * k * (D + Dv), flop_dtype="bf16")
    return cost


def _decode_shapes(_phase, gpu: bool) -> list[dict[str, int]]:
    """DSA dims over both caches on the GPU, then DeepSeek-V4's (D = Dv = 512; a window of 128 over pages of 256 and
    512 or 1024 compressed entries over pages of 64, as FlashMLA's MODEL1 tests; sinks and lengths) over bf16 and
    MODEL1 caches; on the CPU V4-style rows of odd sizes first (96 = 64 quantized + ``Dr`` = 32 rope values), then
    the DSA split in small, the FP8 cache also with a latent of two 128-value groups (the second partial), last (the
    bench reports take the last CPU shape)."""
    if gpu:
        dsa = {"S": 1, "D": 576, "Dv": 512, "k": 2048, "P": 64, "logical": 0}
        v4 = {"S": 1, "D": 512, "Dv": 512, "P": 256, "P2": 64, "L": 1024, "L2": 16384, "logical": 0, "sink": 1,
              "lengths": 1}
        return ([{"B": b, "H": h, **dsa, "logical": logical, "fp8": fp8}
                 for fp8 in (0, 1) for b, h, logical in ((64, 128, 0), (8, 128, 0), (64, 16, 1))]
                + [{"B": b, "H": h, **v4, "k": 128 + k2, "k2": k2, "fp8": fp8}
                   for fp8 in (0, 2) for b, h, k2 in ((64, 64, 512), (64, 128, 1024), (8, 128, 1024))])
    v4 = {"D": 96, "Dv": 96, "Dr": 32, "L": 40, "L2": 30, "P": 16, "P2": 4, "sink": 1, "lengths": 1}
    return [{"B": 3, "S": 2, "H": 5, **v4, "k": 7 + 13, "k2": 13, "logical": 1, "fp8": 0},
            {"B": 2, "S": 1, "H": 3, **v4, "k": 9 + 11, "k2": 11, "logical": 0, "fp8": 2},
            {"B": 3, "S": 2, "H": 3, "D": 80, "Dv": 64, "k": 40, "L": 96, "P": 16, "logical": 1, "fp8": 0},
            {"B": 2, "S": 1, "H": 4, "D": 80, "Dv": 64, "k": 32, "P": 16, "logical": 0, "fp8": 0},
            {"B": 3, "S": 2, "H": 3, "D": 224, "Dv": 200, "k": 40, "L": 96, "P": 16, "logical": 1, "fp8": 1},
            {"B": 2, "S": 1, "H": 4, "D": 80, "Dv": 64, "k": 32, "P": 16, "logical": 0, "fp8": 1}]


def _prefill_shapes(_phase, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        # the rows spread over a 128K-token pool (151 MB in bf16): larger than the L2, as a long sequence's cache
        v4 = {"T": 4096, "D": 512, "Dv": 512, "L": 131072, "L2": 32768, "P": 256, "P2": 64, "logical": 0, "sink": 1,
              "lengths": 1}
        return ([{"T": 4096, "H": 128, "D": 576, "Dv": 512, "k": 2048, "L": 131072, "P": 64, "logical": 0,
                  "fp8": fp8} for fp8 in (0, 1)]
                + [{"H": h, **v4, "k": 128 + k2, "k2": k2, "fp8": fp8}
                   for fp8 in (0, 2) for h, k2 in ((64, 512), (128, 1024))])
    v4 = {"T": 5, "H": 3, "D": 96, "Dv": 96, "Dr": 32, "L": 64, "L2": 20, "P": 16, "P2": 4, "logical": 1,
          "sink": 1, "lengths": 1}
    return [{**v4, "k": 7 + 10, "k2": 10, "fp8": 0},
            {**v4, "k": 7 + 10, "k2": 10, "fp8": 2},
            {"T": 5, "H": 3, "D": 80, "Dv": 64, "k": 24, "L": 64, "P": 16, "logical": 1, "fp8": 0},
            {"T": 5, "H": 3, "D": 152, "Dv": 136, "k": 24, "L": 64, "P": 16, "logical": 1, "fp8": 1}]


def _model_dims(m) -> list[dict]:
    """DeepSeek-V3.2: the latent rows and ``index_topk`` over both caches. DeepSeek-V4: per attention layer type its
    window and compressed entries (:meth:`~dsa_triton.model_dims.ModelDims.attention_index_sets`) with sinks and
    lengths, over bf16 rows and MODEL1 pages. The page size is the model's (its first cache's), which also keeps a
    DeepSeek-V3.2-like model off the DeepSeek-V4 bench shapes (pages of 256) where the other dims tie."""
    if not m.v4:
        return [{"H": m.heads, "D": m.qk, "Dv": m.latent, "k": m.index_topk, "P": m.page, "fp8": fp8}
                for fp8 in (0, m.kv_fp8)]
    return [{"H": m.heads, "D": m.qk, "Dv": m.latent, "k": window + k2, "k2": k2, "sink": 1, "lengths": 1,
             "P": m.page, "fp8": fp8} for window, k2 in m.attention_index_sets() for fp8 in (0, m.kv_fp8)]


def _spec(launch, oracle, shapes) -> KernelSpec:
    phase = launch.phases[0]

    def run(inputs: dict, config: dict):
        op = sparse_attention.sparse_attention_decode if phase == "decode" else sparse_attention.sparse_attention_prefill
        return op(*_op_args(inputs), config=config, check_values=False, **_v4_args(inputs))

    def baseline(inputs: dict):
        q, slots = inputs["q"], inputs["slots"]
        extra = {}
        if inputs.get("extra_kv_cache") is not None:
            extra = {"extra_kv": inputs["extra_kv_cache"],
                     "extra_slots": length_masked(inputs["extra_slots"], inputs.get("extra_topk_length"))}
        return gather_einsum(q.reshape(slots.shape[0], -1, q.shape[-1]), inputs["kv_cache"],
                             length_masked(slots, inputs.get("topk_length")), inputs["sm_scale"], inputs["d_v"],
                             attn_sink=inputs.get("attn_sink"), **extra)

    return registry.register(KernelSpec(
        launch=launch,
        make_inputs=_make_inputs(phase),
        run=run,
        reference=lambda inputs: oracle(*_op_args(inputs), magnitude=True, **_v4_args(inputs)),
        compare=_compare,
        cost=_cost(phase),
        bench_shapes=shapes,
        baseline=baseline,
        baseline_name="torch gather (+ dequantize over an FP8 cache) + einsum (bf16)",
        source_modules=(sparse_attention_kernels, sparse_attention, sys.modules[__name__], formats),
        model_dims=_model_dims,
        count_roles={"B": "batch"} if phase == "decode" else {"T": "tokens"},
    ))


DECODE_SPEC = _spec(sparse_attention.DECODE, sparse_attention_decode_torch, _decode_shapes)
PREFILL_SPEC = _spec(sparse_attention.PREFILL, sparse_attention_prefill_torch, _prefill_shapes)
