"""``dsa-tune day0``: a new model's config.json to a tuned database and first generated tokens, each stage timed.

Plan (the jobs of the config's shapes), tune (on a GPU in a child process, so that its memory is back before the
runner loads the weights), generate (the model runner in a subprocess reading the database just tuned, from
``--checkpoint`` or random weights at the config's widths), then one results file. ``--budget`` bounds the plan and
tune stages together (it counts from the command's start); jobs the budget does not reach keep the nearest stored
record or the default, and the tokens are generated all the same.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

INTERRUPT_GRACE_S = 5.0  # after Ctrl-C, how long the tuning process has to end by itself
DAY0_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 4, 3], [7] * 40)  # token ids: any vocabulary has them


def cmd_day0(args: argparse.Namespace) -> int:
    """Tune a new model's kernels within a budget, then generate a few tokens with the model runner in a subprocess
    that reads the database just tuned: from ``--checkpoint``, else from random weights at the config's widths
    (``--layers`` layers, drawn on the device). Prints each stage's time and writes one results file
    (:func:`day0_results`); 1 when a job failed or the runner did."""
    import time

    start = time.monotonic()  # the plan stage: the imports (torch, Triton, the kernels), the device, the jobs
    import tempfile

    from .jobs import build_jobs, setup
    from .shapes import model_path

    if args.checkpoint and args.random_weights:
        raise ValueError("--checkpoint and --random-weights exclude each other")
    if not args.model:
        if not args.checkpoint:
            raise ValueError("--model or --checkpoint: the config.json to derive the shapes from")
        args.model = str(Path(args.checkpoint) / "config.json")
    stages: list[dict] = []

    def stage(name: str, start: float, detail: str) -> None:
        stages.append({"stage": name, "seconds": time.monotonic() - start, "detail": detail})
        print(f"day0 {name}: {detail} ({stages[-1]['seconds']:.1f} s)", flush=True)

    device, db = setup(args)
    model = model_path(args.model)
    if not args.checkpoint:  # the runner builds the random model from this config: one it cannot read fails now
        from model_runner import ModelConfig, RunnerError
        from model_runner.random_weights import reduced

        try:
            reduced(ModelConfig.from_json(model), args.layers)
        except RunnerError as exc:
            raise ValueError(f"--model {model}: the runner cannot build random weights from it: {exc}") from None
    jobs = build_jobs(args, device)
    stage("plan", start, f"{len(jobs)} jobs from {model}")

    start = time.monotonic()
    tuned = tune_in_child(args) if device.type == "cuda" else tune_stage(args, device, db, jobs)
    stage("tune", start, f"budget {args.budget:.0f} s; {tuned['records']} of {len(jobs)} jobs have a record in "
          f"{db.folder}")

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="day0-") as tmp:
        generated, code = run_generate(args, model, db.folder, Path(tmp))
    stats = generated["stats"] or {}
    build = f"model build {stats['build_s']:.1f} s, " if stats else ""
    weights = args.checkpoint or f"random weights, {args.layers} layers"
    stage("generate", start, f"{weights}: {build}{sum(len(o['token_ids']) for o in generated['outputs'])} tokens "
          f"generated, exit status {code}")
    path = day0_results(args, model, tuned["rows"], stages, generated)
    print(f"wrote {path} and .json")
    return tuned["failed"] or code


def tune_stage(args: argparse.Namespace, device, db, jobs: list) -> dict:
    """Tune ``jobs`` as ``args`` say: ``{"rows": summary rows (:func:`tuner.tune.summary_rows`), "failed": 1 when a
    job failed, "records": jobs with an exact record}``, plain data."""
    from dsa_triton.runtime import device_name

    from .jobs import any_failed, run_tune
    from .tune import summary_rows

    results = run_tune(args, jobs, device, db)
    records = sum(1 for j in jobs if (m := db.match(j.spec, j.phase, j.shape, device_name(device))) and m[0] == "exact")
    return {"rows": summary_rows(results), "failed": any_failed(results), "records": records}


def _tune_stage_to(args: argparse.Namespace, connection) -> None:
    """The child's side: its own device, database and jobs (a job's kernel spec does not cross processes). Ctrl-C or
    SIGTERM ends it quietly (the parent says so)."""
    from .jobs import build_jobs, setup, sigterm_interrupts

    try:
        with sigterm_interrupts():
            device, db = setup(args)
            connection.send(tune_stage(args, device, db, build_jobs(args, device)))
    except KeyboardInterrupt:
        sys.exit(130)


def tune_in_child(args: argparse.Namespace) -> dict:
    """:func:`tune_stage` in a child process (spawned): the GPU memory tuning took (input sets, graph pools, what a
    cache may keep) goes back with it, whole, before the runner loads the model's weights: ``gc.collect()`` and
    ``torch.cuda.empty_cache()`` in the tuning process do not give all of it back."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_tune_stage_to, args=(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                                              if k != "func"}), send))
    child.start()
    send.close()
    try:
        return receive.recv()
    except EOFError:
        raise RuntimeError(f"the tune stage's process ended without a result (exit status {child.exitcode})") from None
    except KeyboardInterrupt:  # Ctrl-C reaches the child too and it ends; a SIGTERM to this process alone does not
        child.join(timeout=INTERRUPT_GRACE_S)
        if child.is_alive():
            child.terminate()  # SIGTERM: the child ends as after Ctrl-C
        raise
    finally:
        child.join()


def run_generate(args: argparse.Namespace, model, db_folder, folder) -> tuple[dict, int]:
    """``python -m model_runner generate`` on ``--checkpoint`` or on random weights of ``model`` (a config.json),
    with its files in ``folder``, reading the database in ``db_folder``; returns ({"outputs": its result lines,
    "stats": its ``--stats`` or None}, its exit status)."""
    import json
    import os
    import subprocess

    prompts, out, stats = args.prompts or folder / "prompts.jsonl", folder / "generated.jsonl", folder / "stats.json"
    if not args.prompts:
        prompts.write_text("".join(json.dumps(p) + "\n" for p in DAY0_PROMPTS))
    source = (["--model", args.checkpoint] if args.checkpoint else
              ["--model", str(model), "--random-weights", "--layers", str(args.layers)])
    command = [sys.executable, "-m", "model_runner", "generate", *source, "--prompts", str(prompts), "--out", str(out),
               "--stats", str(stats), "--max-new-tokens", str(args.max_new_tokens),
               *(["--no-progress"] if args.no_progress else []), *args.runner_args]
    print(f"day0 generate: {' '.join(command)}", flush=True)
    env = {**os.environ, "DSA_TUNING_DB": str(db_folder.resolve())}  # the runner's ops read this database
    code = subprocess.run(command, env=env).returncode
    outputs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {"outputs": outputs, "stats": json.loads(stats.read_text()) if stats.exists() else None}, code


def day0_results(args: argparse.Namespace, model, rows: list[dict], stages: list[dict], generated: dict):
    """Print the stages and write the day0 results file (:func:`dsa_triton.bench.results.write_results` into
    ``--out``, ``--flat``); returns its .md path. Sections: ``stages`` (plan, tune, generate with the model build,
    total: wall seconds), ``speedup`` (per job: the record's time and the default config's, both timed in the
    record's final run, :func:`tuner.tune.summary_rows`), ``generated`` (the runner's result lines: token ids per
    prompt), ``throughput`` (tokens/s by step kind; the first step of a kind includes compiling its kernels, so
    also decode after its first step). Data: the model and its config, the geometric-mean speedup, optuna's
    version, the command."""
    import json
    import math
    import statistics

    import optuna

    from dsa_triton.bench.results import write_results

    total = sum(s["seconds"] for s in stages)
    stages = [*stages, {"stage": "total", "seconds": total, "detail": ""}]
    for s in stages:
        print(f"{s['stage']:>8}: {s['seconds']:8.1f} s  {s['detail']}")
    ratios = [r["tuned/default"] for r in rows if math.isfinite(r["tuned/default"])]
    geomean = statistics.geometric_mean(ratios) if ratios else math.nan
    stats = generated["stats"] or {}
    throughput = [{"kind": kind, "tokens": t["tokens"], "seconds": t["seconds"]}
                  for kind, t in (stats.get("throughput") or [{}])[0].items()]
    later = [s for s in stats.get("steps", []) if s["kind"] == "decode"][1:]
    if later:
        throughput.append({"kind": "decode after the first step", "tokens": sum(s["tokens"] for s in later),
                           "seconds": sum(s["seconds"] for s in later)})
    for row in throughput:
        row["tokens_per_s"] = row["tokens"] / row["seconds"] if row["seconds"] else math.nan
    weights = args.checkpoint or f"random weights ({args.layers} layers at the config's widths)"
    note = (f"day0 {model}: {len(rows)} jobs within a {args.budget:.0f} s budget, then {args.max_new_tokens} new "
            f"tokens a prompt from {weights}; total {total:.0f} s. Tuned database over the default configs on these "
            f"shapes: geometric mean {geomean:.3f}x over the {len(ratios)} of {len(rows)} jobs with both times "
            f"(a default that fails the reference check has none).")
    print(note)
    data = {"model": str(model), "config": json.loads(model.read_text()), "checkpoint": args.checkpoint or None,
            "random_layers": None if args.checkpoint else args.layers, "budget_s": args.budget,
            "geomean_tuned_over_default": geomean, "total_s": total, "optuna": optuna.__version__,
            "command": ["dsa-tune", *args.argv], "runner": {k: stats.get(k) for k in ("notes", "cuda_graphs",
                                                                                      "memory_mib")}}
    return write_results(args.out, "day0", {"stages": stages, "speedup": rows, "generated": generated["outputs"],
                                            "throughput": throughput}, note=note, data=data, flat=args.flat)


