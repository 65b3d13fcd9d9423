"""H200 probe (2026-11-30, session 3; X_COPY added after its run): the fused MXFP4 decode GEMM at T = 1 (E=256,
top-8; down N=7168 K=2048 first, then gate_up N=4096 K=7168) over the valid configs of its space (BLOCK_M 8,
SPLIT_K up to 4, stages 2-5, X_COPY 0/1), in shuffled order within a time budget, each timed by CUDA-graph replay (the eager figure
at T = 1 is the host's launch path) and the fastest five checked against the reference. Prints a table;
writes JSON lines to ``$OUT/fused_t1_probe.jsonl``. Usage: python fused_t1_probe.py SECONDS"""
import itertools
import json
import os
import random
import sys
import time

import torch

from dsa_triton.harness import graph_time_us, measure_ceilings, rotation
from dsa_triton.moe.fused_moe import SPACE, SPEC

dev = torch.device("cuda")
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 150.0
copy_tbps = measure_ceilings(dev).copy_tbps
one = torch.zeros(1, device=dev)
print(f"graph replay of one 1-element kernel: {graph_time_us(lambda _: one.add_(1), [None], dev):.1f} us "
      "(the fixed cost every graph time below includes)")
out = open(os.path.join(os.environ.get("OUT", "."), "fused_t1_probe.jsonl"), "w")
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
    grid.insert(0, default)
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
                              "copy_fraction": mxfp4_bytes / (us * 1e-6) / (copy_tbps * 1e12)}) + "\n")
    timed.sort(key=lambda r: r[0])
    check = SPEC.make_inputs("decode", shape, dev, 1234)
    print(f"\nN={n} K={k}: {len(timed)} of {len(grid)} valid configs timed; default {json.dumps(default)}")
    print("| rank | config | graph us | of copy | check |")
    default_us = next(us for us, c in timed if c is default)
    for rank, (us, config) in enumerate(timed[:5]):
        error = SPEC.compare(SPEC.run(check, config), SPEC.reference(check))
        print(f"| {rank + 1} | {json.dumps(config)} | {us:.1f} | {mxfp4_bytes / (us * 1e-6) / (copy_tbps * 1e12):.2f} | "
              f"{error or 'ok'} |")
    print(f"| default | {json.dumps(default)} | {default_us:.1f} | "
          f"{mxfp4_bytes / (default_us * 1e-6) / (copy_tbps * 1e12):.2f} | - |", flush=True)
    del sets, check
