"""The MoE prefill's activation quantization (:func:`quantize_activations_fp8`) on the GPU: bit for bit against its
oracle, then timed against the copy bandwidth (``python scripts/quantize_bench.py [--out DIR]``).

The check rows hold the values where rounding is hard (ties to even in the normal and subnormal ranges, signed
zeros, amax at and just above 448, NaN and inf rows, an all-zero row) in every input dtype, at odd sizes and at the
MoE prefill shapes, in both k orders. The timed rows are the MoE prefill shapes (T = 4096 and 16384 routed to 8 of
256 experts: M = 32768 / 131072 rows of gate_up's K = 7168 and down's K = 2048): the op as it launches, and the
same kernel in other row tiles and warp counts (``VARIANTS``), each checked bit for bit against the op first. The
kernel's rounding is the GPU's cvt instruction; the interpreter's (software) rounding is the oracle's too.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((32768, 7168), (32768, 2048), (131072, 7168), (131072, 2048))
VARIANTS = ((1, 4), (1, 8), (2, 8), (2, 16))  # (rows a program, warps)


def hard_rows(k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``x[12, k]`` (k >= 10): random rows over 24 binades, then the special rows."""
    x = torch.randn(12, k, generator=g) * torch.exp2(torch.randint(-12, 12, (12, 1), generator=g).float())
    x[0] = 0.0
    x[0, :10] = torch.tensor([448.0, 1.0625, 1.1875, -1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-7 + 2.0**-11, 0.0,
                              -2.0**-11, -0.0])
    x[1] = 0.0
    x[2, :4] = torch.tensor([450.0, 1e-3, -1e-4, 1.0])
    x[2, 4:] = x[2, 4:].clamp(-1, 1)
    x[3, k // 2] = float("nan")
    x[4, 1] = float("-inf")
    return x.to(dtype)


def interleave(q: torch.Tensor) -> torch.Tensor:
    """The registers route's k order of e4m3 rows (K a multiple of 128), as uint8."""
    m, k = q.shape
    return q.view(torch.uint8).view(m, k // 128, 4, 8, 4).transpose(2, 3).reshape(m, k)


def matches_oracle(q, s, x, interleaved: bool) -> bool:
    """``(q, s)`` of :func:`quantize_activations_fp8` equal to the oracle's bit for bit (NaN scales where its are)."""
    from dsa_triton.moe.fp8_grouped_gemm_reference import quantize_rows_fp8_torch

    ref_q, ref_s = quantize_rows_fp8_torch(x)
    ref_bytes = interleave(ref_q) if interleaved else ref_q.view(torch.uint8)
    return torch.equal(q.view(torch.uint8), ref_bytes) and torch.equal(s.nan_to_num(-1.0), ref_s.nan_to_num(-1.0))


def check_rows(device) -> list[dict]:
    """The hard rows at odd and MoE sizes, every input dtype and k order, against the oracle."""
    from dsa_triton.moe.fp8_grouped_gemm import quantize_activations_fp8

    g = torch.Generator().manual_seed(0)
    checks = []
    for k in (10, 160, 384, 2048, 7168, 10000):  # 10000: rows read twice, in steps
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            x = hard_rows(k, dtype, g).to(device)
            for interleaved in (False, True) if k % 128 == 0 else (False,):
                q, s = quantize_activations_fp8(x, interleaved)
                checks.append({"K": k, "dtype": str(dtype).split(".")[1], "interleaved": interleaved,
                               "bitwise": matches_oracle(q, s, x, interleaved)})
    return checks


def timed_rows(copy_tbps: float) -> list[dict]:
    """The op and its variants at the MoE prefill shapes, each variant checked bit for bit against the op."""
    import triton.testing

    from dsa_triton.hostmath import cdiv
    from dsa_triton.launch import launch_with
    from dsa_triton.moe.fp8_grouped_gemm import quantize_activations_fp8, quantize_meta
    from dsa_triton.moe.fp8_grouped_gemm_kernels import _quantize_rows_kernel

    def run(x, meta):
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(m, dtype=torch.float32, device=x.device)
        launch_with(_quantize_rows_kernel, (cdiv(m, meta["BLOCK_M"]),), meta, x, q, s, m, k, x.stride(0),
                    q.stride(0))
        return q, s

    def us(fn) -> float:
        return 1e3 * triton.testing.do_bench(fn, return_mode="median")

    timed = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3  # over twice the L2: no rotation needed
        for interleaved in (True, False):
            ref_q, ref_s = quantize_activations_fp8(x, interleaved)
            op_us = us(lambda: quantize_activations_fp8(x, interleaved))
            rows = [("op", op_us, True)]
            for bm, warps in VARIANTS:
                meta = dict(quantize_meta(k, interleaved),
                            BLOCK_M=bm, num_warps=warps)
                q, s = run(x, meta)
                bitwise = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
                rows.append((f"{bm} row(s), {warps} warps", us(lambda: run(x, meta)), bitwise))
            for name, t, bitwise in rows:
                tbps = (x.numel() * 3 + 4 * m) / t / 1e6
                timed.append({"M": m, "K": k, "interleaved": interleaved, "launch": name, "us": round(t, 1),
                              "op_over_this": round(op_us / t, 3), "TB/s": round(tbps, 2),
                              "of_copy": round(tbps / copy_tbps, 3), "bitwise_vs_op": bitwise})
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = parser.parse_args(argv)

    import triton.testing

    from dsa_triton.bench.results import dict_table, write_results
    from dsa_triton.moe.fp8_grouped_gemm import quantize_meta

    assert torch.cuda.is_available(), "scripts/quantize_bench.py needs a GPU"
    checks = check_rows("cuda")
    failed = [c for c in checks if not c["bitwise"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} bit-for-bit checks ok" + "".join(f"\n  {c}" for c in failed))
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_tbps = 4 * 2**30 / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e9
    src = dst = None
    timed = timed_rows(copy_tbps)
    config = quantize_meta(7168, True)
    note = f"copy {copy_tbps:.2f} TB/s (2 GiB read + written); the op's launch at K = 7168: {config}"
    write_results(args.out, "quantize-bench", {"checks": checks, "timed": timed}, note=note, flat=True)
    print(note)
    print(dict_table(timed))
    return int(bool(failed) or not all(r["bitwise_vs_op"] for r in timed))


if __name__ == "__main__":
    sys.exit(main())
