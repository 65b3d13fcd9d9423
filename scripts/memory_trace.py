"""Where does device memory outside PyTorch's allocator go during a bench report? (GPU; issue 33)

Runs the named reports of ``python -m dsa_triton.bench`` one by one and reads the device memory (outside the
allocator, PyTorch's reserved and allocated, the graphs alive) after every CUDA-graph capture and every
report: one JSON line per event under ``--out``, then the largest readings per report.

    python scripts/memory_trace.py [--reports moe_decode,moe_layer_decode,moe_prefill] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from dsa_triton.bench.harness import measure_ceilings
from dsa_triton.bench.reports import REPORTS
from dsa_triton.runtime import device_memory

MIB = 2**20


def reading(event: str, report: str, log: list[dict]) -> None:
    memory = device_memory()
    log.append({"report": report, "event": event, "outside_mib": memory["outside"] / MIB,
                "reserved_mib": memory["reserved"] / MIB, "allocated_mib": torch.cuda.memory_allocated() / MIB,
                "live_graphs": sum(isinstance(o, torch.cuda.CUDAGraph) for o in gc.get_objects())})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", default="moe_decode,moe_layer_decode,moe_prefill")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    log: list[dict] = []
    current = ["start"]
    capture_end = torch.cuda.CUDAGraph.capture_end

    def traced_capture_end(self):
        capture_end(self)
        reading("capture", current[0], log)

    torch.cuda.CUDAGraph.capture_end = traced_capture_end
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    reading("ceilings", "start", log)
    for name in args.reports.split(","):
        current[0] = name
        reading("before", name, log)
        try:
            rows = REPORTS[name](device, ceilings)
            errors = [r for r in rows if any("error" in k for k in r)]
            note = f"{len(rows)} rows, {len(errors)} with an error"
        except Exception as exc:  # noqa: BLE001  (the trace is the point: name the failure, go on)
            note = f"raised {exc!r}"[:200]
        reading("after", name, log)
        torch.cuda.empty_cache()
        reading("after empty_cache", name, log)
        peak = max((r for r in log if r["report"] == name), key=lambda r: r["outside_mib"])
        print(f"{name}: {note}; outside the allocator at most {peak['outside_mib']:.0f} MiB ({peak['event']}, "
              f"{peak['live_graphs']} graphs alive, reserved {peak['reserved_mib']:.0f} MiB), "
              f"{sum(r['event'] == 'capture' for r in log if r['report'] == name)} captures", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory-trace.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)


if __name__ == "__main__":
    main()
