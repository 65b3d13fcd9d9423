"""One-off H200 probe (2026-11-30, session 2): the tuner timed moe_workspace_gemm gate_up at M=32768 at 11.9 ms,
the W_SMEM probe (same default config) at 5.4 ms. Times the default config on the registry's inputs
(ExpertWeights.random, random_offsets) and on realistic_mxfp4 weights, one set and rotated, with the unfit count."""
import torch

from dsa_triton.harness import rotation, time_rotating
from dsa_triton.moe.fp8_grouped_gemm import SPEC, _make_inputs, fp8_grouped_gemm
from dsa_triton.moe.mxfp4 import realistic_mxfp4

dev = torch.device("cuda")
print("| gemm | M | weights | sets | config route | unfit blocks | us |")
for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
    m = 32768
    shape = {"M": m, "E": 256, "N": n, "K": k}
    config = SPEC.launch_config("prefill", shape, dev)
    sets = rotation(lambda i: _make_inputs("prefill", shape, dev, i), 2.0 * m * k, dev)
    real = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
    for label, weights in (("registry", None), ("realistic", real)):
        for count in (1, len(sets)):
            def call(s):
                w = s["weights"]
                blocks, scales = (w.blocks, w.scales) if weights is None else weights
                return fp8_grouped_gemm(s["x"], s["offsets"], blocks, scales, config=config, unfit_counter=counter)
            counter = torch.zeros(1, dtype=torch.int32, device=dev)
            call(sets[0])
            unfit = int(counter.item())
            us = time_rotating(call, sets[:count], dev)
            print(f"| {name} | {m} | {label} | {count} | IN_REGISTERS={config['IN_REGISTERS']} | {unfit} | {us:.1f} |",
                  flush=True)
