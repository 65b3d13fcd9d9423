"""The seesaw Gluon sparse attention kernel (:mod:`dsa_triton.attention.sparse_attention_seesaw`) on the GPU against
the reference and the Triton kernel, over a bf16 cache and over the FP8 latent cache, then both kernels timed
(``python scripts/gluon_attention.py [--only fp8|bf16|all] [--out DIR] [--kernels seesaw,seesaw:MODULE]
[--stress N]``).

Checks, per cache: small and odd shapes (index rows R 1 and 3; query rows M 64, 128 and 80 as 2 tokens x 40 heads,
the last head block masked; k 64, 100 and 2048; a cache of a number of slots no multiple of 64 whose rows nothing
selects are NaN; slots padded with -1, some negative or past the cache, one row without a valid slot), one split and
four (merged by ``_combine_splits``), outputs poisoned with NaN before each run; each kernel within the spec's bf16
tolerance of the fp32 reference (over the FP8 cache: its rows dequantized by the reference, then the same fp32
attention), and the two kernels' largest difference reported. The FP8 cache is made by the append op's quantizer
(``fp8_latent_quantize``: power-of-two scales) from rows whose 128-value groups differ in magnitude by up to 2^12,
so the four scales of a row differ. Timing (``do_bench_cudagraph``, median; eager ``do_bench`` where capture
fails): decode R = 64, 8, 1 with 128 heads, k = 2048 over a 128K-slot cache (151 MB in bf16, 86 MB in FP8: larger
than the L2), the Triton kernel at its launch config (tuning database, the FP8 op's own), the seesaw one at the bf16
Triton config's split count (and twice it below R = 64), with TFLOP/s, the fraction of a bf16 ``torch.mm`` 8192^3
measured in the same run, and the bytes each kernel reads per selected token (a bf16 row 1152, an FP8 row 656) with
the rate they are read at. Prints PASS / FAIL per check and a table last; writes ``gluon-attention.json`` under
``--out``; exit 1 on any failure (a kernel that fails to compile or launch is a failure of its rows; the rest still
runs). ``--kernels seesaw,seesaw:MODULE``: besides the package's seesaw kernel (always), ``seesaw:MODULE`` an
alternative source of it (an importable module with its interface, e.g. an experiment's), checked and timed the same
way (``vs seesaw``: the package kernel's time over its).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

D, DV = 576, 512
CHECK_CASES = [  # (R, S, H, k, num_slots)
    (1, 1, 64, 64, 1000), (3, 1, 128, 100, 1000), (3, 2, 40, 2048, 5000), (1, 1, 128, 2048, 4100),
    (3, 1, 64, 100, 200),
]


def make_inputs(R: int, S: int, H: int, k: int, num_slots: int, seed: int, odd: bool = True, fp8: bool = False):
    """``q[R, S, H, D]`` bf16, ``kv[num_slots, D]`` bf16 or (``fp8``) the FP8 latent cache ``uint8[num_slots, 656]``
    (rows nothing selects NaN; FP8: NaN bytes, scales and rope values), ``slots[R, k]`` int32. ``odd``: rows hold -1
    padding from a random count on, about 5% of the slots negative or past the cache, and row 2 (when there is one)
    no valid slot."""
    from dsa_triton.attention.formats import LATENT_GROUP, fp8_latent_quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(R, S, H, D, generator=g, device="cuda").bfloat16()
    slots = torch.rand(R, num_slots, generator=g, device="cuda").argsort(dim=1)[:, :k] if k <= num_slots else \
        torch.randint(0, num_slots, (R, k), generator=g, device="cuda")
    if odd:
        count = torch.randint(k // 2, k + 1, (R, 1), generator=g, device="cuda")
        slots = torch.where(torch.arange(k, device="cuda")[None, :] < count, slots, -1)
        stray = torch.rand(R, k, generator=g, device="cuda") < 0.05
        wild = torch.where(torch.rand(R, k, generator=g, device="cuda") < 0.5, -7, num_slots + 3)
        slots = torch.where(stray, wild, slots)
        if R > 2:
            slots[2] = -1
    kv = torch.full((num_slots, D), float("nan"), device="cuda")
    live = slots[(slots >= 0) & (slots < num_slots)].long().unique()
    rows = torch.randn(live.numel(), D, generator=g, device="cuda")
    if fp8:  # each 128-value group its own magnitude (2^-3 .. 2^3), so each its own scale; wider (2^+-6) makes
        # scores of ~60 whose fp32 rounding alone moves lse past the spec's 1e-4 absolute (both kernels, alike)
        groups = torch.randint(-3, 4, (live.numel(), DV // LATENT_GROUP), generator=g, device="cuda")
        rows[:, :DV] *= torch.exp2(groups.float()).repeat_interleave(LATENT_GROUP, dim=1)
    kv[live] = rows.bfloat16().float()
    kv = fp8_latent_quantize(kv, DV) if fp8 else kv.bfloat16()
    return q, kv, slots.to(torch.int32).contiguous()


def config_for(kernel: str, R: int, H: int, k: int, num_splits: int | None = None, fp8: bool = False) -> dict:
    """The Triton kernel's (``kernel`` "triton") launch config (tuning database, else default) for decode ``R`` x
    ``H`` heads over the bf16 or (``fp8``) the FP8 cache; a seesaw kernel's (:data:`GLUON_CONFIG`: 64 x 64 tiles) at
    ``num_splits`` (default: the bf16 Triton config's, tuned for 64-token tiles). The tuning database is the
    registry's."""
    from dsa_triton.attention.sparse_attention_seesaw import GLUON_CONFIG
    from dsa_triton.attention.sparse_attention import DECODE

    shape = {"B": R, "S": 1, "H": H, "D": D, "Dv": DV, "k": k, "fp8": int(fp8)}
    if kernel == "triton":
        return DECODE.launch_config("decode", shape, torch.device("cuda"))
    return {**GLUON_CONFIG, "num_splits": num_splits or config_for("triton", R, H, k)["num_splits"]}


def runner(kernel: str, q, kv, slots, config: dict):
    """A call of ``sparse_attention_fwd`` with the ``kernel`` ("triton", "seesaw" or "seesaw:MODULE") at ``config``
    (a uint8 ``kv``: the FP8 latent cache)."""
    from dsa_triton.attention import sparse_attention_kernels as sak

    launch = sak.AttentionLaunch(D, DV, slots.shape[1], 1, q.dtype, kv.dtype == torch.uint8, config)
    if kernel.startswith("seesaw"):
        seesaw = seesaw_module(kernel)
        own = (seesaw._sparse_attention_fwd_seesaw, seesaw.seesaw_meta(launch.fwd_meta))
    else:  # Triton's
        assert kernel == "triton", kernel
        own = None
    return lambda: sak.sparse_attention_fwd(q, kv, slots, D ** -0.5, launch, kernel=own)


def seesaw_module(kernel: str):
    """The module of the seesaw ``kernel``: "seesaw", the package's; "seesaw:MODULE", the importable module MODULE
    (an alternative source of it with the same interface, e.g. an experiment's)."""
    import importlib

    return importlib.import_module(kernel.partition(":")[2] or "dsa_triton.attention.sparse_attention_seesaw")


def kernels_of(extra: tuple = ()) -> list[str]:
    """The kernels: Triton's, the package's seesaw and the ``extra`` ones (alternative sources, "seesaw:MODULE")."""
    return ["triton", "seesaw", *extra]


def check_rows(cache: str, extra: tuple = ()) -> list[dict]:
    """The checks over the ``cache`` ("bf16" or "fp8"), one row per kernel (and ``extra`` kernels), case and split
    count."""
    from dsa_triton.attention.sparse_attention_seesaw import GLUON_CONFIG
    from dsa_triton.attention.sparse_attention_reference import sparse_attention_torch
    from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC
    from tests.poison import poisoned_allocations

    rows = []
    for case_no, (R, S, H, k, num_slots) in enumerate(CHECK_CASES):
        q, kv, slots = make_inputs(R, S, H, k, num_slots, 100 + case_no, fp8=cache == "fp8")
        valid = torch.where((slots >= 0) & (slots < num_slots), slots.long(), -1)
        ref = sparse_attention_torch(q.reshape(R, S * H, D), kv, valid, D ** -0.5, DV, magnitude=True)
        ref = tuple(x.reshape(R, S, H, *x.shape[2:]) for x in ref)
        for num_splits in (1, 4):
            outs = {}
            for kernel in kernels_of(extra):
                config = {**GLUON_CONFIG, "num_splits": num_splits}  # one config for every kernel
                row = {"kernel": kernel, "cache": cache, "R": R, "S": S, "H": H, "k": k, "num_slots": num_slots,
                       "num_splits": num_splits}
                outs.pop("other", None)
                try:
                    with poisoned_allocations():
                        out = runner(kernel, q, kv, slots, config)()
                    torch.cuda.synchronize()
                    row["check"] = DECODE_SPEC.compare(out, ref) or "ok"
                    outs["triton" if kernel == "triton" else "other"] = out
                except Exception as exc:  # a kernel that fails to compile or launch fails its row
                    row["check"] = f"error: {exc!r}"[:2000]
                    traceback.print_exc()
                if kernel != "triton" and len(outs) == 2:
                    (o1, l1), (o2, l2) = outs["triton"], outs["other"]
                    finite = torch.isfinite(l1) & torch.isfinite(l2)
                    row["max_abs_diff_to_triton"] = (o1.float() - o2.float()).abs().max().item()
                    row["lse_max_abs_diff_to_triton"] = (l1 - l2)[finite].abs().max().item() if finite.any() else 0.0
                status = "PASS" if row["check"] == "ok" else "FAIL"
                print(f"{status} {kernel} {cache:4s} R={R} S={S} H={H} k={k} slots={num_slots} "
                      f"splits={num_splits}: "
                      f"{row['check']}" + (f" (vs triton: out {row['max_abs_diff_to_triton']:.3g}, lse "
                                           f"{row['lse_max_abs_diff_to_triton']:.3g})"
                                           if "max_abs_diff_to_triton" in row else ""), flush=True)
                rows.append(row)
    return rows


STRESS_CASES = [(1, 1, 128, 2048, 40000), (3, 2, 40, 2048, 5000), (8, 1, 128, 2048, 40000), (64, 1, 128, 2048, 40000),
                 (7, 1, 64, 100, 1000)]  # (R, S, H, k, num_slots)


def stress_rows(cache: str, launches: int) -> list[dict]:
    """The seesaw kernel launched ``launches`` times per case and split count (1, 2, 4) over the ``cache``: every
    launch's out and lse bitwise equal to the first's (a race shows as run-to-run differences), and within the
    spec's tolerance of the fp32 reference, and the largest difference to the Triton kernel."""
    from dsa_triton.attention.sparse_attention_reference import sparse_attention_torch
    from dsa_triton.attention.sparse_attention_seesaw import GLUON_CONFIG
    from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC

    rows = []
    for case_no, (R, S, H, k, num_slots) in enumerate(STRESS_CASES):
        q, kv, slots = make_inputs(R, S, H, k, num_slots, 300 + case_no, fp8=cache == "fp8")
        valid = torch.where((slots >= 0) & (slots < num_slots), slots.long(), -1)
        ref = sparse_attention_torch(q.reshape(R, S * H, D), kv, valid, D ** -0.5, DV, magnitude=True)
        ref = tuple(x.reshape(R, S, H, *x.shape[2:]) for x in ref)
        for num_splits in (1, 2, 4):
            config = {**GLUON_CONFIG, "num_splits": num_splits}
            row = {"cache": cache, "R": R, "S": S, "H": H, "k": k, "num_splits": num_splits, "launches": launches}
            try:
                seesaw, triton_call = runner("seesaw", q, kv, slots, config), runner("triton", q, kv, slots, config)
                first = tuple(x.clone() for x in seesaw())
                differing = sum(not all(torch.equal(a, b) for a, b in zip(seesaw(), first))
                                for _ in range(launches - 1))
                torch.cuda.synchronize()
                row["check"] = DECODE_SPEC.compare(first, ref) or "ok"
                if differing:
                    row["check"] = f"{differing} of {launches - 1} launches differ from the first (a race)"
                out_t = triton_call()[0]
                row["max_abs_diff_to_triton"] = (first[0].float() - out_t.float()).abs().max().item()
            except Exception as exc:
                row["check"] = f"error: {exc!r}"[:2000]
                traceback.print_exc()
            print(f"{'PASS' if row['check'] == 'ok' else 'FAIL'} stress {cache:4s} R={R} S={S} H={H} k={k} "
                  f"splits={num_splits} x{launches}: {row['check']}", flush=True)
            rows.append(row)
    return rows


def median_us(fn) -> tuple[float, str]:
    """Median time of ``fn`` in us: replayed from a CUDA graph, else eager."""
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3, "graph"
    except Exception as exc:  # capture failed: time it eagerly
        print(f"graph capture failed ({exc!r:.200}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, return_mode="median") * 1e3, "eager"


def mm_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: torch.mm(a, b), return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def timing_rows(cache: str, passed: dict, mm_rate: float, index_rows: tuple, extra: tuple = ()) -> list[dict]:
    """Timings over the ``cache`` ("bf16" or "fp8") at each count of ``index_rows`` (decode sequences; 4096: the
    prefill bench row's T), the seesaw kernel and the ``extra`` kernels at each of its configs; ``passed[kernel,
    multi_split]``: whether that kernel's checks over it passed (one split / several)."""
    from dsa_triton.attention.formats import fp8_latent_bytes

    rows = []
    H, k, num_slots = 128, 2048, 131072
    fp8 = cache == "fp8"
    row_bytes = fp8_latent_bytes(DV, D - DV) if fp8 else 2 * D
    for R in index_rows:
        q, kv, slots = make_inputs(R, 1, H, k, num_slots, 7, odd=False, fp8=fp8)
        flops = 2 * R * H * k * (D + DV)
        triton_config = config_for("triton", R, H, k, fp8=fp8)
        splits = [config_for("seesaw", R, H, k)["num_splits"]]
        splits += [2 * splits[0]] if R < 64 else []
        runs = [("triton", triton_config)] + [(kernel, config_for(kernel, R, H, k, s)) for s in splits
                                              for kernel in kernels_of(extra)[1:]]
        base = default = None
        for kernel, config in runs:
            row = {"kernel": kernel, "cache": cache, "R": R, "H": H, "k": k, "num_slots": num_slots, "config": config,
                   "bytes_per_token": row_bytes}
            default = None if kernel == "seesaw" else default
            if kernel != "triton" and not passed[kernel, config["num_splits"] > 1]:
                row["error"] = "skipped: its checks failed"
            else:
                try:
                    us, mode = median_us(runner(kernel, q, kv, slots, config))
                    tflops = flops / (us * 1e-6) / 1e12
                    row.update(us=us, timing=mode, tflops=tflops, fraction_of_mm=tflops / mm_rate,
                               row_gbps=R * k * row_bytes / (us * 1e-6) / 1e9)
                    base = us if kernel == "triton" else base
                    row["speedup_vs_triton"] = base / us if base else None
                    default = us if kernel == "seesaw" else default
                    other = kernel not in ("triton", "seesaw")
                    row["vs_seesaw"] = default / us if other and default else None
                except Exception as exc:  # compile or launch failure: reported, the rest goes on
                    row["error"] = f"{exc!r}"[:2000]
                    traceback.print_exc()
            rows.append(row)
    return rows


def print_table(mm_rate: float, timings: list[dict]) -> None:
    print(f"\nbf16 torch.mm 8192^3: {mm_rate:.0f} TFLOP/s")
    print(f"{'kernel':7s} {'cache':5s} {'R':>3s} {'splits':>6s} {'us':>8s} {'TFLOP/s':>8s} {'of mm':>6s} "
          f"{'vs triton':>9s} {'B/token':>7s} {'GB/s':>6s} {'vs seesaw':>9s}")
    for r in timings:
        head = f"{r['kernel'].rpartition('.')[2]:7s} {r['cache']:5s} {r['R']:3d} {r['config']['num_splits']:6d}"
        if "us" in r:
            speedup = f"{r['speedup_vs_triton']:.2f}x" if r["speedup_vs_triton"] else "-"
            vs_seesaw = f"{r['vs_seesaw']:.3f}x" if r["vs_seesaw"] else "-"
            print(f"{head} {r['us']:8.1f} {r['tflops']:8.0f} {r['fraction_of_mm']:6.1%} {speedup:>9s} "
                  f"{r['bytes_per_token']:7d} {r['row_gbps']:6.0f} {vs_seesaw:>9s}")
        else:
            print(f"{head}  {r['error'][:60]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--only", choices=("fp8", "bf16", "all"), default="all", help="which cache to check and time")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 8, 1],
                        help="index rows of the timing rows (128 heads each; 4096: the prefill bench row's T)")
    parser.add_argument("--kernels", default="seesaw",
                        help="comma-separated: seesaw (the package's, always), seesaw:MODULE (an alternative source of "
                             "the seesaw kernel), checked and timed")
    parser.add_argument("--checks-only", action="store_true",
                        help="the checks alone (no mm rate, no timings: e.g. under compute-sanitizer)")
    parser.add_argument("--stress", type=int, default=0, metavar="N",
                        help="also launch the seesaw kernel N times per stress case and split count, both caches: "
                             "bitwise equal run to run, within tolerance of the reference")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "scripts/gluon_attention.py needs a GPU"

    caches = ("bf16", "fp8") if args.only == "all" else (args.only,)
    extra = tuple(k for k in args.kernels.split(",") if k.startswith("seesaw:"))
    assert all(k == "seesaw" or k.startswith("seesaw:") for k in args.kernels.split(",")), args.kernels
    checks = {cache: check_rows(cache, extra) for cache in caches}
    mm_rate = None if args.checks_only else mm_tflops()
    timings = []
    for cache in () if args.checks_only else caches:
        passed = {(kernel, multi): all(r["check"] == "ok" for r in checks[cache]
                                       if r["kernel"] == kernel and (r["num_splits"] > 1) == multi)
                  for kernel in kernels_of(extra)[1:] for multi in (False, True)}
        timings += timing_rows(cache, passed, mm_rate, tuple(args.rows), extra)
    checks = [row for cache in caches for row in checks[cache]]
    checks += [row for cache in caches for row in stress_rows(cache, args.stress)] if args.stress else []
    failed = [r for r in checks if r["check"] != "ok"]
    failed += [r for r in timings if "error" in r and not r["error"].startswith("skipped")]
    from dsa_triton.bench.results import git_state

    result = {"device": torch.cuda.get_device_name(), "git": git_state(), "torch": torch.__version__,
              "triton": triton.__version__,
              "kernels": kernels_of(extra), "bf16_mm_tflops": mm_rate, "checks": checks, "timings": timings,
              "failures": len(failed)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gluon-attention.json").write_text(json.dumps(result, indent=1, default=str))
    if timings:
        print_table(mm_rate, timings)
    print(f"\n{'ALL PASS' if not failed else f'FAILURES: {len(failed)}'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
