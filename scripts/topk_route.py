"""The route of ``dt.topk_indices`` on indexer-like score rows (issue 17): candidate counts against the buffer.

Rows: DeepSeek-V3.2 indexer scores as ``runner_bench.py --part decode-1m`` makes them (random weights: 64 heads x
128 dims, cache keys randn(n, 128) in FP8 as the bench's fill, the query from random bf16 ``wq_b`` / ``weights_proj``
on unit-RMS activations, Hadamard-rotated and FP8 per head; head weights of either sign), one row per query.

Per row: passes 1-2 emulated in PyTorch with the kernels' integer math
(:func:`dsa_triton.attention.topk_indices_reference.emulate_bound`: the window, tau, the candidate count, the route of
pass 3) and, with ``--kernel``, the kernels themselves: their candidate count (read from the workspace) and, on
a GPU, the call's time (CUDA events, median of ``--repeat``). Prints a line per row and a summary.

    python scripts/topk_route.py --n 1048576 --queries 200 --kernel          # on the H200 (a few minutes)
    python scripts/topk_route.py --n 32768 131072 1048576 --queries 20       # the emulation alone (CPU)
    TRITON_INTERPRET=1 python scripts/topk_route.py --n 8192 --k 64 --queries 4 --kernel --device cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsa_triton as dt  # noqa: E402
from dsa_triton.attention import topk_indices as tk  # noqa: E402
from dsa_triton.attention.formats import fp8_quantize_rows
from dsa_triton.attention.indexer_logits_reference import head_sum_logits  # noqa: E402
from dsa_triton.attention.topk_indices_reference import emulate_bound  # noqa: E402
from model_runner.model import hadamard  # noqa: E402

# the config the runner used at L = 1M, T = 1 (the database's nearest record, L = 131072, T = 1)
CONFIG = {"CAP_K": 4, "COLLECT_TILE": 2048, "COLLECT_WARPS": 8, "GROUP": 8, "HIST_BITS": 8, "ROUTE_MIN": 2,
          "SEL_BITS": 8, "SEL_TILE": 1024, "SEL_WARPS": 8, "SPLIT": 64, "TILE": 2048, "WARPS": 2}


def indexer_scores(n: int, queries: int, seed: int, device="cpu", heads=64, dim=128, hidden=7168, q_lora=1536,
                   chunk=1 << 16) -> torch.Tensor:
    """``[queries, n]`` fp32 scores ``sum_h w_h relu(q8_h . k8_s) k_scale_s`` (q's scales and ``dim^-0.5`` in
    ``w``), drawn on the CPU from ``seed`` (the same rows on any device), computed on ``device``."""
    g = torch.Generator().manual_seed(seed)
    keys8, key_scale = fp8_quantize_rows(torch.randn(n, dim, generator=g))
    wq_b = (torch.randn(heads * dim, q_lora, generator=g) * q_lora ** -0.5).bfloat16().float()
    w_proj = (torch.randn(heads, hidden, generator=g) * hidden ** -0.5).bfloat16().float()
    latent = torch.randn(queries, q_lora, generator=g)
    x = torch.randn(queries, hidden, generator=g)
    q = (latent @ wq_b.t()).bfloat16().float().view(queries, heads, dim)
    q8, q_scale = fp8_quantize_rows((q @ hadamard(dim)).bfloat16().float())
    w = (x @ w_proj.t()) * heads ** -0.5 * dim ** -0.5 * q_scale
    keys8, key_scale, q8, w = (t.to(device) for t in (keys8, key_scale, q8, w))
    out = torch.empty(queries, n, device=device)
    for s in range(0, n, chunk):
        out[:, s:s + chunk] = head_sum_logits(q8, w, keys8[s:s + chunk], key_scale[s:s + chunk])
    return out


def run_kernel(row: torch.Tensor, k: int, config: dict, repeat: int) -> tuple[int, float | None]:
    """The kernels' candidate count for ``row`` and, on a GPU, the median time of a call (ms)."""
    scores = row[None].contiguous()
    with tk.recorded_candidate_counts() as counts:
        idx = dt.topk_indices(scores, k, check_values=False, config=config)
        count = int(counts()[0])
    assert torch.equal(row[idx[0].long()].sort().values, torch.topk(row, k).values.sort().values), "not the top k"
    if not row.is_cuda:
        return count, None
    out = torch.empty_like(idx)
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dt.topk_indices(scores, k, check_values=False, config=config, out=out)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return count, statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[32768, 131072, 1 << 20], help="row lengths")
    ap.add_argument("--queries", type=int, default=20, help="rows (queries) per length")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="config changes")
    ap.add_argument("--kernel", action="store_true", help="also run the kernels (count, and time on a GPU)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per row (GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    config = dict(CONFIG)
    for item in args.set:
        name, value = item.split("=")
        config[name] = int(value)
    rows = []
    for n in args.n:
        scores = indexer_scores(n, args.queries, args.seed, args.device)
        cfg = dict(config)
        while cfg["SPLIT"] > max(1, n // max(cfg["TILE"], cfg["COLLECT_TILE"])):  # (a valid config for short rows)
            cfg["SPLIT"] //= 2
        for t in range(args.queries):
            e = emulate_bound(scores[t], args.k, cfg)
            row = {"n": n, "query": t, "mean_over_std": float(scores[t].mean() / scores[t].std()),
                   **{name: e[name] for name in ("lo", "hi", "shift", "step", "tau", "kth", "count", "cap", "route")}}
            if args.kernel:
                row["kernel_count"], row["ms"] = run_kernel(scores[t], args.k, cfg, args.repeat)
            rows.append(row)
            print(" ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                           for name, value in row.items()), flush=True)
        mine = [r for r in rows if r["n"] == n]
        across = [r for r in mine if r["lo"] <= 0.0 < r["hi"]]
        counts = sorted(r["count"] for r in mine)
        summary = (f"summary n={n}: {len(mine)} rows, {len(across)} windows across 0, whole-row route "
                   f"{sum(r['route'] == 'row' for r in mine)}, counts median {counts[len(counts) // 2]} "
                   f"max {counts[-1]} (cap {mine[0]['cap']})")
        if args.kernel:
            summary += f", kernel counts equal to the emulation's {sum(r['kernel_count'] == r['count'] for r in mine)}"
            ms = sorted(r["ms"] for r in mine if r["ms"] is not None)
            if ms:
                summary += f", ms min {ms[0]:.4f} median {ms[len(ms) // 2]:.4f} max {ms[-1]:.4f}"
        print(summary, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "k": args.k, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
