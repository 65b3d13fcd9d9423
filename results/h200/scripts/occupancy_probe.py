"""H200 probe (session 5 of 2026-11-30) of the prefill registers route at T = 4096: does a fourth program per SM
help? The 64 x 128 / 4-warp kernel takes 166 registers a thread (ptxas, sm_90a), so 3 programs (12 warps) share an
SM; ``maxnreg=128`` (48 bytes spilled, outside the loop or not: to be seen) allows 4 (shared memory: 42 KB each at
3 stages, 56 KB at 4). Crossed with the thread-major code read of ``codes_order_probe.py`` (wrong values on natural
weights, valid timing: 4918 vs 5338 us for gate_up in session 5). Against ``torch._scaled_grouped_mm`` on the
offline FP8 copy, timed in the same run. Prints a table; JSON lines to ``$OUT/occupancy_probe.jsonl``.
Second use, after the kernel itself took the interleaved k order: ``occupancy_probe.py '[[maxnreg, stages], ...]'``
times the op as it is (no variant kernel) over those options; the error is then against torch's result."""
import json
import os
import sys

import torch

from codes_order_probe import SESSION5_TILE, gemm_module, variant_kernel
from dsa_triton.harness import time_us
from dsa_triton.moe.fp8_grouped_gemm import SPEC, fp8_grouped_gemm, route_config
from dsa_triton.moe.mxfp4 import realistic_mxfp4
from dsa_triton.moe.prefill_baselines import offline_fp8_experts, scaled_grouped_mm, tensorwise_fp8
from dsa_triton.moe.prefill_report import routed_rows


class WithOptions:
    """A Triton kernel whose launches get extra compile options (here ``maxnreg``)."""

    def __init__(self, kernel, **options):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, **self.options)


def prefill_cases(dev):
    """Issue 5's prefill GEMMs at T = 4096 (E = 256, top-8): per GEMM ``(name, offsets, x, blocks, scales,
    torch_call, config)``, ``torch_call()`` running ``torch._scaled_grouped_mm`` on the offline FP8 copy and
    ``config`` the registers route with session 5's 64 x 128 tile."""
    for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
        offsets, x = routed_rows(4096, 256, 8, k, dev, 4096 + n)
        blocks, scales = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
        w8, s8 = offline_fp8_experts(blocks, scales)
        xq, sx = tensorwise_fp8(x)
        shape = {"M": x.shape[0], "E": 256, "N": n, "K": k}
        config = {**route_config(SPEC.launch_config("prefill", shape, dev), 1), **SESSION5_TILE}
        yield name, offsets, x, blocks, scales, lambda: scaled_grouped_mm(xq, sx, w8, s8, offsets), config


def main() -> None:
    dev = torch.device("cuda")
    out = open(os.path.join(os.environ.get("OUT", "."), "occupancy_probe.jsonl"), "w")
    natural = gemm_module._fused_gemm_kernel
    if len(sys.argv) > 1:
        variants = [("as is", natural, maxnreg, stages) for maxnreg, stages in json.loads(sys.argv[1])]
    else:
        thread_major = variant_kernel()
        variants = [("natural", natural, None, 3), ("natural", natural, 128, 3), ("natural", natural, 128, 4),
                    ("thread-major", thread_major, None, 3), ("thread-major", thread_major, 128, 3)]
    print("| gemm | T | read | maxnreg | stages | us | torch us | vs torch | rel err vs first (argv: vs torch) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, offsets, x, blocks, scales, torch_call, config in prefill_cases(dev):
        t = 4096
        torch_us = time_us(torch_call, dev)
        reference = torch_call().float() if len(sys.argv) > 1 else None
        for read, kernel, maxnreg, stages in variants:
            gemm_module._fused_gemm_kernel = kernel if maxnreg is None else WithOptions(kernel, maxnreg=maxnreg)
            run_config = {**config, "num_stages": stages}
            try:
                y = fp8_grouped_gemm(x, offsets, blocks, scales, config=run_config).float()
                reference = y if reference is None else reference
                err = float((y - reference).norm() / reference.norm())
                us = time_us(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, config=run_config), dev)
            finally:
                gemm_module._fused_gemm_kernel = natural
            row = dict(gemm=name, T=t, read=read, maxnreg=maxnreg, stages=stages, us=us, torch_us=torch_us,
                       vs_torch=torch_us / us, rel_err=err)
            out.write(json.dumps(row) + "\n")
            print(f"| {name} | {t} | {read} | {maxnreg} | {stages} | {us:.1f} | {torch_us:.1f} | "
                  f"{torch_us / us:.3f} | {err:.3g} |", flush=True)
        for interleaved in (False, True):  # the activation quantization inside each call above, alone
            us = time_us(lambda: gemm_module.quantize_activations_fp8(x, interleaved), dev)
            print(f"| {name} | {t} | quantize x, interleaved={interleaved} | - | - | {us:.1f} | - | - | - |")
        del blocks, scales, x, torch_call


if __name__ == "__main__":
    main()
