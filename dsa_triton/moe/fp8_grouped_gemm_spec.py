"""Registry entry of the prefill grouped GEMM (``moe_workspace_gemm``): config space, the routes' knobs, defaults,
inputs, cost and the cuBLAS FP8 baseline.

Config space: tiles ``BLOCK_M`` x ``BLOCK_N`` x ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages``; the route
(``IN_REGISTERS``) and each route's own knobs (:data:`REGISTERS_ROUTE_KNOBS`, :data:`WORKSPACE_ROUTE_KNOBS`,
neutral on the other route); ``EXPERTS_PER_STAGE`` experts per workspace stage. Shape: ``M`` routed rows
(bucketed), ``E`` experts, ``N`` output columns, ``K`` (exact).
"""
from __future__ import annotations

import importlib
import sys
import weakref

import torch

from .. import registry
from ..registry import Cost, bucket
from . import fp8_grouped_gemm_baselines, fp8_grouped_gemm_kernels, fp8_grouped_gemm_reference
from .fp8_grouped_gemm_reference import fp8_grouped_gemm_torch
from .fused_moe import ExpertWeights
from .fused_moe_spec import compare_rows

op = importlib.import_module(f"{__package__}.fp8_grouped_gemm")  # the module (the package's attribute is the op)

SPACE = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (32, 64, 128, 256),
    "BLOCK_K": (64, 128),  # divides the 128-k scale group
    "GROUP_M": (1, 4, 8, 16),
    "num_warps": (4, 8),
    # 1: no software pipelining, the registers route's wgmmas back to back on sm_90 (2-4 stages serialize them:
    # ptxas advisory C7515); measured slower than 3 stages: the lost prefetch costs more than the serialization
    "num_stages": (1, 2, 3, 4, 5),
    "EXPERTS_PER_STAGE": (1, 2, 4, 8, 16, 32),  # workspace route
    "IN_REGISTERS": (0, 1),  # 1: the registers route (experts it cannot take still go through the workspace)
    # workspace route: 1 converts the experts that fit against their rows' references (one scale per row) and
    # runs a plain FP8 GEMM (no per-group rescaling in the k loop)
    "ROW_SCALED": (0, 1),
    # workspace route: 1 converts the next stage on a side stream while the GEMM of this one runs, 0 both on one
    # stream (which is faster depends on the matrix: a choice to tune, not a rule)
    "OVERLAP": (0, 1),
    # registers route: converted weights as the shared-memory MMA operand (faster on 8-warp and 256-wide tiles,
    # about even on 64 x 128 / 4 warps)
    "W_SMEM": (0, 1),
    # registers route: k loop unrolled twice, its wgmmas back to back at any num_stages (sm_90 SASS); costs
    # registers (64 x 128 / 4 warps: 235 instead of 166, 2 programs per SM instead of 3)
    "UNROLL": (1, 2),
}
WORKSPACE_LIMIT = 4 * 2**30  # bytes of two stages of FP8 experts
REGISTERS_ROUTE_KNOBS = {"W_SMEM": 0, "UNROLL": 1}  # the registers route's own knobs, at their workspace-route values
WORKSPACE_ROUTE_KNOBS = {"ROW_SCALED": 0, "OVERLAP": 1}  # the workspace route's own knobs, at registers-route values


def route_config(config: dict, in_registers: int, row_scaled: int = 0) -> dict:
    """``config`` for one route: ``IN_REGISTERS`` set (and ``ROW_SCALED`` on the workspace route; the registers
    route has no such choice, so ``row_scaled`` must then be 0), the other route's own knobs neutral."""
    if in_registers and row_scaled:
        raise ValueError("row_scaled is a choice of the workspace route (in_registers=0)")
    if in_registers:
        return {**config, "IN_REGISTERS": 1, **WORKSPACE_ROUTE_KNOBS}
    return {**config, "IN_REGISTERS": 0, **REGISTERS_ROUTE_KNOBS, "ROW_SCALED": row_scaled}


def _constraint(config, shape) -> str | None:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if config["IN_REGISTERS"] and bk != 128:
        return "the registers route steps through K by 128-k groups (BLOCK_K=128)"
    if not config["IN_REGISTERS"] and any(config[k] != v for k, v in REGISTERS_ROUTE_KNOBS.items()):
        return f"{', '.join(REGISTERS_ROUTE_KNOBS)} are choices of the registers route"
    if config["IN_REGISTERS"] and any(config[k] != v for k, v in WORKSPACE_ROUTE_KNOBS.items()):
        return f"{', '.join(WORKSPACE_ROUTE_KNOBS)} are choices of the workspace route"
    if config["num_stages"] * config["UNROLL"] * (bm + bn) * bk > 200 * 1024:
        return "x and w tiles of all pipeline stages (twice unrolled: twice as many) exceed 200 KB of shared memory"
    if bm * bn > 128 * 32 * config["num_warps"]:
        return "accumulator over 128 fp32 registers per thread"
    if bm > max(16, bucket(shape["M"])):
        return "BLOCK_M exceeds the routed rows"
    if config["EXPERTS_PER_STAGE"] > bucket(shape["E"]):
        return "a stage larger than the expert count"
    if 2 * config["EXPERTS_PER_STAGE"] * shape["N"] * shape["K"] > WORKSPACE_LIMIT:
        return "workspace (two stages of FP8 experts) over 4 GiB"
    return None


REGISTERS_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
WORKSPACE_TILE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def _default(phase, shape):
    """The registers route up to 256 routed rows per expert: 128 x 128 tiles and 4 warps from 128 rows per expert,
    64 x 128 below (fewer wasted rows in an expert's last tile). Above 256 rows per expert the row-scaled workspace
    route with :data:`WORKSPACE_TILE`: there the GEMM's tensor-core time outweighs the conversion's round trip
    through memory. (The measurements behind these bounds: results/.)"""
    rows_tile = max(16, bucket(shape["M"]))  # the constraint's bound on BLOCK_M (few routed rows)
    if shape["M"] * shape["N"] * shape["K"] < 2**24:  # interpreter-sized: few programs, still two stages
        return route_config({"BLOCK_M": min(32, rows_tile), "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
                             "num_warps": 4, "num_stages": 2, "EXPERTS_PER_STAGE": min(2, bucket(shape["E"])),
                             **REGISTERS_ROUTE_KNOBS}, 1)
    stage = min(8, bucket(shape["E"]))
    while stage > 1 and 2 * stage * shape["N"] * shape["K"] > WORKSPACE_LIMIT:  # the constraint's bound
        stage //= 2
    rows_per_expert = shape["M"] / max(1, shape["E"])
    config = route_config({**REGISTERS_TILE, **REGISTERS_ROUTE_KNOBS, "EXPERTS_PER_STAGE": stage,
                           "BLOCK_M": min(128 if rows_per_expert >= 128 else 64, rows_tile)}, 1)
    if rows_per_expert > 256:
        config = {**route_config(config, 0, row_scaled=1), **WORKSPACE_TILE}
    return config


def _bench_shapes(phase, gpu):
    if gpu:  # DeepSeek-V3.2, T = 4096 routed top-8 over 256 experts: gate_up and down
        return [{"M": 4096 * 8, "E": 256, "N": 4096, "K": 7168}, {"M": 4096 * 8, "E": 256, "N": 7168, "K": 2048}]
    return [{"M": 40, "E": 5, "N": 48, "K": 96}]


def random_offsets(rows: int, experts: int, device, gen: torch.Generator) -> torch.Tensor:
    """CSR offsets ``[E + 1]`` int32 of ``rows`` routed uniformly at random over ``experts``."""
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=gen, device=device), minlength=experts)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


_fp8_copies: "weakref.WeakKeyDictionary[ExpertWeights, tuple]" = weakref.WeakKeyDictionary()


def _make_inputs(phase, shape, device, seed):
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    offsets = random_offsets(shape["M"], shape["E"], device, gen)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # no bf16 tl.dot in the interpreter
    x = torch.randn(shape["M"], shape["K"], generator=gen, device=device).to(dtype)
    return {"x": x, "offsets": offsets, "weights": ExpertWeights.random(shape["E"], shape["N"], shape["K"], device),
            "spans": fp8_grouped_gemm_baselines.active_spans(offsets)}


def _run(inputs, config):
    """As the MoE layer calls it: offsets unchecked (the registers route then plans on the device: no host sync,
    so the tuner and the bench time it in CUDA graphs; the workspace routes still sync)."""
    w = inputs["weights"]
    return op.fp8_grouped_gemm(inputs["x"], inputs["offsets"], w.blocks, w.scales, config=config, check_values=False)


def _reference(inputs):
    w = inputs["weights"]
    return fp8_grouped_gemm_torch(inputs["x"], inputs["offsets"], w.blocks, w.scales)


def _baseline(inputs):
    """cuBLAS FP8 on an offline FP8 copy of every expert (per-tensor scales; x quantized beforehand, untimed)."""
    w, x = inputs["weights"], inputs["x"]
    if w not in _fp8_copies:
        _fp8_copies[w] = fp8_grouped_gemm_baselines.offline_fp8_experts(w.blocks, w.scales)
    if "xq" not in inputs:
        inputs["xq"] = fp8_grouped_gemm_baselines.tensorwise_fp8(x)
    if x.is_cuda:  # one cuBLAS grouped call: faster than the per-expert loop at the bench shapes (moe_prefill report)
        return fp8_grouped_gemm_baselines.scaled_grouped_mm(*inputs["xq"], *_fp8_copies[w], inputs["offsets"])
    xq, sx = inputs["xq"]
    xq_pad, pad, rows = fp8_grouped_gemm_baselines.padded_rows(xq, inputs["spans"])
    w8, s8 = _fp8_copies[w]
    return fp8_grouped_gemm_baselines.scaled_mm_loop(xq_pad, sx, w8, fp8_grouped_gemm_baselines.expert_scales(s8),
                                                     pad)[rows]


def _cost(phase, shape) -> Cost:
    """Floor: the MXFP4 bytes of every expert (all get rows at these sizes), x read once, y written once."""
    m, e, n, k = shape["M"], shape["E"], shape["N"], shape["K"]
    return Cost(bytes=e * n * k * 17 / 32 + m * k * 2 + m * n * 2, flops=2.0 * m * n * k, flop_dtype="fp8")


SPEC = registry.register(registry.KernelSpec(
    name="moe_workspace_gemm",
    phases=("prefill",),
    space=SPACE,
    default=_default,
    fixed_dims=("E", "N", "K"),
    bucketed_dims=("M",),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_rows,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=_baseline,
    baseline_name="torch._scaled_grouped_mm (CPU: _scaled_mm per expert) on an offline FP8 copy, per-tensor scales",
    source_modules=(op, fp8_grouped_gemm_kernels, sys.modules[__name__], fp8_grouped_gemm_reference,
                    fp8_grouped_gemm_baselines),
))
