"""Does the CUDA context keep local memory for spilling kernels, and does releasing its stack free it? (GPU)

Launches a Triton kernel that keeps a large per-thread array in local memory (dynamically indexed), then prints the
device memory outside PyTorch's allocator and the context's per-thread stack size: before the launch, after it, and
after :func:`dsa_triton.runtime.release_stack`. One JSON line per step; the last line is a one-line verdict.

    python scripts/local_memory_probe.py [--elems 16384]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from dsa_triton.runtime import device_memory, release_stack, stack_bytes


@triton.jit
def _spill(out_ptr, idx_ptr, ELEMS: tl.constexpr):
    """Each program keeps ``ELEMS`` fp32 per thread block in a tensor it indexes at run time (local memory)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, ELEMS)
    buf = offs.to(tl.float32) * (pid + 1)
    i = tl.load(idx_ptr + pid)
    picked = tl.sum(tl.where(offs == i, buf, 0.0), 0)
    tl.store(out_ptr + pid, picked)


def snapshot(step: str, device: torch.device) -> dict:
    memory = device_memory(device)
    return {"step": step, "outside_mib": round(memory["outside"] / 2**20, 1), "stack_bytes": stack_bytes(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elems", type=int, default=16384)
    args = parser.parse_args()
    device = torch.device("cuda")
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(programs, device=device)
    idx = torch.randint(0, args.elems, (programs,), device=device, dtype=torch.int32)
    rows = [snapshot("before", device)]
    kernel = _spill[(programs,)](out, idx, ELEMS=args.elems, num_warps=1)
    torch.cuda.synchronize(device)
    rows.append({**snapshot("after launch", device), "n_spills": getattr(kernel, "n_spills", None),
                 "n_regs": getattr(kernel, "n_regs", None)})
    rows.append({**snapshot("after release_stack", device), "released": release_stack(device)})
    for row in rows:
        print(json.dumps(row))
    grown = rows[1]["outside_mib"] - rows[0]["outside_mib"]
    freed = rows[1]["outside_mib"] - rows[2]["outside_mib"]
    print(f"local memory: +{grown:.0f} MiB outside the allocator after the spilling launch (stack "
          f"{rows[1]['stack_bytes']} bytes a thread); release_stack freed {freed:.0f} MiB")


if __name__ == "__main__":
    main()
