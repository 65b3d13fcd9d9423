"""H200 probe (session 5 of 2026-11-30): how much of the prefill op's eager time at T = 4096 is host time with the
GPU idle? ``fp8_grouped_gemm`` reads the expert offsets on the host (one sync a call), plans its tiles and then
launches, so under ``do_bench`` every call starts with the GPU drained. Times, for both GEMMs: the op eagerly (as
the bench report does), the same launches (activation quantization + registers-route GEMM, planned once) replayed
from a CUDA graph, the GEMM launch alone in a graph, and torch._scaled_grouped_mm eagerly and in a graph. Prints a
table; run from the repository root on the GPU."""
import torch

from dsa_triton.harness import graph_us, time_us
from dsa_triton.moe.convert import row_references
from dsa_triton.moe.fp8_grouped_gemm import (fp8_grouped_gemm, interleaves, launch_fused, plan_stages,
                                             quantize_activations_fp8)
from occupancy_probe import prefill_cases


def main() -> None:
    dev = torch.device("cuda")
    print("| gemm | T | op eager us | quantize + GEMM graph us | GEMM graph us | torch eager us | torch graph us |"
          " op eager vs torch eager | graph vs torch graph |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, offsets, x, blocks, scales, torch_call, config in prefill_cases(dev):
        t, n, k = 4096, blocks.shape[1], x.shape[1]
        torch_eager = time_us(torch_call, dev)
        torch_graph = graph_us(torch_call, dev)
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
        del blocks, scales, x, y, xq, torch_call


if __name__ == "__main__":
    main()
