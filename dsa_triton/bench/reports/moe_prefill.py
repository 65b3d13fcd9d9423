"""Report ``moe_prefill``: the workspace path (online MXFP4 -> FP8 + FP8 GEMM) against torch on weights
converted ahead of time, the overlap of conversion and GEMM, and memory.

Per GEMM (gate_up: N = 2 x 2048, K = 7168; down: N = 7168, K = 2048) and routed token count T (E = 256 experts,
top-8, random routing, trained-layer-like MXFP4 scales) one row:

- ``ours_us``: :func:`fp8_grouped_gemm` end to end with its default config, called as the MoE layer calls it
  (``check_values=False``: on the registers route with fitting weights the tiles are planned on the device, no
  host sync; the workspace routes read the offsets on the host), x quantized, then the route the config names;
  ``checked_us``: the same with the offsets checked on the host (the op's default: one sync a call, the GPU idle
  while the host plans); ``ours_graph_us`` / ``fp8_graph_us``: ours and ``torch._scaled_grouped_mm`` replayed
  from CUDA graphs (NaN where ours syncs), ``vs_fp8_graph`` their ratio; ``quantize_us``: the activation
  quantization alone (in the k order the config's route reads);
- ``registers_us``: the registers route (weights converted on their way to the tensor cores, no workspace;
  unchecked, as ours);
- ``workspace_us``: the workspace route end to end (the config's when it names that route, else the row-scaled
  workspace route with :data:`.fp8_grouped_gemm.WORKSPACE_TILE`; the registers route likewise with
  ``REGISTERS_TILE``); its stages' conversions alone (``convert_us``), GEMMs alone
  (``gemm_us``), both on one stream (``serial_us``) and with conversions on the side stream (``pipelined_us``);
  ``hidden`` = (serial - pipelined) / min(convert, gemm), the part of the shorter one the overlap hides;
- ``fp8_us``: the faster of ``torch._scaled_mm`` per active expert and ``torch._scaled_grouped_mm`` on an
  offline FP8 copy (x quantized beforehand and, for the loop, each expert's rows padded to a multiple of 16 as
  ``_scaled_mm`` needs, untimed), each checked against the bf16 product first (a failing baseline fails the row);
  ``vs_fp8`` = fp8_us / ours_us (target >= 0.8, goal 0.9);
- ``bf16_us``: the faster of cuBLAS ``torch.mm`` per active expert and ``torch._grouped_mm`` on a bf16 copy;
  ``vs_bf16`` = bf16_us / ours_us (target > 1);
- ``of_floor``: the registry's floor of ``fp8_grouped_gemm`` (the MXFP4 bytes of every expert, x and y at copy
  speed, or the FLOPs at the measured FP8 rate, whichever is longer) over ours_us;
- memory: the workspace a call leases on each route, the shared workspace, the peak allocated during our call
  (and above what was allocated before it), and the offline FP8 and bf16 copies of every expert of this matrix
  over all MoE layers;
- ``rel_err``: ||ours - bf16 baseline|| / ||bf16 baseline|| (FP8 activations: about 2-3 %); the same for each
  route (``rel_err_workspace``, ``rel_err_registers``: both accumulate in the tensor cores over the whole of K
  when row-scaled or in registers).

On the CPU (no ceilings) the same rows on tiny shapes in the interpreter (E = 5, K = 96 / 64, N = 48 / 40),
without the grouped torch GEMMs (CUDA only); times there only show that every path runs.
"""
from __future__ import annotations

import json
import math
import time

import torch

from dsa_triton.bench.harness import error_text, floor_us, graph_time_or_nan, time_us
from dsa_triton.moe.fp8_grouped_gemm import fp8_grouped_gemm, interleaves, prefill_call, quantize_activations_fp8
from dsa_triton.moe.fp8_grouped_gemm_baselines import (active_spans, grouped_mm, mm_loop, offline_fp8_experts,
                                                       expert_scales, padded_rows, scaled_grouped_mm, scaled_mm_loop,
                                                       tensorwise_fp8)
from dsa_triton.moe.fp8_grouped_gemm import REGISTERS_TILE, WORKSPACE_TILE, route_config
from dsa_triton.moe.fp8_grouped_gemm_spec import SPEC
from dsa_triton.moe.sort_and_align_spec import random_routing
from dsa_triton.moe.mxfp4 import mxfp4_dequantize
from dsa_triton.moe.mxfp4_spec import realistic_mxfp4
from dsa_triton.moe.workspace import shared_workspace

MOE_LAYERS = 58  # DeepSeek-V3.2: 61 layers, the first 3 dense
GPU_CASES = [(name, t, n, k) for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)) for t in (4096, 16384)]
CPU_CASES = [("gate_up", 20, 48, 96), ("down", 20, 40, 64)]


def _timed(fn, device) -> float:
    """Median microseconds (one call on the CPU, where only the code path matters)."""
    if device.type == "cuda":
        return time_us(fn, device)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def _nanmin(*xs: float) -> float:
    finite = [x for x in xs if x == x]
    return min(finite) if finite else math.nan


def _baseline(name: str, fn, expected: torch.Tensor, device, errors: list[str], rows=None) -> float:
    """Median microseconds of a baseline after checking its output (its ``rows``, when given) against ``expected``;
    a baseline that fails or differs adds its error to ``errors`` (the row fails, naming it) and returns NaN."""
    try:
        out = fn() if rows is None else fn()[rows]
        out = out.float()
        err = float((out - expected).norm() / expected.norm())
        if not err < 0.1:
            errors.append(f"baseline {name} differs from the bf16 product: relative error {err:.3g}")
            return math.nan
        return _timed(fn, device)
    except Exception as exc:  # the row fails with the baseline's error: never a silent NaN
        errors.append(error_text(exc, f"baseline {name} failed: "))
        return math.nan


def routed_rows(tokens: int, experts: int, top_k: int, k: int, device: torch.device, seed: int,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets int32 [E + 1], x [T * top_k, K] in dtype)``: T tokens routed to top_k distinct experts each,
    uniformly (CSR row offsets per expert), and random rows, from one generator seeded ``seed``."""
    gen = torch.Generator(device).manual_seed(seed)
    _, ids = random_routing(tokens, experts, top_k, device, gen)
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
    return offsets, torch.randn(tokens * top_k, k, generator=gen, device=device).to(dtype)


def case_row(name: str, experts: int, top_k: int, tokens: int, n: int, k: int, device: torch.device,
             ceilings) -> dict:
    m = tokens * top_k
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    offsets, x = routed_rows(tokens, experts, top_k, k, device, tokens + n, dtype)
    blocks, scales = realistic_mxfp4((experts, n), k, device, seed=1, outliers=0.0)
    spans = active_spans(offsets)
    shape = {"M": m, "E": experts, "N": n, "K": k}
    config = SPEC.launch_config("prefill", shape, device)
    # each route with the config's tile when the config names that route, else that route's default tile (if valid)
    other = 0 if config["IN_REGISTERS"] else 1
    routes = {1 - other: config, other: route_config(config, other, row_scaled=1 - other)}
    with_tile = {**routes[other], **(REGISTERS_TILE if other else WORKSPACE_TILE)}
    routes[other] = with_tile if SPEC.is_valid(with_tile, shape) else {**routes[other], "BLOCK_K": 128}
    cuda = device.type == "cuda"

    # ours first, so the peak memory is that of the MXFP4 weights, x, y and the workspace only
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    ours = fp8_grouped_gemm(x, offsets, blocks, scales, check_values=False)
    peak = torch.cuda.max_memory_allocated(device) if cuda else math.nan
    ours_us = _timed(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, check_values=False), device)
    checked_us = _timed(lambda: fp8_grouped_gemm(x, offsets, blocks, scales), device)
    ours_graph_us = graph_time_or_nan(lambda _: fp8_grouped_gemm(x, offsets, blocks, scales, check_values=False),
                                      [None], device)
    in_registers_order = bool(config["IN_REGISTERS"]) and interleaves(k, k // 32)
    quantize_us = _timed(lambda: quantize_activations_fp8(x, in_registers_order), device)
    route_out = {route: fp8_grouped_gemm(x, offsets, blocks, scales, config=routes[route]) for route in (0, 1)}
    registers_us = _timed(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, config=routes[1], check_values=False),
                          device)
    workspace_us = _timed(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, config=routes[0]), device)
    y = torch.empty_like(ours)
    with prefill_call(x, offsets.tolist(), blocks, scales, y, routes[0]) as run:
        convert_us = _timed(lambda: run(overlap=False, gemm=False), device)
        gemm_us = _timed(lambda: run(overlap=False, convert=False), device)
        serial_us = _timed(lambda: run(overlap=False), device)
        pipelined_us = _timed(lambda: run(overlap=True), device)
        slots = run.leased_slots
    ws = shared_workspace(device, max(1, slots), n, k)  # the process-wide one, as large as any call asked

    dense = mxfp4_dequantize(blocks, scales, dtype)
    expected = mm_loop(x, dense, spans).float()
    errors: list[str] = []
    bf16_loop_us = _baseline("mm_loop", lambda: mm_loop(x, dense, spans), expected, device, errors)
    bf16_grouped_us = _baseline("grouped_mm", lambda: grouped_mm(x, dense, offsets), expected, device,
                                errors) if cuda else math.nan
    del dense
    fp8_loop_us = fp8_grouped_us = fp8_graph_us = math.nan
    if cuda:  # torch's FP8 GEMMs are CUDA ops
        w8, s8 = offline_fp8_experts(blocks, scales)
        xq, sx = tensorwise_fp8(x)
        xq_pad, pad, rows = padded_rows(xq, spans)
        each = expert_scales(s8)
        fp8_loop_us = _baseline("scaled_mm_loop", lambda: scaled_mm_loop(xq_pad, sx, w8, each, pad), expected,
                                device, errors, rows)
        fp8_grouped_us = _baseline("scaled_grouped_mm", lambda: scaled_grouped_mm(xq, sx, w8, s8, offsets),
                                   expected, device, errors)
        fp8_graph_us = graph_time_or_nan(lambda _: scaled_grouped_mm(xq, sx, w8, s8, offsets), [None], device)
        del w8, s8, each, xq, sx, xq_pad
    rel_err, rel_err_workspace, rel_err_registers = (float((y.float() - expected).norm() / expected.norm())
                                                     for y in (ours, route_out[0], route_out[1]))
    del route_out

    fp8_us, bf16_us = _nanmin(fp8_loop_us, fp8_grouped_us), _nanmin(bf16_loop_us, bf16_grouped_us)
    memory = ws.report(experts, [(n, k)], MOE_LAYERS)
    slot_bytes = ws.nbytes // ws.slots
    row = {
        "gemm": name, "T": tokens, "M": m, "E": experts, "N": n, "K": k, "active_experts": len(spans),
        "config": json.dumps(config),
        "ours_us": ours_us, "ours_tflops": 2.0 * m * n * k / (ours_us * 1e-6) / 1e12, "checked_us": checked_us,
        "ours_graph_us": ours_graph_us, "fp8_graph_us": fp8_graph_us, "vs_fp8_graph": fp8_graph_us / ours_graph_us,
        "quantize_us": quantize_us,
        "registers_us": registers_us, "workspace_us": workspace_us,
        "convert_us": convert_us, "gemm_us": gemm_us, "serial_us": serial_us, "pipelined_us": pipelined_us,
        "hidden": (serial_us - pipelined_us) / min(convert_us, gemm_us),
        "scaled_mm_loop_us": fp8_loop_us, "scaled_grouped_mm_us": fp8_grouped_us, "fp8_us": fp8_us,
        "vs_fp8": fp8_us / ours_us,
        "bf16_loop_us": bf16_loop_us, "bf16_grouped_us": bf16_grouped_us, "bf16_us": bf16_us,
        "vs_bf16": bf16_us / ours_us,
        "workspace_bytes_registers_route": 0, "workspace_bytes_workspace_route": slots * slot_bytes,
        "shared_workspace_bytes": memory["workspace_bytes"],
        "peak_allocated_bytes": peak, "peak_over_before_bytes": peak - before,
        "offline_fp8_all_layers_bytes": memory["offline_fp8_bytes"], "bf16_all_layers_bytes": memory["bf16_bytes"],
        "mxfp4_all_layers_bytes": memory["mxfp4_bytes"],
        "rel_err": rel_err, "rel_err_workspace": rel_err_workspace, "rel_err_registers": rel_err_registers,
    }
    if ceilings is not None:
        floor, _ = floor_us(SPEC.cost("prefill", shape), ceilings)
        row["of_floor"] = floor / ours_us
    worst = max(rel_err, rel_err_workspace, rel_err_registers)
    if not worst < 0.1:
        errors.append(f"a route differs from the bf16 baseline: relative error {worst:.3g}")
    if errors:
        row["error"] = "; ".join(errors)
    return row


def moe_prefill_report(device, ceilings) -> list[dict]:
    device = torch.device(device)
    if device.type == "cuda":
        return [case_row(name, 256, 8, t, n, k, device, ceilings) for name, t, n, k in GPU_CASES]
    return [case_row(name, 5, 2, t, n, k, device, None) for name, t, n, k in CPU_CASES]
