"""Tune a list of (kernel, phase, shape) jobs and store each winner in the tuning database.

Per job: an :class:`~tuner.objective.Evaluator`, a study seeded with the default and the nearest stored
configs, then the finalists (the three fastest and the default) timed again with the full harness
budget in one run, beside the baseline; the fastest finalist becomes the record. Each record is merged
into the database as soon as it exists, so a run cut short keeps what it finished. Jobs that already
have a fresh exact record are skipped unless ``retune``.
"""
from __future__ import annotations

import datetime as dt
import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsa_triton.registry import KernelSpec
from dsa_triton.runtime import device_name
from tuning_db import Database, Record
from tuning_db.database import triton_version
from dsa_triton.registry import shape_text
from tuning_db.records import config_text

from .objective import DeviceLost, Evaluator

FINALISTS = 3


@dataclass(frozen=True)
class Job:
    spec: KernelSpec
    phase: str
    shape: dict[str, int]

    def __str__(self) -> str:
        return f"{self.spec.name} {self.phase} {shape_text(self.shape)}"


@dataclass
class JobResult:
    """What happened to one job: ``record`` when tuned, else ``status`` says why not."""

    job: Job
    status: str  # tuned, skipped (fresh record), out of time, failed, not run (device lost)
    record: Record | None = None
    detail: str = ""


def timing_budget(device: torch.device) -> dict[str, float]:
    """Trial and final timing budgets for ``time_us`` (the interpreter is slow: three samples)."""
    if device.type == "cuda":
        return {"trial_warmup_ms": 10, "trial_rep_ms": 40, "final_warmup_ms": 25, "final_rep_ms": 100}
    return {"trial_warmup_ms": 0, "trial_rep_ms": 1, "final_warmup_ms": 0, "final_rep_ms": 1}


def finalize(evaluator: Evaluator, ranked: list[tuple[dict, float]], trials: int, final_warmup_ms: float,
             final_rep_ms: float) -> Record:
    """Time the finalists and the default again, with the baseline, in one run; the fastest is the record."""
    spec, phase, shape = evaluator.spec, evaluator.phase, evaluator.shape
    default = dict(spec.default(phase, shape))
    finalists = [c for c, _ in ranked[:FINALISTS]]
    default_ok = evaluator.check(default) is None
    if default_ok and default not in finalists:
        finalists.append(default)
    times = dict(zip(map(config_text, finalists), evaluator.time_all(finalists, final_warmup_ms, final_rep_ms)))
    best = min(times, key=times.get)
    return Record(
        device=device_name(evaluator.device), triton=triton_version(), kernel=spec.name,
        source_hash=spec.source_hash(), phase=phase, shape_key=str(evaluator.key), shape=shape_text(shape),
        dtypes=evaluator.dtypes, config=best, median_us=round(times[best], 3),
        default_us=round(times[config_text(default)], 3) if default_ok else math.nan,
        baseline_us=round(evaluator.time_baseline(final_warmup_ms, final_rep_ms), 3), trials=trials,
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), timing=evaluator.timing or "eager",
    )


def tune_job(job: Job, db: Database, device: torch.device, *, sampler: str, trials: int, timeout: float | None,
             storage_dir: str | Path | None, seed: int, progress: bool, workers: int | None = None) -> Record | None:
    """Search one job and return its record (None when no config passed the check).

    An exhaustive search on a GPU compiles its configs in parallel first (:mod:`tuner.precompile`).
    """
    from .precompile import precompile
    from .study import choose_sampler, journal_storage, search, study_name, valid_configs

    budget = timing_budget(device)
    spec, phase, shape = job.spec, job.phase, job.shape
    dev = device_name(device)
    evaluator = Evaluator(spec, phase, shape, device, budget["trial_warmup_ms"], budget["trial_rep_ms"])
    seeds = [dict(spec.default(phase, shape)), *db.nearest_configs(spec, phase, shape, dev)]
    storage = None if storage_dir is None else journal_storage(storage_dir, dev, spec.name)
    valid = valid_configs(spec, shape)
    skip = {}
    if choose_sampler(sampler, None if valid is None else len(valid), trials) == "exhaustive":
        skip = precompile(evaluator, valid[:trials], workers)
    evaluate = lambda config: skip.get(config_text(config)) or evaluator.evaluate(config)
    result = search(spec, shape, evaluate, name=study_name(spec, phase, shape, dev), storage=storage,
                    sampler=sampler, trials=trials, timeout=timeout, seeds=seeds, seed=seed, progress=progress)
    ranked = result.ranked()
    if not ranked:
        return None
    return finalize(evaluator, ranked, result.runs(), budget["final_warmup_ms"], budget["final_rep_ms"])


def tune(jobs: list[Job], db: Database, device: torch.device, *, sampler: str = "auto", trials: int = 40,
         timeout: float | None = None, total_s: float | None = None, storage_dir: str | Path | None = ".optuna",
         retune: bool = False, seed: int = 0, progress: bool = True, workers: int | None = None,
         log=print) -> list[JobResult]:
    """Tune ``jobs`` in order within ``total_s`` seconds, shared fairly: a job's study may use the time left
    divided by the jobs left (itself included), so the last jobs of a list are not starved by the first (a
    study runs at least one trial; skipped and quick jobs leave their share to the later ones). A job is not
    started once the budget is spent.

    A config that breaks the CUDA context ends the run (the jobs left are marked so); its study keeps it
    as failed, so the same command run again resumes without trying it twice.
    """
    start = time.monotonic()
    dev = device_name(device)
    results, lost = [], False
    for i, job in enumerate(jobs):
        head = f"[{i + 1}/{len(jobs)}] {job}"
        if lost:
            results.append(JobResult(job, "not run", detail="the CUDA context was lost"))
            continue
        if total_s is not None and time.monotonic() - start >= total_s:
            results.append(JobResult(job, "out of time"))
            continue
        found = db.match(job.spec, job.phase, job.shape, dev)
        if not retune and found and found[0] == "exact" and db.is_fresh(found[1]):
            results.append(JobResult(job, "skipped", found[1], "a fresh record exists"))
            log(f"{head}: skipped, a fresh record exists")
            continue
        share = None if total_s is None else (total_s - (time.monotonic() - start)) / (len(jobs) - i)
        job_timeout = share if timeout is None else timeout if share is None else min(timeout, share)
        try:
            record = tune_job(job, db, device, sampler=sampler, trials=trials, timeout=job_timeout,
                              storage_dir=storage_dir, seed=seed, progress=progress, workers=workers)
        except DeviceLost as exc:
            lost = True
            results.append(JobResult(job, "failed", detail=f"device lost: {exc}"[:300]))
            log(f"{head}: {results[-1].detail}; run the same command again in a new process to go on")
            continue
        except Exception as exc:  # a kernel that cannot even build its inputs must not stop the others
            results.append(JobResult(job, "failed", detail=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"{head}: failed: {results[-1].detail}")
            continue
        finally:
            if device.type == "cuda" and not lost:
                gc.collect()  # a failed job's tensors can sit in reference cycles through its traceback's frames
                torch.cuda.empty_cache()
        if record is None:
            results.append(JobResult(job, "failed", detail="no config passed the reference check"))
            log(f"{head}: failed: no config passed the reference check")
            continue
        db.add([record])
        results.append(JobResult(job, "tuned", record))
        log(f"{head}: {record.config} {record.median_us:.1f} us, default {record.default_us:.1f} us "
            f"({record.speedup():.2f}x, {record.timing}), {record.trials} configs run")
    return results


def summary_rows(results: list[JobResult]) -> list[dict[str, Any]]:
    rows = []
    for o in results:
        r = o.record
        rows.append({"kernel": o.job.spec.name, "phase": o.job.phase, "shape": shape_text(o.job.shape),
                     "status": o.status, "config": r.config if r else "", "us": r.median_us if r else math.nan,
                     "default_us": r.default_us if r else math.nan,
                     "tuned/default": r.speedup() if r else math.nan,
                     "baseline/tuned": r.baseline_us / r.median_us if r else math.nan,
                     "timing": r.timing if r else "", "configs run": r.trials if r else 0, "detail": o.detail})
    return rows
