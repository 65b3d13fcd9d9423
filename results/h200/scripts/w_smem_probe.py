"""H200 probe of the registers route of ``moe_workspace_gemm`` (session 2 of 2026-11-30: ``W_SMEM`` 0 / 1; session 3
added ``num_stages`` 1 and ``UNROLL`` 2, the two ways found for ptxas to keep the 64x128 tile's wgmmas back to
back) over a few tiles, against ``torch._scaled_grouped_mm`` on the offline FP8 copy, for the issue-5 prefill shapes. Prints a
table (one row per tile, the (W_SMEM, stages, UNROLL) variants as columns); writes JSON lines to
``$OUT/w_smem_probe.jsonl``. Run from the repository root; session 4: tiles and variants as JSON arguments."""
import json
import os
import sys

import torch

from dsa_triton.harness import time_us
from dsa_triton.moe.fp8_grouped_gemm import SPEC, fp8_grouped_gemm
from dsa_triton.moe.prefill_report import routed_rows
from dsa_triton.moe.mxfp4 import realistic_mxfp4
from dsa_triton.moe.prefill_baselines import offline_fp8_experts, scaled_grouped_mm, tensorwise_fp8

dev = torch.device("cuda")
out = open(os.path.join(os.environ.get("OUT", "."), "w_smem_probe.jsonl"), "w")
# argv (optional, JSON): the tiles, then the (W_SMEM, num_stages, UNROLL) variants
tiles = json.loads(sys.argv[1]) if len(sys.argv) > 1 else [
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=256, num_warps=8)]
variants = [tuple(v) for v in json.loads(sys.argv[2])] if len(sys.argv) > 2 else [
    (0, 3, 1), (1, 3, 1), (0, 1, 1), (0, 3, 2), (1, 2, 2)]
print("| gemm | T | tile | " + " | ".join(f"W_SMEM={w} stages={s} UNROLL={u} us" for w, s, u in variants)
      + " | fp8 grouped us | vs_fp8 (best) | rel err |")
for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
    for t in (4096, 16384):
        offsets, x = routed_rows(t, 256, 8, k, dev, t + n)
        blocks, scales = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
        w8, s8 = offline_fp8_experts(blocks, scales)
        xq, sx = tensorwise_fp8(x)
        fp8 = time_us(lambda: scaled_grouped_mm(xq, sx, w8, s8, offsets), dev)
        ref = scaled_grouped_mm(xq, sx, w8, s8, offsets).float()
        del w8, s8, xq
        shape = {"M": t * 8, "E": 256, "N": n, "K": k}
        base = SPEC.launch_config("prefill", shape, dev)
        for tile in tiles:
            times, errs = {}, {}
            for variant in variants:
                w_smem, stages, unroll = variant
                label = ",".join(map(str, variant))
                cfg = {**base, **tile, "IN_REGISTERS": 1, "BLOCK_K": 128, "W_SMEM": w_smem, "num_stages": stages,
                       "UNROLL": unroll, "ROW_SCALED": 0, "OVERLAP": 1}
                try:
                    cfg = SPEC.validate(cfg, shape)
                    y = fp8_grouped_gemm(x, offsets, blocks, scales, config=cfg)
                    errs[label] = float((y.float() - ref).norm() / ref.norm())
                    times[variant] = time_us(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, config=cfg), dev)
                except Exception as exc:  # a config the compiler or the constraint rejects
                    times[variant], errs[label] = float("nan"), repr(exc)[:120]
            row = dict(gemm=name, T=t, tile=tile, us={",".join(map(str, v)): us for v, us in times.items()},
                       err=errs, fp8_us=fp8)
            out.write(json.dumps(row) + "\n")
            finite = [v for v in times.values() if v == v]
            best = min(finite) if finite else float("nan")
            print(f"| {name} | {t} | {tile['BLOCK_M']}x{tile['BLOCK_N']} w{tile['num_warps']} | "
                  + " | ".join(f"{times[v]:.1f}" for v in variants) + f" | {fp8:.1f} | {fp8 / best:.2f} | {errs} |",
                  flush=True)
