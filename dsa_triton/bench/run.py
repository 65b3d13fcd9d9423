"""Check and time every registered kernel in one call: ``python -m dsa_triton.bench``.

On a GPU: measures the ceilings, then for each kernel, phase and realistic shape checks the launch config against
the reference on fresh random inputs and times it against the baseline in the same run, eager and replayed from
CUDA graphs, with the fraction of the floor. Without a GPU: the same checks on tiny shapes in the Triton
interpreter; its times are the interpreter's, so no speedups or floors are printed. Writes
``results/<device>/<date>/bench-<device>-<stamp>.json|md|png`` (``--out`` picks the root) and ends with one line:
``N/N checks ok`` or the failures.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .. import registry
from ..registry import shape_text
from ..runtime import default_device
from .harness import (Ceilings, Measurement, does_not_fit, error_text, graph_time_or_nan, measure_ceilings,
                      measurement, rotation, settle, time_rotating)
from .results import fmt, write_results


def bench_kernel(spec: registry.KernelSpec, phase: str, shape: dict[str, int], device: torch.device,
                 ceilings: Ceilings | None) -> Measurement:
    """Check the launch config on fresh inputs, then time kernel and baseline over rotated input sets, eager and
    (on the GPU, when the call captures) replayed from CUDA graphs: an eager median of an op of few launches is
    mostly the host's launch path, whose speed moves between minutes on a shared host."""
    config = spec.launch_config(phase, shape, device)
    inputs = spec.make_inputs(phase, shape, device, 1234)
    error = spec.compare(spec.run(inputs, config), spec.reference(inputs))
    cost = spec.cost(phase, shape)
    sets = rotation(lambda i: spec.make_inputs(phase, shape, device, i), cost.bytes, device)
    run = lambda s: spec.run(s, config)  # noqa: E731
    median, graph = time_rotating(run, sets, device), graph_time_or_nan(run, sets, device)
    base_us = graph_base_us = float("nan")
    base_error = ""
    if spec.baseline is not None:
        try:
            base_us = time_rotating(spec.baseline, sets, device)
            graph_base_us = graph_time_or_nan(spec.baseline, sets, device)
        except Exception as exc:  # a baseline that fails fails its row, with the error
            base_error = error_text(exc, "baseline error: ")
    return measurement(kernel=spec.name, phase=phase, shape=shape_text(shape), config=json.dumps(config),
                       median_us=median, cost=cost, ceilings=ceilings, baseline=spec.baseline_name,
                       baseline_us=base_us, check=error or base_error or "ok", graph_us=graph,
                       graph_baseline_us=graph_base_us)


def free_gib(device: torch.device) -> str:
    """The device's free memory after the failed allocation's blocks went back, as a row's skip reason says it."""
    if device.type != "cuda":
        return "host memory"
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"


def table(rows: list[Measurement], interpreter: bool) -> str:
    """The bench's markdown table; in the interpreter only the checks and the interpreter's seconds."""
    if interpreter:
        lines = ["| kernel | phase | shape | interpreter s | check |", "|---|---|---|---|---|"]
        lines += [f"| {r.kernel} | {r.phase} | {r.shape} | {fmt(r.median_us / 1e6, 3)} | {r.check} |" for r in rows]
        return "\n".join(lines)
    head = ("| kernel | phase | shape | us | baseline | base us | speedup | floor us | bound | of floor | TB/s | TFLOP/s "
            "| graph us | graph base us | graph speedup | graph of floor | check |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.kernel} | {r.phase} | {r.shape} | {fmt(r.median_us, 1)} | {r.baseline or '-'} | "
            f"{fmt(r.baseline_us, 1)} | {fmt(r.speedup)} | {fmt(r.floor_us, 1)} | {r.bound or '-'} | "
            f"{fmt(r.floor_fraction)} | {fmt(r.tbps)} | {fmt(r.tflops, 1)} | {fmt(r.graph_us, 1)} | "
            f"{fmt(r.graph_baseline_us, 1)} | {fmt(r.graph_speedup)} | {fmt(r.graph_floor_fraction)} | {r.check} |"
        )
    return "\n".join(lines)


SKIPPED = "skipped: "  # a row whose problem does not fit the device's memory: named, not failed


def summary(rows: list[Measurement], report_rows: dict[str, list[dict]], memory: dict | None = None
            ) -> tuple[str, bool]:
    """``("43/43 checks ok", True)``, or the count and every failure named (rows that do not fit the device are
    skipped with the reason, not failed); the second item: no failure. ``memory``: the device memory outside
    PyTorch's allocator, said after the count."""
    failures = [f"{r.kernel} {r.phase} {r.shape}: {r.check}" for r in rows
                if r.check != "ok" and not r.check.startswith(SKIPPED)]
    failures += [f"report {name}: {row['error']}" for name, items in report_rows.items() for row in items
                 if "error" in row]
    skipped = [f"{r.kernel} {r.phase} {r.shape}: {r.check}" for r in rows if r.check.startswith(SKIPPED)]
    skipped += [f"report {name}: {row['skipped']}" for name, items in report_rows.items() for row in items
                if "skipped" in row]
    checks = len(rows) + len(report_rows) - len(skipped)
    line = f"{checks - len(failures)}/{checks} checks ok"
    if skipped:
        line += f" ({len(skipped)} skipped: " + "; ".join(skipped) + ")"
    if memory:
        line += (f"; memory outside PyTorch's allocator: {memory['end_mib']:.0f} MiB at the end, at most "
                 f"{memory['peak_mib']:.0f} MiB after a row ({memory['peak_row']}, per-thread stack "
                 f"{memory['peak_stack_bytes']} bytes) before its stack was released")
    return (line if not failures else line + "; failed:\n  " + "\n  ".join(failures)), not failures


def memory_summary(rows: list[Measurement], report_memory: dict[str, dict], device: torch.device) -> dict | None:
    """The largest memory outside the allocator a row or report left, and what is left at the end (GPU only)."""
    if device.type != "cuda":
        return None
    seen = [(r.outside_mib, f"{r.kernel} {r.phase} {r.shape}", r.stack_bytes) for r in rows
            if r.outside_mib == r.outside_mib]
    seen += [(m["outside_mib"], f"report {name}", m["stack_bytes"]) for name, m in report_memory.items() if m]
    peak = max(seen, default=(0.0, "-", 0))
    settled = settle(device)
    return {"end_mib": settled["outside_released_mib"], "peak_mib": peak[0], "peak_row": peak[1],
            "peak_stack_bytes": peak[2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_triton.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="", help="comma-separated kernel or report names (default: all)")
    parser.add_argument("--out", default="results", help="root folder of the results files (default: results/)")
    parser.add_argument("--no-ceilings", action="store_true", help="skip measuring the GPU ceilings")
    parser.add_argument("--no-reports", action="store_true", help="only the per-kernel rows")
    args = parser.parse_args(argv)

    import dsa_triton  # noqa: F401  (registers every kernel)
    from tqdm import tqdm

    from .plot import plot_bench
    from .reports import REPORTS

    device = default_device()
    ceilings = None
    if device.type == "cuda" and not args.no_ceilings:
        ceilings = measure_ceilings(device)
    wanted = [n for n in args.kernels.split(",") if n]
    unknown = [n for n in wanted if n not in REPORTS and n not in {s.name for s in registry.kernels()}]
    if unknown:
        parser.error(f"no kernel or report named {', '.join(unknown)}")
    specs = [registry.get(n) for n in wanted if n not in REPORTS] if wanted else registry.kernels()
    jobs = [(s, p, shape) for s in specs for p in s.phases for shape in s.bench_shapes(p, device.type == "cuda")]
    rows: list[Measurement] = []
    for spec, phase, shape in tqdm(jobs, desc="bench", file=sys.stderr, disable=not jobs):
        try:
            row = bench_kernel(spec, phase, shape, device, ceilings)
        except Exception as exc:  # one broken kernel must not hide the others' numbers
            check = f"{SKIPPED}does not fit ({free_gib(device)})" if does_not_fit(exc) else error_text(exc, "error: ")
            row = Measurement(spec.name, phase, shape_text(shape), "", float("nan"), check=check)
        settled = settle(device)
        row.outside_mib, row.stack_bytes = settled.get("outside_mib", float("nan")), settled.get("stack_bytes", 0)
        rows.append(row)

    report_rows: dict[str, list[dict]] = {}
    report_memory: dict[str, dict] = {}
    wanted_reports = {} if args.no_reports else {n: f for n, f in REPORTS.items() if not wanted or n in wanted}
    for name, fn in tqdm(wanted_reports.items(), desc="reports", file=sys.stderr, disable=not wanted_reports):
        try:
            report_rows[name] = fn(device, ceilings)
        except Exception as exc:
            report_rows[name] = ([{"skipped": f"does not fit ({free_gib(device)})"}] if does_not_fit(exc)
                                 else [{"error": error_text(exc)}])
        report_memory[name] = settle(device)

    interpreter = device.type != "cuda"
    note = ("Triton interpreter on the CPU: the checks are real, the times are the interpreter's (no speedups)"
            if interpreter else
            f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.bf16_tflops:.0f} TFLOP/s, "
            f"fp8 matmul {ceilings.fp8_tflops:.0f} TFLOP/s" if ceilings is not None else "")
    memory = memory_summary(rows, report_memory, device)
    line, ok = summary(rows, report_rows, memory)
    path = write_results(args.out, "bench", report_rows, note=note, lead=table(rows, interpreter) + "\n\n" + line,
                         data={"ceilings": None if ceilings is None else ceilings.__dict__,
                               "rows": [r.as_dict() for r in rows], "summary": line, "memory": memory,
                               "report_memory": report_memory})
    png = plot_bench(rows, path.with_suffix(".png"), interpreter=interpreter)
    print(path.read_text())
    print(f"wrote {path} (.json, {png.suffix})")
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
