"""What ``dsa-tune tune`` and ``dsa-tune day0`` share: the database and device, the jobs the arguments ask for, a
tuning run with its summary, and SIGTERM taken as an interrupt."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it ends as after Ctrl-C (a trial in progress is not left
    running in its study's journal)."""


def _terminate(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within: SIGTERM raises :class:`Terminated` (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


def setup(args: argparse.Namespace):
    """Import the kernels and make the chosen database the one ops read; returns (device, db)."""
    import dsa_triton  # noqa: F401  (registers every kernel)
    from dsa_triton import registry
    from dsa_triton.runtime import default_device

    return default_device(), registry.use_database(args.db)


def names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def specs(args: argparse.Namespace):
    from dsa_triton import registry

    wanted = names(args.kernels)
    return [registry.get(n) for n in wanted] if wanted else registry.kernels()


def build_jobs(args: argparse.Namespace, device) -> list:
    """The (kernel, phase, shape) jobs the arguments ask for, in order (then this shard's share)."""
    from tuning_db import shape_from_text

    from .shapes import (CONTEXTS, DECODE_BATCHES, PREFILL_CHUNKS, job_shapes, load_model_config, model_shapes,
                         parse_ints, parse_shapes)
    from .tune import Job

    given = parse_shapes(args.shapes)
    overrides = shape_from_text(args.set)
    model = load_model_config(args.model) if args.model else None
    counts = {name: parse_ints(getattr(args, name)) or default
              for name, default in (("batches", DECODE_BATCHES), ("contexts", CONTEXTS), ("chunks", PREFILL_CHUNKS))}
    phases = names(args.phases)
    jobs, notes = [], []
    for spec in specs(args):
        for phase in [p for p in spec.phases if not phases or p in phases]:
            if model is not None:
                templates = model_shapes(spec, phase, model, overrides, counts["batches"], counts["contexts"],
                                         counts["chunks"], notes)
            else:
                templates = spec.bench_shapes(phase, device.type == "cuda")
            shapes = job_shapes(spec, phase, given=given, templates=templates, overrides=overrides)
            jobs += [Job(spec, phase, s) for s in shapes]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.shard:
        parts = parse_ints(args.shard.replace("/", ","))
        if len(parts) != 2 or not 0 <= parts[0] < parts[1]:
            raise ValueError(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
        jobs = jobs[parts[0]::parts[1]]
    return jobs


def any_failed(results: list) -> int:
    """1 when a job of ``results`` (:class:`~tuner.tune.JobResult`) failed, else 0."""
    return 1 if any(r.status == "failed" for r in results) else 0


def budget_left(args: argparse.Namespace) -> float | None:
    """Seconds of ``--budget`` left: the budget counts from the command's start (``args.started``, wall clock, set by
    the CLI), so planning and, for day0, starting the tuning process count too. None without a budget."""
    if args.budget is None:
        return None
    return max(0.0, args.budget - (time.time() - getattr(args, "started", time.time())))


def run_tune(args: argparse.Namespace, jobs: list, device, db) -> list:
    """Tune ``jobs`` as the arguments say, print the summary and return the :class:`~tuner.tune.JobResult` list."""
    from dsa_triton.bench.results import dict_table

    from .tune import summary_rows, tune

    trials = args.trials or (40 if device.type == "cuda" else 4)
    total_s = budget_left(args)
    budget = "" if total_s is None else f", budget {args.budget:.0f} s ({total_s:.0f} s left)"
    print(f"tuning {len(jobs)} jobs on {device} into {db.folder} (sampler {args.sampler}, {trials} configs each"
          f"{budget})", flush=True)
    results = tune(jobs, db, device, sampler=args.sampler, trials=trials, timeout=args.timeout, total_s=total_s,
                   storage_dir=None if args.storage == "none" else args.storage, retune=args.retune,
                   seed=args.seed, progress=not args.no_progress, workers=args.workers)
    print(dict_table(summary_rows(results)))
    return results
