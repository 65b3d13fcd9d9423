"""H200 probe (session 6 of 2026-11-30): the registers route reading its x tiles through a TMA tensor descriptor
(``X_DESCRIPTOR``) or through pointers, after ncu put CTA barrier stalls first (1.44 an instruction at 128 x 128 /
4 warps). Both in one process, alternately, with the stored configs, at T = 4096 (both GEMMs) and T = 16384 (down,
which takes the registers route); results checked equal bit for bit. Prints a table; run from the repository root."""
import importlib

import torch

from dsa_triton.harness import graph_us, time_us
from dsa_triton.moe.mxfp4 import realistic_mxfp4
from dsa_triton.moe.prefill_report import routed_rows

gemm = importlib.import_module("dsa_triton.moe.fp8_grouped_gemm")


def main() -> None:
    dev = torch.device("cuda")
    print("| gemm | T | pointers us | descriptor us | pointers graph us | descriptor graph us | graph ratio | equal |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t, n, k in (("gate_up", 4096, 4096, 7168), ("down", 4096, 7168, 2048), ("down", 16384, 7168, 2048)):
        offsets, x = routed_rows(t, 256, 8, k, dev, t + n)
        blocks, scales = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
        call = lambda: gemm.fp8_grouped_gemm(x, offsets, blocks, scales, check_values=False)
        times, outs = {}, {}
        for flag in (False, True, False, True):  # twice each, alternately: the second pair is reported
            gemm.X_DESCRIPTOR = flag
            outs[flag] = call()
            times[flag] = (time_us(call, dev), graph_us(call, dev))
        same = torch.equal(outs[False], outs[True])
        print(f"| {name} | {t} | {times[False][0]:.1f} | {times[True][0]:.1f} | {times[False][1]:.1f} | "
              f"{times[True][1]:.1f} | {times[False][1] / times[True][1]:.3f} | {same} |", flush=True)
        del x, blocks, scales, outs


if __name__ == "__main__":
    main()
