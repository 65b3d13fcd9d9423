"""H200 probe (session 5 of 2026-11-30): how much of the prefill op's eager time at T = 4096 is host time with the
GPU idle? ``fp8_grouped_gemm`` reads the expert offsets on the host (one sync a call), plans its tiles and then
launches, so under ``do_bench`` every call starts with the GPU drained. Times, for both GEMMs: the op eagerly (as
the bench report does), the same launches (activation quantization + registers-route GEMM, planned once) replayed
from a CUDA graph, the GEMM launch alone in a graph, and torch._scaled_grouped_mm eagerly and in a graph. Prints a
table; run from the repository root on the GPU."""
import torch

from dsa_triton.harness import graph_us, time_us
from dsa_triton.moe.fp8_grouped_gemm import (REGISTERS_TILE, SPEC, fp8_grouped_gemm, interleaves, launch_fused,
                                             plan_stages, quantize_activations_fp8, route_config)
from dsa_triton.moe.convert import row_references
from dsa_triton.moe.mxfp4 import realistic_mxfp4
from dsa_triton.moe.prefill_baselines import offline_fp8_experts, scaled_grouped_mm, tensorwise_fp8
from dsa_triton.moe.prefill_report import routed_rows


def main() -> None:
    dev = torch.device("cuda")
    print("| gemm | T | op eager us | quantize + GEMM graph us | GEMM graph us | torch eager us | torch graph us |"
          " op eager vs torch eager | graph vs torch graph |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
        t = 4096
        offsets, x = routed_rows(t, 256, 8, k, dev, t + n)
        blocks, scales = realistic_mxfp4((256, n), k, dev, seed=1, outliers=0.0)
        w8, s8 = offline_fp8_experts(blocks, scales)
        xq8, sx8 = tensorwise_fp8(x)
        torch_eager = time_us(lambda: scaled_grouped_mm(xq8, sx8, w8, s8, offsets), dev)
        torch_graph = graph_us(lambda: scaled_grouped_mm(xq8, sx8, w8, s8, offsets), dev)
        del w8, s8, xq8
        shape = {"M": x.shape[0], "E": 256, "N": n, "K": k}
        config = {**route_config(SPEC.launch_config("prefill", shape, dev), 1), **REGISTERS_TILE}
        op_eager = time_us(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, config=config), dev)
        ref, fits = row_references(scales)
        assert all(fits)
        plan = plan_stages(offsets.tolist(), config["BLOCK_M"], None, dev, take=fits)
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=dev)
        interleaved = interleaves(k, k // 32)
        xq, sx = quantize_activations_fp8(x, interleaved)

        def both():
            launch_fused(*quantize_activations_fp8(x, interleaved), blocks, scales, ref, y, plan, config)

        both_graph = graph_us(both, dev)
        gemm_graph = graph_us(lambda: launch_fused(xq, sx, blocks, scales, ref, y, plan, config), dev)
        print(f"| {name} | {t} | {op_eager:.1f} | {both_graph:.1f} | {gemm_graph:.1f} | {torch_eager:.1f} | "
              f"{torch_graph:.1f} | {torch_eager / op_eager:.3f} | {torch_graph / both_graph:.3f} |", flush=True)
        del blocks, scales, x, y, xq


if __name__ == "__main__":
    main()
