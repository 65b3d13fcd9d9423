"""Reports on :func:`~dsa_triton.topk_indices` against ``torch.topk`` (k = 2048, fp32), same inputs, same run.

``topk_speed``: the bench shapes, eager and replayed from CUDA graphs.

The eager rows include the op's host time (three Triton launches from Python), which moves with the host's load
while the graph median holds; so at small T the eager ratio measures the host and the graph ratio the kernels. Acceptance (issue 3):
``[64, 131072]`` at least 2x (goal 5x), ``[4096, 131072]`` at least 1.5x (goal 4x).

``topk_routes``: the config's ``ROUTE_MIN`` (which rows skip the one-program whole-row route) over rows of
mixed lengths (uniform in ``[0, L]``, as in a decode batch) and of one length below ``2 k GROUP``, in graphs.
"""
from __future__ import annotations

import json

import torch

from dsa_triton.bench.harness import floor_us, graph_time_us, rotation, time_rotating
from dsa_triton.attention.topk_indices import topk_indices
from dsa_triton.attention.topk_indices import PHASE, SPACE
from dsa_triton.attention.topk_indices_spec import SPEC, random_scores
from dsa_triton.attention.topk_indices_reference import check_topk, topk_indices_torch

ACCEPTANCE = {64: (2.0, 5.0), 4096: (1.5, 4.0)}  # rows T: (minimum, goal) speedup over torch.topk


def _verdict(T: int, speedup: float) -> str:
    if T not in ACCEPTANCE:
        return "-"
    low, goal = ACCEPTANCE[T]
    return "goal" if speedup >= goal else "pass" if speedup >= low else "fail"


def topk_speed_report(device, ceilings) -> list[dict]:
    """One row per bench shape: medians in us, speedups over torch.topk (a verdict each), the graph time's
    fraction of the byte floor."""
    device = torch.device(device)
    rows = []
    for shape in SPEC.bench_shapes(PHASE, ceilings is not None):
        config = SPEC.launch_config(PHASE, shape, device)
        cost = SPEC.cost(PHASE, shape)
        sets = rotation(lambda i: SPEC.make_inputs(PHASE, shape, device, i), cost.bytes, device)

        def ours(s):
            return topk_indices(**s, check_values=False, config=config)

        row = {"shape": ",".join(f"{k}={v}" for k, v in shape.items()), "config": json.dumps(config),
               "eager_us": time_rotating(ours, sets, device), "torch_eager_us": time_rotating(SPEC.baseline, sets, device)}
        row["eager_speedup"] = row["torch_eager_us"] / row["eager_us"]
        if device.type == "cuda":
            row["graph_us"] = graph_time_us(ours, sets, device)
            row["torch_graph_us"] = graph_time_us(SPEC.baseline, sets, device)
            row["graph_speedup"] = row["torch_graph_us"] / row["graph_us"]
            if ceilings is not None:
                row["graph_of_floor"] = floor_us(cost, ceilings)[0] / row["graph_us"]
        if ceilings is not None:
            row["eager_verdict"] = _verdict(shape["T"], row["eager_speedup"])
            row["graph_verdict"] = _verdict(shape["T"], row.get("graph_speedup", 0.0))
        rows.append(row)
    return rows


def topk_routes_report(device, ceilings) -> list[dict]:
    """Per case and ROUTE_MIN: our time (graph on the GPU, wall clock in the interpreter), torch.topk's, and the
    check of our indices against the reference on the first input set."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    T, k, lengths_of = (64, 2048, (131072, 16384, 32768)) if gpu else (3, 16, (600, 200))
    g = torch.Generator(device=device).manual_seed(0)
    cases = [("random lengths", lengths_of[0], torch.randint(0, lengths_of[0] + 1, (T,), generator=g, device=device))]
    cases += [(f"all rows {n}", n, torch.full((T,), n, device=device)) for n in lengths_of[1:]]
    timer = graph_time_us if gpu else time_rotating
    rows = []
    for name, L, lengths in cases:
        lengths = lengths.to(torch.int32)
        shape = {"T": T, "L": L, "k": k}
        sets = rotation(lambda i: {"scores": random_scores(lengths, L, torch.Generator(device).manual_seed(i)),
                                   "lengths": lengths}, 4.0 * T * L, device)
        torch_us = timer(lambda s: torch.topk(s["scores"], k, dim=1), sets, device)
        first = sets[0]
        expected = topk_indices_torch(first["scores"], k, first["lengths"])
        base = SPEC.launch_config(PHASE, shape, device)  # one config for every ROUTE_MIN: only that differs
        if not all(SPEC.is_valid({**base, "ROUTE_MIN": r}, shape) for r in SPACE["ROUTE_MIN"]):
            base = SPEC.default(PHASE, shape)  # stored tiles too large for the score histogram
        for route_min in SPACE["ROUTE_MIN"]:
            config = {**base, "ROUTE_MIN": route_min}

            def ours(s):
                return topk_indices(s["scores"], k, s["lengths"], check_values=False, config=config)

            error = check_topk(ours(first), expected, first["scores"], k, first["lengths"])
            rows.append({"case": name, "shape": f"T={T},L={L},k={k}", "ROUTE_MIN": route_min,
                         "config": json.dumps(config),
                         "us": timer(ours, sets, device), "torch_us": torch_us, "check": error or "ok"})
            rows[-1]["speedup"] = torch_us / rows[-1]["us"]
    return rows
