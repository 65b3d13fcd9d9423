"""H200 probe (session 4): could a workspace route without per-128-k group scales reach torch._scaled_grouped_mm?

If the converted FP8 weights carried one scale per weight row (each row relative to its largest block scale, as
the registers route already does), the workspace GEMM would be a plain FP8 grouped GEMM: the tensor cores
accumulate all of K, scales after the loop. This times such a kernel (written here, not in the package) on the
offline FP8 copy against torch._scaled_grouped_mm on the same copy, same run, for the issue-5 prefill shapes, and
the MXFP4 -> FP8 conversion of the active experts (mxfp4_to_fp8, the workspace route's other half). Prints a
table; JSON lines to $OUT/plain_fp8_gemm_probe.jsonl. Run from the repository root."""
import json
import os

import torch
import triton
import triton.language as tl

from dsa_triton.harness import time_us
from dsa_triton.moe.fp8_grouped_gemm import _tile, plan_stages, quantize_activations_fp8
from dsa_triton.moe.prefill_report import routed_rows
from dsa_triton.moe.mxfp4 import realistic_mxfp4
from dsa_triton.moe.convert import mxfp4_to_fp8
from dsa_triton.moe.prefill_baselines import offline_fp8_experts, scaled_grouped_mm


@triton.jit
def plain_fp8_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, tiles_ptr, experts_ptr, n_mtiles, N, K,
                     stride_xm, stride_we, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    slot, row0, row_end, nt = _tile(tiles_ptr, n_mtiles, N, BLOCK_N, GROUP_M)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, row_end - 1).to(tl.int64)
    cols_in = tl.minimum(cols, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + kk[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols_in[None, :] * stride_wn + kk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(sx_ptr + rows_in)[:, None] * tl.load(sw_ptr + expert * N + cols_in)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])


dev = torch.device("cuda")
out = open(os.path.join(os.environ.get("OUT", "."), "plain_fp8_gemm_probe.jsonl"), "w")
tiles = [(128, 128, 128, 8, 4, 8), (128, 256, 128, 8, 3, 8), (64, 128, 128, 4, 4, 8), (128, 128, 128, 4, 4, 8),
         (64, 256, 128, 4, 3, 8), (128, 256, 64, 8, 4, 8)]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M
print("| gemm | T | " + " | ".join(f"{m}x{n}x{k} w{w} s{s}" for m, n, k, w, s, _ in tiles)
      + " | torch us | best vs torch | rel err | convert active us |")
for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
    blocks, scales = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
    w8, s8 = offline_fp8_experts(blocks, scales)
    sw = s8[:, None].expand(256, n).contiguous()
    for t in (4096, 16384):
        offsets, x = routed_rows(t, 256, 8, k, dev, t + n)
        counts = offsets[1:] - offsets[:-1]
        xq, sx = quantize_activations_fp8(x)
        torch_us = time_us(lambda: scaled_grouped_mm(xq, sx, w8, s8, offsets), dev)
        ref = scaled_grouped_mm(xq, sx, w8, s8, offsets).float()
        times, errs = [], []
        for bm, bn, bk, warps, stages, gm in tiles:
            plan = plan_stages(offsets.tolist(), bm, None, dev)
            y = torch.empty(t * 8, n, dtype=torch.bfloat16, device=dev)
            grid = (plan.tiles.shape[0] * triton.cdiv(n, bn),)

            def run():
                plain_fp8_kernel[grid](xq, sx, w8, sw, y, plan.tiles, plan.experts, plan.tiles.shape[0], n, k,
                                       xq.stride(0), w8.stride(0), w8.stride(1), y.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                       BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)
            try:
                run()
                errs.append(float((y.float() - ref).norm() / ref.norm()))
                times.append(time_us(run, dev))
            except Exception as exc:  # out of shared memory or registers
                errs.append(repr(exc)[:80])
                times.append(float("nan"))
        active = torch.nonzero(counts).flatten()
        conv_us = time_us(lambda: mxfp4_to_fp8(blocks[active], scales[active]), dev)
        gather_us = time_us(lambda: (blocks[active], scales[active]), dev)
        finite = [v for v in times if v == v]
        best = min(finite) if finite else float("nan")
        out.write(json.dumps(dict(gemm=name, T=t, tiles=tiles, us=times, err=errs, torch_us=torch_us,
                                  convert_us=conv_us, gather_us=gather_us)) + "\n")
        print(f"| {name} | {t} | " + " | ".join(f"{v:.0f}" for v in times)
              + f" | {torch_us:.0f} | {torch_us / best:.2f} | {errs} | {conv_us - gather_us:.0f} |", flush=True)
    del w8, sw, blocks, scales
