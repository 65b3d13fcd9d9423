"""Check and time every registered kernel in one call: ``python -m dsa_triton.bench``.

On a GPU: measures the ceilings, then for each kernel, phase and realistic shape checks the launch
config against the reference on fresh random inputs and times it against the baseline in the same run.
Without a GPU: the same checks on tiny shapes in the Triton interpreter (times mean little there).
Prints a short table last and writes ``bench-<device>-<date>.json`` and ``.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from . import registry
from .harness import Ceilings, Measurement, graph_time_or_nan, measure_ceilings, measurement, rotation, time_rotating
from .runtime import default_device, environment


def shape_text(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def bench_kernel(spec: registry.KernelSpec, phase: str, shape: dict[str, int], device: torch.device,
                 ceilings: Ceilings | None) -> Measurement:
    """Check the launch config on fresh inputs, then time kernel and baseline over rotated input sets, eager and
    (on the GPU, when the call captures) replayed from CUDA graphs: an eager median of an op of few launches is
    mostly the host's launch path, whose speed moved up to 2.5x between minutes on the H200 host."""
    config = spec.launch_config(phase, shape, device)
    inputs = spec.make_inputs(phase, shape, device, 1234)
    error = spec.compare(spec.run(inputs, config), spec.reference(inputs))
    cost = spec.cost(phase, shape)
    sets = rotation(lambda i: spec.make_inputs(phase, shape, device, i), cost.bytes, device)
    run = lambda s: spec.run(s, config)  # noqa: E731
    median, graph = time_rotating(run, sets, device), graph_time_or_nan(run, sets, device)
    base_us = graph_base_us = float("nan")
    if spec.baseline is not None:
        base_us = time_rotating(spec.baseline, sets, device)
        graph_base_us = graph_time_or_nan(spec.baseline, sets, device)
    return measurement(kernel=spec.name, phase=phase, shape=shape_text(shape), config=json.dumps(config),
                       median_us=median, cost=cost, ceilings=ceilings, baseline=spec.baseline_name,
                       baseline_us=base_us, check=error or "ok", graph_us=graph, graph_baseline_us=graph_base_us)


def fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x or math.isinf(x) else f"{x:.{digits}f}"


def table(rows: list[Measurement]) -> str:
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


def dict_table(items: list[dict]) -> str:
    """A markdown table of report rows (the union of their keys, in first-seen order)."""
    cols = list(dict.fromkeys(k for row in items for k in row))
    cell = lambda v: fmt(v, 3) if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |" for row in items]
    return "\n".join(lines)


def write_results(out: str | Path, stem: str, sections: dict[str, list[dict[str, Any]]], *, note: str = "",
                  lead: str = "", data: dict[str, Any] | None = None) -> Path:
    """Write ``<out>/<stem>-<device>-<UTC date>.json`` and ``.md``, stamped with the environment; returns the .md.

    JSON: ``date``, ``environment``, ``note``, ``data``'s items and one list of rows per section. Markdown: a
    title, the environment, ``note``, ``lead`` (a ready table) and one :func:`dict_table` per section.
    """
    env = environment()
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{env['device']}-{stamp:%Y%m%d-%H%M%S}"
    payload = {"date": stamp.isoformat(timespec="seconds"), "environment": env, "note": note, **(data or {}),
               **sections}
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    text = [f"# {stem} on {env['device']}, {payload['date']}", "", " ".join(f"{k}={v}" for k, v in env.items())]
    for part in (note, lead):
        if part:
            text += ["", part]
    for name, rows in sections.items():
        text += ["", f"## {name}", "", dict_table(rows) if rows else "(nothing)"]
    path.with_suffix(".md").write_text("\n".join(text) + "\n")
    return path.with_suffix(".md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_triton.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="", help="comma-separated kernel names (default: all registered)")
    parser.add_argument("--out", default="results", help="folder for the results files (default: results/)")
    parser.add_argument("--no-ceilings", action="store_true", help="skip measuring the GPU ceilings")
    args = parser.parse_args(argv)

    import dsa_triton  # noqa: F401  (registers every kernel)
    from tqdm import tqdm

    device = default_device()
    ceilings = None
    if device.type == "cuda" and not args.no_ceilings:
        ceilings = measure_ceilings(device)
    wanted = [n for n in args.kernels.split(",") if n]
    kernel_names = [n for n in wanted if n not in registry.reports()]  # the rest name reports
    specs = [registry.get(n) for n in kernel_names] if wanted else registry.kernels()
    jobs = [(s, p, shape) for s in specs for p in s.phases for shape in s.bench_shapes(p, device.type == "cuda")]
    rows: list[Measurement] = []
    for spec, phase, shape in tqdm(jobs, desc="bench", file=sys.stderr, disable=not jobs):
        try:
            rows.append(bench_kernel(spec, phase, shape, device, ceilings))
        except Exception as exc:  # one broken kernel must not hide the others' numbers
            rows.append(Measurement(spec.name, phase, shape_text(shape), "", float("nan"), check=f"error: {exc!r}"[:300]))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report_rows: dict[str, list[dict]] = {}
    wanted_reports = {n: f for n, f in registry.reports().items() if not wanted or n in wanted}
    for name, fn in tqdm(wanted_reports.items(), desc="reports", file=sys.stderr, disable=not wanted_reports):
        try:
            report_rows[name] = fn(device, ceilings)
        except Exception as exc:
            report_rows[name] = [{"error": repr(exc)[:300]}]
        if device.type == "cuda":
            torch.cuda.empty_cache()

    note = "" if ceilings is None else (
        f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.bf16_tflops:.0f} TFLOP/s, "
        f"fp8 matmul {ceilings.fp8_tflops:.0f} TFLOP/s")
    path = write_results(args.out, "bench", report_rows, note=note, lead=table(rows),
                         data={"ceilings": None if ceilings is None else ceilings.__dict__,
                               "rows": [r.as_dict() for r in rows]})
    print(path.read_text())
    print(f"wrote {path} and .json")
    failed = any(r.check != "ok" for r in rows) or any("error" in row for v in report_rows.values() for row in v)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
