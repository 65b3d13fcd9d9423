"""Registry entries of sparse paged attention (``sparse_attention_decode``, ``sparse_attention_prefill``), and the
same ops over the FP8 latent cache (``sparse_attention_decode_fp8``, ``sparse_attention_prefill_fp8``: 656 bytes a
selected token for DSA, dequantized in the kernel; baseline: gather, dequantize, einsum).

Config space: ``BLOCK_N`` tokens per gathered tile, ``BLOCK_H`` query rows per program (heads, times the
decode tokens sharing an index set), ``num_splits`` programs per row over the ``k`` selected tokens (merged
by the combine kernel), ``num_warps``, ``num_stages``. The head dim is always split into a value part
(``Dv``: 512) and a rope part (``D - Dv``: 64), two dots into one score tile, so it needs no parameter.

Shapes: decode ``B`` (index rows), ``S`` (tokens sharing one index set), ``H``, ``D``, ``Dv``, ``k``;
prefill ``T``, ``H``, ``D``, ``Dv``, ``k``. Problem-only dims (not in the key): ``L`` cache tokens per
sequence (decode) or in the cache (prefill), ``P`` page size, ``logical`` = 1 for logical positions plus a
block table (else physical slots).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv, next_pow2
from ..registry import Cost, KernelSpec
from . import cache_reference, sparse_attention, sparse_attention_kernels
from .cache_reference import fp8_latent_bytes, fp8_latent_quantize
from .sparse_attention_kernels import head_blocks
from .sparse_attention_reference import (gather_einsum, slots_from_indices, sparse_attention_decode_torch,
                                         sparse_attention_prefill_torch)

SPACE = {
    "BLOCK_N": (16, 32, 64, 128),
    "BLOCK_H": (16, 32, 64, 128),
    "num_splits": (1, 2, 4, 8, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3, 4),
}
SMEM_BYTES = 232448  # Hopper's shared memory per block (227 KiB)
REG_BUDGET = 128  # 32-bit registers per thread for the fp32 accumulator (+ q where mma.sync keeps it in registers)
FALLBACK_SMS = 132  # H200, when no GPU is visible
WGMMA_ROWS = 64  # below this many rows per tile Triton uses mma.sync, with q held in registers
# FP8 cache: registers a thread may spend on the dequantized tile beyond REG_BUDGET. From ptxas on sm_90 compiles of
# the DSA decode shape: ~200 estimated registers spill under 32 bytes, ~244 spill 130-260 bytes, so the line is 208.
FP8_TILE_REGS = 80


def _rows(phase: str, shape) -> tuple[int, int]:
    """(index rows R, query rows per index row M)."""
    return (shape["B"], shape["S"] * shape["H"]) if phase == "decode" else (shape["T"], shape["H"])


def _constraint(phase: str, fp8: bool = False):
    """FP8 cache: the gathered bytes become a tile in q's dtype in registers (``FP8_TILE_REGS`` more a thread) and
    then in shared memory once, while the bytes themselves are what the stages buffer."""
    def constraint(config, shape) -> str | None:
        R, M = _rows(phase, shape)
        k, bh, bn, warps = shape["k"], config["BLOCK_H"], config["BLOCK_N"], config["num_warps"]
        bdv, bdr = head_blocks(shape["D"], shape["Dv"])
        if bh > max(16, next_pow2(M)):
            return f"BLOCK_H={bh} is wider than the {M} query rows"
        if bn > max(16, next_pow2(k)):
            return f"BLOCK_N={bn} is longer than k={k}"
        if config["num_splits"] > cdiv(k, bn):
            return f"num_splits={config['num_splits']} exceeds the {cdiv(k, bn)} tiles of k"
        threads = 32 * warps
        regs = bh * bdv / threads + (bh * (bdv + bdr) / 2 / threads if bh < WGMMA_ROWS else 0)
        if regs > REG_BUDGET:
            return f"accumulator needs ~{regs:.0f} registers per thread (> {REG_BUDGET}): fewer rows or more warps"
        tile = bn * (bdv + bdr) / 2 / threads
        if fp8 and regs + tile > REG_BUDGET + FP8_TILE_REGS:
            return (f"accumulator and dequantized tile need ~{regs + tile:.0f} registers per thread "
                    f"(> {REG_BUDGET + FP8_TILE_REGS}): a shorter token tile")
        smem = 2 * (bh + min(config["num_stages"], 2) * bn) * (bdv + bdr)
        if fp8:
            smem = 2 * (bh + bn) * (bdv + bdr) + min(config["num_stages"], 2) * bn * (bdv + bdr)
        if smem > SMEM_BYTES:
            return f"q tile + KV buffers need ~{smem} bytes of shared memory (> {SMEM_BYTES})"
        return None
    return constraint


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else FALLBACK_SMS


def _default(phase: str, fp8: bool = False):
    """The widest head tile (64 rows: wgmma) whose tiles still fill one wave, else the narrowest (wider tiles that
    leave SMs idle are slower); the longest token tile that fits; then splits over k up to one wave of programs
    (two per SM below 64 rows, where a program needs half the registers)."""
    constraint = _constraint(phase, fp8)

    def default(_phase, shape) -> dict:
        R, M = _rows(phase, shape)
        k, sms = shape["k"], _sm_count()
        top = min(WGMMA_ROWS, max(16, next_pow2(M)))
        fitting = []  # per head tile (widest first): its first valid (warps, token tile)
        for bh in (64, 32, 16):
            candidates = ({"BLOCK_N": bn, "BLOCK_H": bh, "num_splits": 1, "num_warps": w, "num_stages": 2}
                          for w in (4, 8) for bn in (64, 32, 16))
            fitting += [c for c in candidates if bh <= top and constraint(c, shape) is None][:1]
        config = next((c for c in fitting if R * cdiv(M, c["BLOCK_H"]) * cdiv(k, c["BLOCK_N"]) >= sms), fitting[-1])
        programs = R * cdiv(M, config["BLOCK_H"])
        wave = sms * (1 if config["BLOCK_H"] >= WGMMA_ROWS else 2)
        while (config["num_splits"] * 2 <= min(SPACE["num_splits"][-1], cdiv(k, config["BLOCK_N"]))
               and programs * config["num_splits"] * 2 <= wave):
            config["num_splits"] *= 2
        return config
    return default


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


def _make_inputs(phase: str, fp8: bool = False):
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
        kv, table = (random_fp8_paged_cache(seqs, L, P, D, shape["Dv"], g) if fp8 else
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


def _cost(phase: str, fp8: bool = False):
    def cost(_phase, shape) -> Cost:
        """q and indices read once, each selected row once per index row (prefill: at most the cache once; a row is
        2 D bytes, or its FP8 bytes: 656 for DSA), out and lse written once; FLOPs of the two dots."""
        R, M = _rows(phase, shape)
        k, D, Dv = shape["k"], shape["D"], shape["Dv"]
        rows = R * k if phase == "decode" else min(R * k, shape.get("L", 2 * k))
        row_bytes = fp8_latent_bytes(Dv, D - Dv) if fp8 else 2 * D
        return Cost(bytes=2 * R * M * D + row_bytes * rows + 4 * R * k + 2 * R * M * Dv + 4 * R * M,
                    flops=2 * R * M * k * (D + Dv), flop_dtype="bf16")
    return cost


def _decode_shapes(_phase, gpu: bool) -> list[dict[str, int]]:
    dsa = {"S": 1, "D": 576, "Dv": 512, "k": 2048, "P": 64, "logical": 0}
    if gpu:
        return [{"B": 64, "H": 128, **dsa}, {"B": 8, "H": 128, **dsa}, {"B": 64, "H": 16, **dsa, "logical": 1}]
    return [{"B": 3, "S": 2, "H": 3, "D": 80, "Dv": 64, "k": 40, "L": 96, "P": 16, "logical": 1},
            {"B": 2, "S": 1, "H": 4, "D": 80, "Dv": 64, "k": 32, "P": 16, "logical": 0}]


def _prefill_shapes(_phase, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        # the rows spread over a 128K-token pool (151 MB in bf16): larger than the L2, as a long sequence's cache
        return [{"T": 4096, "H": 128, "D": 576, "Dv": 512, "k": 2048, "L": 131072, "P": 64, "logical": 0}]
    return [{"T": 5, "H": 3, "D": 80, "Dv": 64, "k": 24, "L": 64, "P": 16, "logical": 1}]


def _fp8_decode_shapes(phase, gpu: bool) -> list[dict[str, int]]:
    """The bf16 cache's GPU shapes; on the CPU a latent of two 128-value groups (the second partial) too."""
    if gpu:
        return _decode_shapes(phase, gpu)
    return [{"B": 3, "S": 2, "H": 3, "D": 224, "Dv": 200, "k": 40, "L": 96, "P": 16, "logical": 1},
            {"B": 2, "S": 1, "H": 4, "D": 80, "Dv": 64, "k": 32, "P": 16, "logical": 0}]


def _fp8_prefill_shapes(phase, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        return _prefill_shapes(phase, gpu)
    return [{"T": 5, "H": 3, "D": 152, "Dv": 136, "k": 24, "L": 64, "P": 16, "logical": 1}]


def _spec(phase: str, oracle, shapes, fixed: tuple[str, ...], bucketed: tuple[str, ...],
          fp8: bool = False) -> KernelSpec:
    def run(inputs: dict, config: dict):
        op = sparse_attention.sparse_attention_decode if phase == "decode" else sparse_attention.sparse_attention_prefill
        return op(*_op_args(inputs), config=config, check_values=False)

    def baseline(inputs: dict):
        q = inputs["q"]
        return gather_einsum(q.reshape(inputs["slots"].shape[0], -1, q.shape[-1]), inputs["kv_cache"].flatten(0, 1),
                             inputs["slots"], inputs["sm_scale"], inputs["d_v"])

    return registry.register(KernelSpec(
        name=f"sparse_attention_{phase}" + ("_fp8" if fp8 else ""),
        phases=(phase,),
        space=SPACE,
        default=_default(phase, fp8),
        fixed_dims=fixed,
        bucketed_dims=bucketed,
        make_inputs=_make_inputs(phase, fp8),
        run=run,
        reference=lambda inputs: oracle(*_op_args(inputs), magnitude=True),
        compare=_compare,
        cost=_cost(phase, fp8),
        bench_shapes=shapes,
        constraint=_constraint(phase, fp8),
        baseline=baseline,
        baseline_name="torch gather + dequantize + einsum (bf16)" if fp8 else "torch gather + einsum (bf16)",
        source_modules=(sparse_attention_kernels, sparse_attention, sys.modules[__name__])
        + ((cache_reference,) if fp8 else ()),
    ))


DECODE_SPEC = _spec("decode", sparse_attention_decode_torch, _decode_shapes, ("S", "H", "D", "Dv", "k"), ("B",))
PREFILL_SPEC = _spec("prefill", sparse_attention_prefill_torch, _prefill_shapes, ("H", "D", "Dv", "k"), ("T",))
DECODE_FP8_SPEC = _spec("decode", sparse_attention_decode_torch, _fp8_decode_shapes, ("S", "H", "D", "Dv", "k"),
                        ("B",), fp8=True)
PREFILL_FP8_SPEC = _spec("prefill", sparse_attention_prefill_torch, _fp8_prefill_shapes, ("H", "D", "Dv", "k"),
                         ("T",), fp8=True)
