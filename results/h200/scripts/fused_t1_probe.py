"""H200 probe (2026-11-30, session 3; X_COPY added after its run): the fused MXFP4 decode GEMM at T = 1 (E=256,
top-8; down N=7168 K=2048 first, then gate_up N=4096 K=7168) over the valid configs of its space (BLOCK_M 8,
SPLIT_K up to 4, stages 2-5, X_COPY 0/1) within a time budget: first the 8 best tiles of the 0917 run with
both X_COPY values, then the rest in shuffled order, each timed by CUDA-graph replay (the eager figure
at T = 1 is the host's launch path); the fastest five and the default checked against the reference and
timed as a kernel alone by torch.profiler. Prints a table;
writes JSON lines to ``$OUT/fused_t1_probe.jsonl``. Usage: python fused_t1_probe.py SECONDS"""
import itertools
import json
import os
import random
import sys
import time

import torch

from dsa_triton.harness import graph_time_us, measure_ceilings, rotation
from dsa_triton.moe.decode_report import copy_fraction, fused_kernel_us
from dsa_triton.moe.fused_moe import SPACE, SPEC

dev = torch.device("cuda")
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 150.0
ceilings = measure_ceilings(dev)
one = torch.zeros(1, device=dev)
print(f"graph replay of one 1-element kernel: {graph_time_us(lambda _: one.add_(1), [None], dev):.1f} us "
      "(the fixed cost every graph time below includes)")
out = open(os.path.join(os.environ.get("OUT", "."), "fused_t1_probe.jsonl"), "w")
earlier_path = os.path.join(os.path.dirname(__file__), "..", "fused-t1-probe-nvidia-h200-20261130-0917.jsonl")
earlier = [json.loads(line) for line in open(earlier_path)] if os.path.exists(earlier_path) else []
start = time.time()
for n, k, gather in ((7168, 2048, 0), (4096, 7168, 1)):
    shape = {"T": 1, "E": 256, "top_k": 8, "N": n, "K": k, "gather": gather}
    sets = rotation(lambda i: SPEC.make_inputs("decode", shape, dev, i), SPEC.cost("decode", shape).bytes, dev)
    mxfp4_bytes = sum(len(s["active"]) for s in sets) / len(sets) * n * k * 17 / 32
    default = SPEC.launch_config("decode", shape, dev)
    names = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "X_COPY")
    grid = [dict(zip(names, v), BLOCK_M=8) for v in itertools.product(
        SPACE["BLOCK_N"], SPACE["BLOCK_K"], (1, 2, 4), SPACE["num_warps"], (2, 3, 4, 5), SPACE["X_COPY"])]
    grid = [c for c in grid if SPEC.is_valid(c, shape)]
    random.Random(0).shuffle(grid)
    # first: the 8 best tiles of the 0917 run (X_COPY=1 then), each with both X_COPY values, then the rest
    best = sorted((r for r in earlier if r["N"] == n and "us" in r), key=lambda r: r["us"])[:8]
    first = [{**r["config"], "X_COPY": x} for r in best for x in (1, 0)]
    first = [c for c in first if c != default]
    grid = [default] + first + [c for c in grid if c not in first and c != default]
    stop = start + budget * (0.55 if gather == 0 else 1.0)
    timed = []
    for config in grid:
        if time.time() > stop:
            break
        try:
            us = graph_time_us(lambda s: SPEC.run(s, config), sets, dev)
        except Exception as exc:  # a config the compiler rejects
            out.write(json.dumps({"N": n, "K": k, "config": config, "error": repr(exc)[:200]}) + "\n")
            continue
        timed.append((us, config))
        out.write(json.dumps({"N": n, "K": k, "config": config, "us": us,
                              "copy_fraction": copy_fraction(mxfp4_bytes, us, ceilings)}) + "\n")
    timed.sort(key=lambda r: r[0])
    check = SPEC.make_inputs("decode", shape, dev, 1234)
    print(f"\nN={n} K={k}: {len(timed)} of {len(grid)} valid configs timed; default {json.dumps(default)}")
    print("| rank | config | graph us | of copy | kernel us (profiler) | of copy | check |")
    default_us = next(us for us, c in timed if c is default)

    for rank, (us, config) in [*enumerate(timed[:5], 1), ("default", (default_us, default))]:
        error = "-" if rank == "default" else SPEC.compare(SPEC.run(check, config), SPEC.reference(check)) or "ok"
        k_us = fused_kernel_us(config, sets)
        print(f"| {rank} | {json.dumps(config)} | {us:.1f} | {copy_fraction(mxfp4_bytes, us, ceilings):.2f} | "
              f"{k_us:.1f} | {copy_fraction(mxfp4_bytes, k_us, ceilings):.2f} | {error} |", flush=True)
    del sets, check
