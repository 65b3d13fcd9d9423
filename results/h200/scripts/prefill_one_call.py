"""One call of each route of moe_workspace_gemm at the issue-5 prefill shape (gate_up, T = 4096, E = 256, top-8),
after a warm-up call: a target for a profiler (``ncu -k regex:_fused_gemm_kernel -c 1 ...``). Run from the
repository root; argv[1] = "registers" (default) or "workspace"."""
import sys

import torch

from dsa_triton.moe.fp8_grouped_gemm import REGISTERS_TILE, WORKSPACE_TILE, SPEC, fp8_grouped_gemm, route_config
from dsa_triton.moe.prefill_report import routed_rows
from dsa_triton.moe.mxfp4 import realistic_mxfp4

dev = torch.device("cuda")
t, n, k = 4096, 4096, 7168
offsets, x = routed_rows(t, 256, 8, k, dev, t + n)
blocks, scales = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
base = SPEC.launch_config("prefill", {"M": t * 8, "E": 256, "N": n, "K": k}, dev)
registers = len(sys.argv) < 2 or sys.argv[1] == "registers"
config = {**route_config(base, 1), **REGISTERS_TILE} if registers else {**route_config(base, 0, 1), **WORKSPACE_TILE}
for _ in range(2):
    fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
torch.cuda.synchronize()
print("done", config)
