"""One-off H200 probe (2026-11-30, session 3): why eager medians of few-launch ops move up to 2-3x between runs
while their CUDA-graph figures do not. Per round, for top-k [64,131072] k=2048 (the registry's inputs): the SM
clock (nvidia-smi) before timing, a fixed pure-Python workload (host CPU speed), the eager median as is, the
eager median right after ~200 ms of GPU matmuls (clock ramped), and the graph median. Prints a table; writes
JSON lines to ``$OUT/eager_jitter_probe.jsonl``."""
import json
import os
import subprocess
import time

import torch

from dsa_triton.attention.topk import PHASE, SPEC
from dsa_triton.harness import graph_time_us, rotation, time_rotating

dev = torch.device("cuda")
shape = {"T": 64, "L": 131072, "k": 2048}
config = SPEC.launch_config(PHASE, shape, dev)
sets = rotation(lambda i: SPEC.make_inputs(PHASE, shape, dev, i), SPEC.cost(PHASE, shape).bytes, dev)
call = lambda s: SPEC.run(s, config)  # noqa: E731
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def sm_clock() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def python_ms() -> float:
    start = time.perf_counter()
    sum(i * i for i in range(300000))
    return (time.perf_counter() - start) * 1e3


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a
    torch.cuda.synchronize()


out = open(os.path.join(os.environ.get("OUT", "."), "eager_jitter_probe.jsonl"), "w")
print("| round | idle s | clock before | python ms | eager us | torch.topk eager us | clock after spin | eager after spin us | graph us |")
print("|---|---|---|---|---|---|---|---|---|")
for rnd, idle in enumerate((0, 2, 0, 2, 5, 0, 2, 0)):
    time.sleep(idle)
    row = {"round": rnd, "idle_s": idle, "clock_before": sm_clock(), "python_ms": python_ms(),
           "eager_us": time_rotating(call, sets, dev), "torch_eager_us": time_rotating(SPEC.baseline, sets, dev)}
    spin(200)
    row["clock_after_spin"] = sm_clock()
    spin(50)
    row["eager_after_spin_us"] = time_rotating(call, sets, dev)
    row["graph_us"] = graph_time_us(call, sets, dev)
    out.write(json.dumps(row) + "\n")
    print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |", flush=True)
