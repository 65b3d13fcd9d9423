"""Every registered kernel at its small and odd shapes on the GPU: the default config and random valid configs,
each checked against the reference on fresh random inputs (``python scripts/gpu_check.py [--configs N]``).

The shapes are the kernels' CPU bench shapes (sizes that are no multiple of any tile), the ones the interpreter
tests use: a kernel right in the interpreter and wrong on the GPU shows here. ``--defaults-only`` runs one config
per shape (for compute-sanitizer, which is slow). Prints one line per failure and a closing count; writes the
rows as JSON under ``--out`` (default ``$OUT`` or ``results``). Exit 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch


def configs_to_run(spec, phase: str, shape: dict, n_random: int, seed: int) -> list[tuple[str, dict]]:
    """The launch config (database, else default), the default, and ``n_random`` distinct random valid configs."""
    chosen = [("launch", spec.launch_config(phase, shape, "cuda")), ("default", dict(spec.default(phase, shape)))]
    rng = random.Random(seed)
    names = list(spec.space)
    tries = 0
    while len(chosen) < 2 + n_random and tries < 200 * (n_random + 1):
        tries += 1
        config = {n: rng.choice(spec.space[n]) for n in names}
        if spec.is_valid(config, shape) and all(config != c for _, c in chosen):
            chosen.append((f"random{len(chosen) - 2}", config))
    unique = []
    for label, config in chosen:
        if all(config != c for _, c in unique):
            unique.append((label, config))
    return unique


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=4, help="random valid configs per shape (beside the default)")
    parser.add_argument("--defaults-only", action="store_true", help="only the launch config (for compute-sanitizer)")
    parser.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    parser.add_argument("--seeds", type=int, default=2, help="fresh input sets per config")
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = parser.parse_args(argv)

    import dsa_triton  # noqa: F401  (registers every kernel)
    from dsa_triton import registry
    from dsa_triton.bench.results import git_state
    from dsa_triton.registry import shape_text
    from dsa_triton.runtime import environment

    assert torch.cuda.is_available(), "scripts/gpu_check.py needs a GPU"
    wanted = [n for n in args.kernels.split(",") if n]
    specs = [registry.get(n) for n in wanted] if wanted else registry.kernels()
    rows, failures = [], 0
    start = time.time()
    for spec in specs:
        for phase in spec.phases:
            for shape in spec.bench_shapes(phase, False):
                configs = configs_to_run(spec, phase, shape, 0 if args.defaults_only else args.configs, 7)
                if args.defaults_only:
                    configs = configs[:1]
                for label, config in configs:
                    for seed in range(args.seeds):
                        row = {"kernel": spec.name, "phase": phase, "shape": shape_text(shape), "which": label,
                               "config": config, "seed": seed}
                        try:
                            inputs = spec.make_inputs(phase, shape, torch.device("cuda"), 1000 + seed)
                            out = spec.run(inputs, config)
                            torch.cuda.synchronize()
                            row["check"] = spec.compare(out, spec.reference(inputs)) or "ok"
                        except Exception as exc:  # a launch that fails is a failure of its row
                            row["check"] = f"error: {exc!r}"[:300]
                        rows.append(row)
                        if row["check"] != "ok":
                            failures += 1
                            print(f"FAIL {spec.name} {phase} {row['shape']} {label} {json.dumps(config)} "
                                  f"seed {seed}: {row['check']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu-check-defaults" if args.defaults_only else "gpu-check"
    payload = {"environment": environment(), "git": git_state(), "seconds": time.time() - start, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    kernels = len({r["kernel"] for r in rows})
    print(f"{len(rows) - failures}/{len(rows)} checks ok over {kernels} kernels "
          f"({len({(r['kernel'], r['shape'], json.dumps(r['config'])) for r in rows})} kernel-shape-configs)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
