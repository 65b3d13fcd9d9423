"""Report ``moe_decode``: the fused MXFP4 grouped GEMM against the issue's acceptance, measured in one run.

For every ``moe_fused_gemm`` bench shape (GPU: E=256, top-8, gate_up N=4096 K=7168 and down N=7168 K=2048,
T in {1, 8, 32, 128}): the launch config checked against the reference, its median time, the fraction of the
measured copy bandwidth it reaches on the MXFP4 bytes of the experts that actually got rows (4.25 bits per
weight, counted from the routing of the timed input sets), and the speedup over cuBLAS bf16 on
pre-dequantized weights of the same experts, timed on the same input sets. Pass: >= 50% of copy bandwidth
(goal 75%) and >= 2x over bf16.
"""
from __future__ import annotations

import json

import torch

from .. import registry
from ..harness import graph_time_us, rotation, time_rotating
from .fused_moe import SPEC

MIN_COPY_FRACTION, GOAL_COPY_FRACTION, MIN_SPEEDUP = 0.5, 0.75, 2.0


def verdict(fraction: float, speedup: float) -> str:
    if speedup >= MIN_SPEEDUP and fraction >= GOAL_COPY_FRACTION:
        return "goal"
    return "pass" if speedup >= MIN_SPEEDUP and fraction >= MIN_COPY_FRACTION else "fail"


def moe_decode_report(device, ceilings) -> list[dict]:
    device = torch.device(device)
    rows, keep = [], None
    for shape in SPEC.bench_shapes("decode", ceilings is not None):
        check_inputs = SPEC.make_inputs("decode", shape, device, 1234)
        keep = check_inputs["weights"]  # one weight set per (N, K) for all T (freed when the next is made)
        config = SPEC.launch_config("decode", shape, device)
        error = SPEC.compare(SPEC.run(check_inputs, config), SPEC.reference(check_inputs))
        sets = rotation(lambda i: SPEC.make_inputs("decode", shape, device, i), SPEC.cost("decode", shape).bytes, device)
        fused_us = time_rotating(lambda s: SPEC.run(s, config), sets, device)
        bf16_us = time_rotating(SPEC.baseline, sets, device)
        active = sum(len(s["active"]) for s in sets) / len(sets)
        mxfp4_bytes = active * shape["N"] * shape["K"] * 17 / 32
        row = {"gemm": "gate_up" if shape["gather"] else "down", "T": shape["T"], "N": shape["N"], "K": shape["K"],
               "active_experts": active, "mxfp4_MB": mxfp4_bytes / 1e6, "fused_us": fused_us, "bf16_us": bf16_us,
               "speedup_vs_bf16": bf16_us / fused_us}
        if ceilings is not None:
            fraction = mxfp4_bytes / (fused_us * 1e-6) / (ceilings.copy_tbps * 1e12)
            row.update(copy_fraction=fraction, verdict=verdict(fraction, row["speedup_vs_bf16"]))
            try:
                fused_graph_us = graph_time_us(lambda s: SPEC.run(s, config), sets, device)
                bf16_graph_us = graph_time_us(SPEC.baseline, sets, device)
            except RuntimeError as exc:  # a capture failure must not hide the eager figures
                row["graph_error"] = repr(exc)[:200]
            else:
                fraction_graph = mxfp4_bytes / (fused_graph_us * 1e-6) / (ceilings.copy_tbps * 1e12)
                row.update(fused_graph_us=fused_graph_us, bf16_graph_us=bf16_graph_us,
                           speedup_graph=bf16_graph_us / fused_graph_us, copy_fraction_graph=fraction_graph,
                           verdict_graph=verdict(fraction_graph, bf16_graph_us / fused_graph_us))
        row["config"] = json.dumps(config)
        row["check"] = error or "ok"
        rows.append(row)
        del check_inputs, sets
    del keep
    return rows


registry.register_report("moe_decode", moe_decode_report)
