"""Tune a list of (kernel, phase, shape) jobs and store a record for each in the tuning database.

A search of one job: an :class:`~tuner.objective.Evaluator`, a study seeded with the default and the nearest stored
configs (any model's: :meth:`~tuning_db.Database.nearest_configs`), then the finalists (the three fastest and the
default) timed again with the full harness budget in one run, beside the baseline; the fastest finalist becomes the
record. Each record is merged into the database as soon as it exists, so a run cut short keeps what it finished.

Without a budget every job is searched (``trials`` new configs, ``timeout`` seconds at most), except jobs that have
a fresh exact tuned record (unless ``retune``).

With a budget (``total_s``) a run makes two passes:

1. known configs: every job without a fresh exact record gets one from the configs known for it without a search,
   the nearest stored shape's best config and the default, each checked against the reference and timed
   (status ``untuned``). This pass runs for every job whatever the budget, since it is what makes the database
   usable for the whole model; on a GPU the configs of all its jobs are compiled first in parallel worker
   processes (:func:`~tuner.precompile.precompile_jobs`).
2. searches, with the rest of the budget, where tuning can gain the most: jobs whose default is furthest from the
   floor. A job's gap is ``default_us - floor_us``, the time a search could at most save (the floor from the
   kernel's cost and the ceilings measured in this process; without a GPU there are no ceilings, the floor is 0
   and the gap is the default's time in the interpreter, its proxy). Jobs go in falling gap. A job's target is its
   gap's share of the search time, the time left plus what its searches used in earlier runs, among the jobs whose
   targets cover their cost (twice their known pass: inputs, reference, a few configs, final timing); its search
   gets the target less what it used already, less its fixed cost (about one known pass), and jobs whose targets
   do not cover their cost keep their untuned records. Studies live in the journal and note the search time they
   used, so a later run goes on where this one stopped, measures no config twice, and budgets add up: two runs of
   10 minutes give each job the search time one run of 20 minutes would.
"""
from __future__ import annotations

import datetime as dt
import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsa_triton.registry import KernelSpec
from dsa_triton.runtime import device_name
from tuning_db import Database, Record
from tuning_db.database import triton_version
from dsa_triton.registry import shape_text
from tuning_db.records import config_text

from .objective import DeviceLost, Evaluator

if TYPE_CHECKING:
    from dsa_triton.bench.harness import Ceilings

    from .study import Studies

FINALISTS = 3
NO_PASS = "no config passed the reference check"
now = time.monotonic  # the budget's clock (tests replace it)


@dataclass(frozen=True)
class Job:
    spec: KernelSpec
    phase: str
    shape: dict[str, int]

    def __str__(self) -> str:
        return f"{self.spec.name} {self.phase} {shape_text(self.shape)}"


@dataclass
class JobResult:
    """What happened to one job: ``record`` when it has one; ``status`` says how it got it, or why it has none."""

    job: Job
    status: str  # tuned, untuned (known configs only), skipped (fresh record), failed, not run (device lost)
    record: Record | None = None
    detail: str = ""


def timing_budget(device: torch.device) -> dict[str, float]:
    """Trial and final timing budgets for ``time_us`` (the interpreter is slow: three samples)."""
    if device.type == "cuda":
        return {"trial_warmup_ms": 10, "trial_rep_ms": 40, "final_warmup_ms": 25, "final_rep_ms": 100}
    return {"trial_warmup_ms": 0, "trial_rep_ms": 1, "final_warmup_ms": 0, "final_rep_ms": 1}


def finalize(evaluator: Evaluator, ranked: list[tuple[dict, float]], trials: int, final_warmup_ms: float,
             final_rep_ms: float, status: str = "tuned") -> Record:
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
        status=status,
    )


def known_configs(job: Job, db: Database, device: str) -> list[dict]:
    """The configs of a job's known pass: the nearest stored shape's best config (when valid here), the default."""
    out: list[dict] = []
    for config in [*db.nearest_configs(job.spec, job.phase, job.shape, device, n=1),
                   dict(job.spec.default(job.phase, job.shape))]:
        if config not in out:
            out.append(config)
    return out


def tune_job(job: Job, db: Database, device: torch.device, *, sampler: str, trials: int, timeout: float | None,
             studies: "Studies", seed: int, progress: bool, workers: int | None = None, known: bool = False,
             skip: dict | None = None) -> Record | None:
    """Search one job and return its record (None when no config passed the check); ``known``: run only the
    configs known for it (:func:`known_configs`), for an ``untuned`` record. ``skip``: config JSON -> an outcome
    known already (a worker's fatal check).

    An exhaustive search on a GPU compiles its configs in parallel first (:mod:`tuner.precompile`).
    """
    from .precompile import precompile
    from .study import choose_sampler, search, study_name, valid_configs

    budget = timing_budget(device)
    spec, phase, shape = job.spec, job.phase, job.shape
    dev = device_name(device)
    evaluator = Evaluator(spec, phase, shape, device, budget["trial_warmup_ms"], budget["trial_rep_ms"])
    if known:
        seeds = known_configs(job, db, dev)
        trials = len(seeds)
    else:
        seeds = [dict(spec.default(phase, shape)), *db.nearest_configs(spec, phase, shape, dev)]
    skip = dict(skip or {})
    valid = valid_configs(spec, shape)
    if not known and choose_sampler(sampler, None if valid is None else len(valid), trials) == "exhaustive":
        skip.update(precompile(evaluator, valid[:trials], workers))
    evaluate = lambda config: skip.get(config_text(config)) or evaluator.evaluate(config)
    result = search(spec, shape, evaluate, name=study_name(spec, phase, shape, dev),
                    storage=studies.storage(dev, spec.name), sampler=sampler, trials=trials, timeout=timeout,
                    seeds=seeds, seed=seed, progress=progress, only_seeds=known)
    ranked = result.ranked()
    if not ranked:
        return None
    return finalize(evaluator, ranked, result.runs(), budget["final_warmup_ms"], budget["final_rep_ms"],
                    status="untuned" if known else "tuned")


def search_gap(record: Record, job: Job, ceilings: "Ceilings | None") -> float:
    """Microseconds a search could at most save: the default's time (the record's best when the default failed)
    less the floor (no ceilings: a floor of 0, the interpreter's proxy)."""
    from dsa_triton.bench.harness import floor_us

    default = record.default_us if record.default_us == record.default_us else record.median_us
    floor = 0.0 if ceilings is None else floor_us(job.spec.cost(job.phase, job.shape), ceilings)[0]
    return max(default - floor, 0.0)


def affordable(gaps: list[float], costs: list[float], spent: list[float], left: float) -> int:
    """How many of the jobs (in falling gap) can each afford a search: the longest prefix in which every job's
    target, its gap's share of the time left plus the time the prefix's searches used already, is at least its
    cost."""
    for n in range(len(gaps), 0, -1):
        total, budget = sum(gaps[:n]), left + sum(spent[:n])
        if total > 0 and all(budget * g / total >= c for g, c in zip(gaps[:n], costs[:n])):
            return n
    return 0


class _Run:
    """One call of :func:`tune`: the settings every job shares, and what happened to each job."""

    def __init__(self, jobs: list[Job], db: Database, device: torch.device, *, timeout: float | None,
                 storage_dir: str | Path | None, log, **settings):
        from .study import Studies

        self.jobs, self.db, self.device, self.log = jobs, db, device, log
        self.dev = device_name(device)
        self.settings = settings  # sampler, trials, seed, progress, workers: tune_job's
        self.timeout = timeout
        self.studies = Studies(storage_dir)
        self.results: list[JobResult | None] = [None] * len(jobs)
        self.pass_s: dict[int, float] = {}  # job index -> seconds its known pass took
        self.lost = False

    def head(self, i: int) -> str:
        return f"[{i + 1}/{len(self.jobs)}] {self.jobs[i]}"

    def fresh_record(self, job: Job) -> Record | None:
        found = self.db.match(job.spec, job.phase, job.shape, self.dev)
        return found[1] if found and found[0] == "exact" and self.db.is_fresh(found[1]) else None

    def study(self, job: Job) -> str:
        from .study import study_name

        return study_name(job.spec, job.phase, job.shape, self.dev)

    def run(self, i: int, *, known: bool = False, timeout: float | None = None, skip: dict | None = None) -> None:
        """Search job ``i`` (or run its known configs) and store its record; a failure keeps the record it had."""
        job = self.jobs[i]
        if self.lost:
            if self.results[i] is None:
                self.results[i] = JobResult(job, "not run", detail="the CUDA context was lost")
            return
        start = now()
        try:
            record = tune_job(job, self.db, self.device, timeout=timeout, studies=self.studies, known=known,
                              skip=skip, **self.settings)
        except DeviceLost as exc:
            self.lost = True
            self.fail(i, f"device lost: {exc}"[:300])
            self.log("run the same command again in a new process to go on")
            return
        except Exception as exc:  # a kernel that cannot even build its inputs must not stop the others
            self.fail(i, f"{type(exc).__name__}: {exc}"[:300])
            return
        finally:
            if self.device.type == "cuda" and not self.lost:
                gc.collect()  # a failed job's tensors can sit in reference cycles through its traceback's frames
                torch.cuda.empty_cache()
        if record is None:
            self.fail(i, NO_PASS)
            return
        if known:
            self.pass_s[i] = now() - start
            self.studies.note(self.dev, job.spec.name, self.study(job), "known_pass_s", self.pass_s[i])
        self.db.add([record])
        self.results[i] = JobResult(job, record.status, record)
        self.log(f"{self.head(i)}: {record.status} {record.config} {record.median_us:.1f} us, default "
                 f"{record.default_us:.1f} us ({record.speedup():.2f}x, {record.timing}), {record.trials} configs run")

    def fail(self, i: int, detail: str) -> None:
        earlier = self.results[i]
        if earlier is not None and earlier.record is not None:  # the job keeps the record it has
            earlier.detail = f"search failed: {detail}"
        else:
            self.results[i] = JobResult(self.jobs[i], "failed", detail=detail)
        self.log(f"{self.head(i)}: failed: {detail}")

    def search_all(self, retune: bool) -> None:
        for i, job in enumerate(self.jobs):
            found = self.fresh_record(job)
            if not retune and found is not None and found.tuned:
                self.results[i] = JobResult(job, "skipped", found, "a fresh record exists")
                self.log(f"{self.head(i)}: skipped, a fresh record exists")
                continue
            self.run(i, timeout=self.timeout)

    def known_pass(self, retune: bool) -> None:
        """A record for every job without a fresh exact one, from the configs known for it."""
        from .precompile import precompile_jobs

        todo = []
        for i, job in enumerate(self.jobs):
            found = self.fresh_record(job)
            if found is not None and not retune:
                self.results[i] = JobResult(job, found.status, found, "a fresh record exists")
            else:
                todo.append(i)
        known = {i: known_configs(self.jobs[i], self.db, self.dev) for i in todo}
        if self.device.type == "cuda" and len(todo) > 1:
            self.log(f"compiling the known configs of {len(todo)} jobs in worker processes")
        skips = precompile_jobs([(self.jobs[i].spec.name, self.jobs[i].phase, self.jobs[i].shape, known[i])
                                 for i in todo], str(self.device), self.settings.get("workers"))
        for i, skip in zip(todo, skips):
            self.run(i, known=True, skip=skip)

    def known_pass_s(self, i: int) -> float | None:
        """Seconds job ``i``'s known pass took, in this run or (noted in its study) an earlier one."""
        if i not in self.pass_s and (noted := self.noted(i, "known_pass_s")) is not None:
            self.pass_s[i] = noted
        return self.pass_s.get(i)

    def noted(self, i: int, key: str) -> float | None:
        job = self.jobs[i]
        value = self.studies.noted(self.dev, job.spec.name, self.study(job), key)
        return None if value is None else float(value)

    def searches(self, deadline: float) -> None:
        """Searches until ``deadline`` (on :func:`now`), largest gap first, each job's search time (this run's and
        earlier runs') proportional to its gap."""
        ceilings = None
        if self.device.type == "cuda" and not self.lost:
            from dsa_triton.bench.harness import measure_ceilings

            ceilings = measure_ceilings(self.device)
        gaps = {i: search_gap(r.record, self.jobs[i], ceilings) for i, r in enumerate(self.results)
                if r is not None and r.record is not None}
        top = max(gaps.values(), default=1.0) or 1.0
        # a job none of whose known configs passed the check is first in line (an error is not searched again)
        gaps.update({i: top for i, r in enumerate(self.results) if r is not None and r.detail == NO_PASS})
        known = sorted(s for i in gaps if (s := self.known_pass_s(i)) is not None)
        typical = known[len(known) // 2] if known else 0.0  # for a job whose known pass is not on record
        pending = sorted((i for i in gaps if gaps[i] > 0), key=lambda i: -gaps[i])
        cost = {i: 2 * (self.known_pass_s(i) or typical) for i in pending}
        spent = {i: self.noted(i, "search_s") or 0.0 for i in pending}
        searched = 0
        while pending and not self.lost:
            left = deadline - now()
            n = affordable([gaps[i] for i in pending], [cost[i] for i in pending], [spent[i] for i in pending], left)
            if n == 0 or left <= 0:
                break
            chosen = pending[:n]
            budget, total = left + sum(spent[i] for i in chosen), sum(gaps[i] for i in chosen)
            owed = {i: budget * gaps[i] / total - spent[i] for i in chosen}  # target less what it used already
            i = pending.pop(0)
            share = left * owed[i] / sum(o for o in owed.values() if o > 0) if owed[i] > 0 else 0.0
            if share < cost[i]:  # its searches had their share already: the time goes to the others
                continue
            start = now()
            self.run(i, timeout=self.capped(share - cost[i] / 2))  # setup and final timing come out of the share
            spent[i] += now() - start
            self.studies.note(self.dev, self.jobs[i].spec.name, self.study(self.jobs[i]), "search_s", spent[i])
            searched += 1
        self.log(f"searched {searched} jobs" + (f"; the budget reaches no search for {len(pending)} more, which keep "
                                                f"their records" if pending else ""))

    def capped(self, timeout: float) -> float:
        return timeout if self.timeout is None else min(timeout, self.timeout)


def tune(jobs: list[Job], db: Database, device: torch.device, *, sampler: str = "auto", trials: int = 40,
         timeout: float | None = None, total_s: float | None = None, storage_dir: str | Path | None = ".optuna",
         retune: bool = False, seed: int = 0, progress: bool = True, workers: int | None = None,
         log=print) -> list[JobResult]:
    """Tune ``jobs``: each one searched, or, within ``total_s`` seconds, known configs for every job first and
    searches where the default is furthest from the floor after (see the module's docstring).

    A config that breaks the CUDA context ends the run (the jobs left are marked so); its study keeps it
    as failed, so the same command run again resumes without trying it twice.
    """
    start = now()
    run = _Run(jobs, db, device, timeout=timeout, storage_dir=storage_dir, log=log, sampler=sampler, trials=trials,
               seed=seed, progress=progress, workers=workers)
    if total_s is None:
        run.search_all(retune)
    else:
        run.known_pass(retune)
        have = sum(1 for r in run.results if r is not None and r.record is not None)
        log(f"known configs: {have} of {len(jobs)} jobs have a record ({now() - start:.1f} s)")
        run.searches(start + total_s)
    return [r or JobResult(job, "not run") for job, r in zip(jobs, run.results)]


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
