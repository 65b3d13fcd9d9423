"""Given configs of registered kernels against their launch config, checked and timed in one run (a kernel change's
first GPU measurement, before any retune).

    python scripts/config_sweep.py --kernels sparse_attention_decode,sparse_attention_prefill \
        --variants '{"TOKEN_MAJOR": 1}' '{"TOKEN_MAJOR": 1, "num_stages": 1}' [--shapes B=64] [--out $OUT]

For every kernel, phase and GPU bench shape (``--shapes``: only shapes whose text holds one of the given strings):
the launch config (the tuning database's, else the default) and each variant, a dict laid over the launch config.
A variant the spec rejects for the shape gets its row with the reason. Each config is checked against the
reference on fresh inputs, then timed over rotated input sets (replayed from CUDA graphs when the op captures,
else eager), with its ratio to the launch config's time in the same run and its fraction of the floor (ceilings
measured in the same run). Prints the table last; writes ``config-sweep-<device>-<stamp>.json|md`` (``--out``,
flat).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sweep_rows(spec, phase: str, shape: dict, variants: list[dict], device, ceilings) -> list[dict]:
    """One row per config (the launch config first): check, time, ratio to the launch config, floor fraction."""
    from dsa_triton.bench.harness import floor_us, rotation, timed_us
    from dsa_triton.registry import ConfigError, shape_text

    launch = spec.launch_config(phase, shape, device)
    cost = spec.cost(phase, shape)
    floor, bound = floor_us(cost, ceilings)
    sets = rotation(lambda i: spec.make_inputs(phase, shape, device, i), cost.bytes, device)
    reference = spec.reference(spec.make_inputs(phase, shape, device, 1234))
    rows, launch_us = [], float("nan")
    for label, config in [("launch", launch)] + [(json.dumps(v), {**launch, **v}) for v in variants]:
        row = {"kernel": spec.name, "shape": shape_text(shape), "variant": label, "config": json.dumps(config)}
        try:
            spec.validate(config, shape)
        except ConfigError as exc:
            rows.append({**row, "check": f"invalid: {exc}"[:200]})
            continue
        try:
            check = spec.compare(spec.run(spec.make_inputs(phase, shape, device, 1234), config), reference) or "ok"
            us, mode = timed_us(lambda s: spec.run(s, config), sets, device)
        except Exception as exc:  # a config that fails fails its row, with the error
            rows.append({**row, "check": f"error: {exc!r}"[:300]})
            continue
        if label == "launch":
            launch_us = us
        rows.append({**row, "us": round(us, 2), "mode": mode, "launch_over_this": round(launch_us / us, 3),
                     "of_floor": round(floor / us, 3), "bound": bound, "check": check})
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", required=True, help="comma-separated registered kernel names")
    parser.add_argument("--variants", nargs="+", type=json.loads, default=[],
                        help="JSON dicts laid over each shape's launch config")
    parser.add_argument("--shapes", nargs="*", default=[], help="keep shapes whose text holds one of these")
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = parser.parse_args(argv)

    import dsa_triton  # noqa: F401  (registers every kernel)
    from tqdm import tqdm

    from dsa_triton import registry
    from dsa_triton.bench.harness import measure_ceilings
    from dsa_triton.bench.results import dict_table, write_results
    from dsa_triton.registry import shape_text

    if not torch.cuda.is_available():
        parser.error("needs a GPU (the interpreter's times say nothing about a config's speed)")
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    jobs = [(spec, phase, shape) for spec in map(registry.get, args.kernels.split(",")) for phase in spec.phases
            for shape in spec.bench_shapes(phase, True)
            if not args.shapes or any(s in shape_text(shape) for s in args.shapes)]
    rows = []
    for spec, phase, shape in tqdm(jobs, desc="sweep", file=sys.stderr):
        rows += sweep_rows(spec, phase, shape, args.variants, device, ceilings)
    note = (f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 {ceilings.bf16_tflops:.0f} TFLOP/s, "
            f"fp8 {ceilings.fp8_tflops:.0f} TFLOP/s")
    write_results(args.out, "config-sweep", {"configs": rows}, note=note, flat=True)
    print(note)
    print(dict_table([{k: r.get(k, "-") for k in ("kernel", "shape", "variant", "us", "mode", "launch_over_this",
                                                   "of_floor", "check")} for r in rows]))
    return int(any(r["check"] != "ok" for r in rows if not r["check"].startswith("invalid")))


if __name__ == "__main__":
    sys.exit(main())
