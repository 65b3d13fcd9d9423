"""``dsa-tune``: the tuner's command line.

- ``env``: device, versions, interpreter state, registered kernels;
- ``tune``: search configs per (kernel, phase, shape) and store the winners in the tuning database;
- ``show``: the stored records, with tuned-over-default speedups;
- ``bench``: every stored record re-timed: tuned vs default vs baseline (a table and a results file);
- ``merge``: record files into the database (atomic);
- ``compare``: exhaustive best vs the TPE sampler on one space (trials to come within 5%);
- ``day0``: a new model's config.json to tuned kernels within a budget, then a few generated tokens (from its
  checkpoint, or random weights at its widths), with each stage's time and the tuned-over-default speedups.

Without a GPU everything runs in the Triton interpreter on the kernels' tiny bench shapes with few trials.
Bad arguments end with one line and exit status 2; Ctrl-C (or SIGTERM) with one line and 130 (143).
"""
from __future__ import annotations

import argparse
import math
import sys

from dsa_triton.runtime import prefer_expandable_segments

from .day0 import INTERRUPT_GRACE_S, cmd_day0
from .jobs import Terminated, any_failed, build_jobs, names, run_tune, setup, sigterm_interrupts

SHARD_HELP = "I/N: tune only every N-th job starting at I (one process per GPU, all writing to one database)"


UNITS = {"s": 1, "m": 60, "h": 3600}
DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)"


def duration(text: str) -> float:
    """Seconds from ``"20m"``, ``"90s"``, ``"1h"``, ``"1h30m"`` or plain seconds (``"450"``, ``"7.5"``)."""
    import re

    text = text.strip().lower()
    if not re.fullmatch(rf"(?:{DURATION_PART}\s*)+", text):
        raise argparse.ArgumentTypeError(f"expected a duration like 20m, 90s, 1h or seconds, got {text!r}")
    return sum(float(number) * UNITS[unit or "s"] for number, unit in re.findall(DURATION_PART, text))


def cmd_env(args: argparse.Namespace) -> int:
    import dsa_triton
    from dsa_triton.runtime import environment

    for key, value in environment().items():
        print(f"{key}: {value}")
    print(f"kernels: {', '.join(s.name for s in dsa_triton.registry.kernels()) or '(none registered)'}")
    return 0


def without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` less ``name VALUE`` and ``name=VALUE``."""
    out, skip = [], False
    for a in argv:
        if not skip and a != name and not a.startswith(name + "="):
            out.append(a)
        skip = a == name
    return out


def run_on_gpus(args: argparse.Namespace) -> int:
    """``tune --gpus N``: N child processes, one per GPU, each tuning its shard into the same database."""
    import os
    import subprocess
    import threading

    if args.shard:
        raise ValueError("--gpus and --shard exclude each other (--gpus sets the shards)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.gpus)))).split(",")
    if len(visible) < args.gpus:
        raise ValueError(f"--gpus {args.gpus}: only {len(visible)} devices are visible ({','.join(visible)})")
    argv = without_option(args.argv, "--gpus")
    children = [subprocess.Popen([sys.executable, "-m", "tuner.cli", *argv, "--shard", f"{i}/{args.gpus}", "--no-progress"],
                                 env={**os.environ, "CUDA_VISIBLE_DEVICES": visible[i]}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for i in range(args.gpus)]

    stopped = threading.Event()  # after Ctrl-C: the children's last lines are not relayed

    def relay(i: int, child: subprocess.Popen) -> None:
        for line in child.stdout:
            if not stopped.is_set():
                print(f"[gpu {visible[i]}] {line}", end="", flush=True)

    threads = [threading.Thread(target=relay, args=(i, c), daemon=True) for i, c in enumerate(children)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:  # Ctrl-C reaches the children too and they end; a SIGTERM to this process alone does not
        stopped.set()
        for child in children:
            try:
                child.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                child.terminate()  # SIGTERM: it ends as after Ctrl-C
                child.wait()
        raise
    return max(c.wait() for c in children)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.gpus > 1:
        return run_on_gpus(args)
    device, db = setup(args)
    jobs = build_jobs(args, device)
    if args.list:
        for job in jobs:
            print(job)
        print(f"{len(jobs)} jobs")
        return 0
    return any_failed(run_tune(args, jobs, device, db))


def known_kernels(text: str, stored: set[str] = frozenset()) -> list[str]:
    """The kernel names of ``--kernels``, each registered or in ``stored`` (names of stored records); raises
    ``ValueError`` naming the first unknown one."""
    from dsa_triton import registry

    wanted, registered = names(text), {s.name for s in registry.kernels()}
    unknown = [n for n in wanted if n not in registered | set(stored)]
    if unknown:
        raise ValueError(f"--kernels: no kernel {unknown[0]!r}; registered: {', '.join(sorted(registered))}")
    return wanted


def cmd_show(args: argparse.Namespace) -> int:
    from dsa_triton.bench.results import dict_table
    from dsa_triton.runtime import device_name

    device, db = setup(args)
    kernels = known_kernels(args.kernels, {r.kernel for r in db.records()})
    records = db.records(None if args.device == "all" else args.device or device_name(device))
    rows = [{"device": r.device, "kernel": r.kernel, "phase": r.phase, "shape": r.shape, "config": r.config,
             "us": r.median_us, "default us": r.default_us, "tuned/default": r.speedup(),
             "baseline/tuned": r.baseline_us / r.median_us, "timing": r.timing, "configs run": r.trials,
             "status": r.status, "code": "fresh" if db.is_fresh(r) else "stale", "date": r.date}
            for r in records if not kernels or r.kernel in kernels]
    if args.plot and not rows:
        raise ValueError(f"--plot: no records to plot in {db.folder}")
    print(f"{len(rows)} records in {db.folder}")
    others = [d for d in db.devices() if args.device != "all" and d != (args.device or device_name(device))]
    if others:
        print(f"records for other devices: {', '.join(others)} (--device NAME or --device all)")
    if rows and args.plot:
        from .plot import plot_records

        print(f"wrote {plot_records(rows, args.plot)}")
    if rows:
        print(dict_table(rows))
        speedups = [r["tuned/default"] for r in rows if not math.isnan(r["tuned/default"])]
        if speedups:
            geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
            print(f"tuned/default: geometric mean {geo:.3f}, min {min(speedups):.3f}, max {max(speedups):.3f}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dsa_triton.bench.results import dict_table, write_results

    from .bench_db import bench

    device, db = setup(args)
    rows = bench(db, device, known_kernels(args.kernels))
    print(dict_table(rows) if rows else f"no stored records for this device in {db.folder}")
    path = write_results(args.out, "tuned", {"tuned vs default vs baseline": rows}, note=f"database: {db.folder}")
    print(f"wrote {path} and .json")
    return 1 if any(r["check"] != "ok" for r in rows) else 0


def cmd_merge(args: argparse.Namespace) -> int:
    _, db = setup(args)
    n = db.merge_files(args.files)
    print(f"merged {n} records from {len(args.files)} files into {db.folder}: {len(db.records())} records now")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dsa_triton.bench.results import dict_table, write_results

    from .compare import compare_kernel

    device, _ = setup(args)
    jobs = build_jobs(args, device)
    if not args.shapes and not args.model:  # one shape per kernel and phase: an exhaustive search is costly
        jobs = list({(j.spec.name, j.phase): j for j in reversed(jobs)}.values())[::-1]
    summaries, runs = [], []
    for job in jobs:
        print(f"compare {job}")
        summary, rows = compare_kernel(job.spec, job.phase, job.shape, device, samplers=tuple(names(args.samplers)),
                                       repeats=args.repeats, progress=not args.no_progress,
                                       workers=args.workers)
        summaries.append(summary)
        runs += rows
    print(dict_table(summaries))
    path = write_results(args.out, "compare", {"summary": summaries, "sampler runs": runs},
                         note="samplers replayed on the exhaustive measurements; runs = configs run until within 5%")
    print(f"wrote {path} and .json")
    return 0


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: every registered one)")
    p.add_argument("--phases", default="", help="comma-separated phases (default: each kernel's phases)")
    p.add_argument("--shapes", action="append", default=[],
                   help='shapes like "B=64,L=131072" (";" separates several; the option repeats); their dims are '
                        "laid over the model's or the bench shapes")
    p.add_argument("--model", default="", help="a config.json, or a model of tuner/models (deepseek-v3.2): derive "
                   "every shape the model needs")
    p.add_argument("--set", default="", help='dims that override or complete derived shapes, e.g. "P=64"')
    p.add_argument("--batches", default="", help="decode batch sizes for --model (default: 1, 2, 4 ... 128)")
    p.add_argument("--contexts", default="", help="context lengths for --model (default: 4096, 8192 ... 131072)")
    p.add_argument("--chunks", default="", help="prefill chunk sizes for --model (default: 512, 1024 ... 16384)")
    p.add_argument("--shard", default="", help=SHARD_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--workers", type=int, default=0,
                   help="processes that compile configs in parallel before an exhaustive search on a GPU "
                        "(default: up to 8; 1: none)")


BUDGET_HELP = ("time for the whole run, counted from the command's start (20m, 90s, 1h or seconds): first a record "
               "for every shape from the configs known for it (nearest tuned shape, default), biggest expected gain "
               "first, then searches where the default is furthest from the floor; shapes the budget does not reach "
               "keep the nearest record or the default; runs resume, so budgets of several runs add up "
               "(tuning_db/README.md)")


def _tune_args(p: argparse.ArgumentParser, db_help: str) -> None:
    """The job and search options of ``tune`` and ``day0``."""
    _job_args(p)
    p.add_argument("--db", default=None, help=db_help)
    p.add_argument("--sampler", default="auto",
                   help="auto (exhaustive when the valid space fits in --trials, else tpe), tpe, exhaustive, random")
    p.add_argument("--trials", type=int, default=0, help="configs to run per shape (default 40; interpreter 4)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per shape")
    p.add_argument("--storage", default=".optuna", help='Optuna journal folder ("none": in memory)')
    p.add_argument("--retune", action="store_true", help="tune shapes that already have a fresh record too")
    p.add_argument("--seed", type=int, default=0, help="sampler seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa-tune", description="Tune dsa-triton kernels per device, phase and shape.")
    sub = parser.add_subparsers(dest="command", required=True)
    db_help = "tuning database folder (default: $DSA_TUNING_DB, else tuning_db/data)"

    env = sub.add_parser("env", help="print the device, torch/triton versions, interpreter state and kernels")
    env.set_defaults(func=cmd_env)

    tune = sub.add_parser("tune", help="tune kernels and store the best configs")
    _tune_args(tune, db_help)
    tune.add_argument("--budget", type=duration, default=None, help=BUDGET_HELP)
    tune.add_argument("--list", action="store_true", help="only list the jobs")
    tune.add_argument("--gpus", type=int, default=1,
                      help="run N processes, one per visible GPU, each on its shard of the jobs (one database); "
                           "on a 2-GPU H200 host they slowed each other's compute-bound kernels (tuning_db/README.md)")
    tune.set_defaults(func=cmd_tune)

    day0 = sub.add_parser("day0", help="a new model: tune its kernels within a budget, then generate a few tokens",
                          description="Tune every kernel and shape a model needs within --budget (as tune --model "
                                      "--budget), then run `python -m model_runner generate` in a subprocess with "
                                      "the database just tuned, on --checkpoint or else on random weights at the "
                                      "config's widths; prints each stage's time and writes one results file "
                                      "(stages, tuned-over-default speedup per job, tokens, tokens/s).")
    _tune_args(day0, db_help)
    day0.add_argument("--budget", type=duration, default=duration("20m"), help=BUDGET_HELP + " (default 20m)")
    day0.add_argument("--checkpoint", default="", help="the model's checkpoint folder (Hugging Face layout); "
                      "--model defaults to its config.json")
    day0.add_argument("--random-weights", action="store_true", help="generate from random weights drawn on the "
                      "device at the config's widths (the default without --checkpoint)")
    day0.add_argument("--layers", type=int, default=4, help="random weights: layers, the config's dense layers "
                      "capped to one, then MoE layers (default 4)")
    day0.add_argument("--prompts", default="", help="JSON-lines prompts for the runner (default: three token-id "
                      "prompts of 12, 3 and 40 tokens)")
    day0.add_argument("--out", default="results", help="folder for the results file")
    day0.add_argument("--flat", action="store_true", help="write straight into --out (no <device>/<date> folders)")
    day0.add_argument("--max-new-tokens", type=int, default=16)
    day0.add_argument("--runner-args", nargs=argparse.REMAINDER, default=[],
                      help="the rest of the command line goes to model_runner generate as it is")
    day0.set_defaults(func=cmd_day0)

    show = sub.add_parser("show", help="table of stored records")
    show.add_argument("--db", default=None, help=db_help)
    show.add_argument("--device", default="", help='device name (default: this one; "all": every device)')
    show.add_argument("--kernels", default="", help="comma-separated kernel names")
    show.add_argument("--plot", default="", metavar="PNG", help="also draw tuned vs default per shape into this PNG")
    show.set_defaults(func=cmd_show)

    bench = sub.add_parser("bench", help="tuned vs default vs baseline for every stored record of this device")
    bench.add_argument("--db", default=None, help=db_help)
    bench.add_argument("--kernels", default="", help="comma-separated kernel names")
    bench.add_argument("--out", default="results", help="folder for the results files")
    bench.set_defaults(func=cmd_bench)

    merge = sub.add_parser("merge", help="merge record files into the database (keeps the faster per shape)")
    merge.add_argument("files", nargs="+", help="record CSV files (any device)")
    merge.add_argument("--db", default=None, help=db_help)
    merge.set_defaults(func=cmd_merge)

    compare = sub.add_parser("compare", help="exhaustive best vs TPE: configs run to come within 5%%")
    _job_args(compare)
    compare.add_argument("--samplers", default="tpe,random", help="samplers to replay")
    compare.add_argument("--repeats", type=int, default=5, help="sampler seeds per sampler")
    compare.add_argument("--out", default="results", help="folder for the results files")
    compare.add_argument("--db", default=None, help=db_help)
    compare.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    import time

    started = time.time()  # a --budget counts from here
    prefer_expandable_segments()
    args = build_parser().parse_args(argv)
    args.argv, args.started = [str(a) for a in (sys.argv[1:] if argv is None else argv)], started
    try:
        with sigterm_interrupts():
            return args.func(args)
    except (ValueError, KeyError) as exc:  # bad arguments (shapes, model config, kernel names): one line
        print(f"dsa-tune {args.command}: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line (the studies resume on the next run)
        terminated = isinstance(exc, Terminated)
        print(f"dsa-tune {args.command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130


if __name__ == "__main__":
    sys.exit(main())
