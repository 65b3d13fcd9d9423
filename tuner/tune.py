"""Tune a list of (kernel, phase, shape) jobs and store a record for each in the tuning database.

A search of one job: an :class:`~tuner.objective.Evaluator`, a study seeded with the default and the nearest stored
configs (any model's: :meth:`~tuning_db.Database.nearest_configs`), then the finalists (the three fastest and the
default) timed again with the full harness budget in one run, beside the baseline; the fastest finalist becomes the
record. Each record is merged into the database as soon as it exists, so a run cut short keeps what it finished.

Without a budget every job is searched (``trials`` new configs, ``timeout`` seconds at most), except jobs that have
a fresh exact tuned record (unless ``retune``).

With a budget (``total_s``) a run makes two passes, and no evaluation starts after the budget less a margin
(:func:`margin_s`, for the last job's final timing and the results):

1. known configs: every job without a fresh exact record gets one from the configs known for it without a search,
   the nearest stored shape's best config and the default, each checked against the reference and timed
   (status ``untuned``); it is what makes the database usable for the whole model. Jobs go in falling expected
   gain (:func:`expected_gain`), so when the budget does not reach them all the jobs left are the ones that matter
   least: they keep what ops use for them now, the nearest stored record or the default (status ``kept: nearest
   record`` / ``kept: default``). On a GPU the configs of the jobs are compiled first in parallel worker processes
   (:func:`~tuner.precompile.precompile_jobs`, in the same order, for at most half the time left).
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

A job that fails says why (:class:`JobResult`): its configs' failures by cause (``wrong result``, ``out of
memory``, ``compile error``, ``launch error``: :func:`~tuner.objective.failure_cause`), or ``does not fit`` when its
inputs cannot fit the device's free memory (checked before it runs, from its cost's bytes: :func:`misfit`). On a
GPU each job also notes the device memory in use outside PyTorch's caching allocator before and after it
(:func:`outside_allocator_mib`), then releases the context's per-thread stack (the local memory that the driver keeps
for the most demanding kernel launched so far: a config that spills can leave gigabytes behind).
"""
from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsa_triton.registry import KernelSpec
from dsa_triton.bench.harness import error_text, release_memory
from dsa_triton.runtime import device_name, release_stack
from tuning_db import Database, Record
from tuning_db.database import triton_version
from dsa_triton.registry import shape_text
from tuning_db.records import config_text

from .objective import OOM, WRONG, DeviceLost, Evaluator, failure_cause

if TYPE_CHECKING:
    from dsa_triton.bench.harness import Ceilings

    from .study import Studies

FINALISTS = 3
KEPT_RECORD, KEPT_DEFAULT = "kept: nearest record", "kept: default"  # jobs a budget's known pass did not reach
MARGIN_SHARE, MAX_MARGIN_S = 0.05, 20.0  # of a budget, kept for the last job's final timing and the results
PRECOMPILE_SHARE = 0.5  # of the known pass's time, at most, for compiling its configs in worker processes
MIN_SETS = 3  # input sets an evaluator holds at least on a GPU: two for timing, one for a check
now = time.monotonic  # the budget's clock (tests replace it)


class NoPass(Exception):
    """No config of a job passed; ``causes``: cause -> configs that failed with it."""

    def __init__(self, causes: dict[str, int]):
        self.causes = dict(causes)
        super().__init__(no_pass_text(self.causes))


class OutOfTime(Exception):
    """The deadline passed before a config of the job passed (``causes``: of the configs that failed before)."""

    def __init__(self, causes: dict[str, int] | None = None):
        from .study import causes_text

        self.causes = dict(causes or {})
        failed = f" ({causes_text(self.causes)})" if self.causes else ""
        super().__init__(f"the budget ran out before a config passed{failed}")


def no_pass_text(causes: dict[str, int]) -> str:
    """``"no config passed (3 out of memory, 1 compile error)"``; "... the reference check" when every failure was
    a wrong result."""
    from .study import causes_text

    head = "no config passed the reference check" if set(causes) == {WRONG} else "no config passed"
    return f"{head} ({causes_text(causes)})" if causes else head


@dataclass(frozen=True)
class Job:
    spec: KernelSpec
    phase: str
    shape: dict[str, int]

    def __str__(self) -> str:
        return f"{self.spec.name} {self.phase} {shape_text(self.shape)}"


@dataclass
class JobResult:
    """What happened to one job: ``record`` when it has one; ``status`` says how it got it, or why it has none.

    ``causes``: when no config passed, how many failed by cause. ``config``: for a job kept without a record of its
    own, the config ops use (the nearest record's or the default). ``outside_*_mib``: device memory in use outside
    PyTorch's caching allocator before and after the job's last run (:func:`outside_allocator_mib`; None off CUDA).
    """

    job: Job
    status: str  # tuned, untuned (known configs only), skipped (fresh record, or does not fit), failed,
    # kept: nearest record / kept: default (the budget did not reach it), not run (device lost)
    record: Record | None = None
    detail: str = ""
    causes: dict[str, int] = field(default_factory=dict)
    config: str = ""
    outside_before_mib: float | None = None
    outside_after_mib: float | None = None


def device_memory(device: torch.device) -> dict[str, int] | None:
    """Bytes of a CUDA device (:func:`dsa_triton.runtime.device_memory`: ``total``, ``free``, ``reserved``,
    ``outside``), with ``allocated`` by PyTorch's caching allocator; None off CUDA."""
    from dsa_triton import runtime

    memory = runtime.device_memory(device) if device.type == "cuda" else None
    return None if memory is None else {**memory, "allocated": torch.cuda.memory_allocated(device)}


def outside_allocator_mib(device: torch.device) -> float | None:
    """MiB of device memory in use outside PyTorch's caching allocator: ``total - free - reserved`` (CUDA contexts,
    the driver's local-memory reservation for kernels that spill, other processes); None off CUDA."""
    memory = device_memory(device)
    return None if memory is None else memory["outside"] / 2**20


def misfit(job: Job, device: torch.device) -> str | None:
    """Why ``job`` cannot run on ``device`` (its input sets need more than is free), or None. The need is a lower
    bound, :data:`MIN_SETS` times the cost's bytes (what one call moves); free is the driver's free memory plus what
    the caching allocator holds unused. Nothing is known off CUDA."""
    memory = device_memory(device)
    if memory is None:
        return None
    needs = MIN_SETS * job.spec.cost(job.phase, job.shape).bytes
    available = memory["free"] + memory["reserved"] - memory["allocated"]
    if needs <= available:
        return None
    return f"does not fit: needs {needs / 2**30:.1f} GiB, {available / 2**30:.1f} GiB free"


def margin_s(total_s: float) -> float:
    """Seconds of a budget in which no evaluation starts: the last job's final timing and the results."""
    return min(MARGIN_SHARE * total_s, MAX_MARGIN_S)


def seconds_left(timeout: float | None, deadline: float | None) -> float | None:
    """The shorter of ``timeout`` and the time to ``deadline`` (on :func:`now`); None when neither is set."""
    limits = [t for t in (timeout, None if deadline is None else max(deadline - now(), 0.0)) if t is not None]
    return min(limits, default=None)


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
             skip: dict | None = None, deadline: float | None = None) -> Record:
    """Search one job and return its record; ``known``: run only the configs known for it (:func:`known_configs`),
    for an ``untuned`` record. ``skip``: config JSON -> an outcome known already (a worker's fatal check).
    ``deadline`` (on :func:`now`): no evaluation starts after it. Raises :class:`NoPass` when no config passed,
    :class:`OutOfTime` when the deadline came first.

    An exhaustive search on a GPU compiles its configs in parallel first (:mod:`tuner.precompile`).
    """
    from .precompile import precompile
    from .study import choose_sampler, search, study_name, valid_configs

    if deadline is not None and now() >= deadline:
        raise OutOfTime()
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
        skip.update(precompile(evaluator, valid[:trials], workers, seconds_left(timeout, deadline)))
    evaluate = lambda config: skip.get(config_text(config)) or evaluator.evaluate(config)
    result = search(spec, shape, evaluate, name=study_name(spec, phase, shape, dev),
                    storage=studies.storage(dev, spec.name), sampler=sampler, trials=trials, timeout=timeout,
                    seeds=seeds, seed=seed, progress=progress, only_seeds=known, deadline=deadline, clock=now)
    ranked = result.ranked()
    if not ranked:
        raise OutOfTime(result.causes()) if result.cut else NoPass(result.causes())
    return finalize(evaluator, ranked, result.runs(), budget["final_warmup_ms"], budget["final_rep_ms"],
                    status="untuned" if known else "tuned")


def search_gap(record: Record, job: Job, ceilings: "Ceilings | None") -> float:
    """Microseconds a search could at most save: the default's time (the record's best when the default failed)
    less the floor (no ceilings: a floor of 0, the interpreter's proxy)."""
    from dsa_triton.bench.harness import floor_us

    default = record.default_us if record.default_us == record.default_us else record.median_us
    floor = 0.0 if ceilings is None else floor_us(job.spec.cost(job.phase, job.shape), ceilings)[0]
    return max(default - floor, 0.0)


def expected_gain(job: Job, record: Record | None, ceilings: "Ceilings | None") -> float:
    """What a job's known pass may gain, to order the jobs: the :func:`search_gap` of its stale exact record when it
    has one and the ceilings are measured, else its floor (the default's time is unknown before it runs, and a
    bigger problem has more to gain). Without ceilings the floor takes unit rates: bytes and FLOPs as they are."""
    from dsa_triton.bench.harness import Ceilings, floor_us

    if record is not None and ceilings is not None:
        return search_gap(record, job, ceilings)
    return floor_us(job.spec.cost(job.phase, job.shape), ceilings or Ceilings(1.0, 1.0, 1.0))[0]


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
    """One call of :func:`tune`: the settings every job shares, and what happened to each job. ``deadline`` (on
    :func:`now`, None without a budget): no evaluation starts after it."""

    def __init__(self, jobs: list[Job], db: Database, device: torch.device, *, timeout: float | None,
                 storage_dir: str | Path | None, log, deadline: float | None = None, **settings):
        from .study import Studies

        self.jobs, self.db, self.device, self.log = jobs, db, device, log
        self.dev = device_name(device)
        self.settings = settings  # sampler, trials, seed, progress, workers: tune_job's
        self.timeout, self.deadline = timeout, deadline
        self.studies = Studies(storage_dir)
        self.results: list[JobResult | None] = [None] * len(jobs)
        self.pass_s: dict[int, float] = {}  # job index -> seconds its known pass took
        self.ceilings: "Ceilings | None" = None  # measured once per budgeted run on a GPU
        self.lost = False

    def head(self, i: int) -> str:
        return f"[{i + 1}/{len(self.jobs)}] {self.jobs[i]}"

    def exact_record(self, job: Job) -> Record | None:
        found = self.db.match(job.spec, job.phase, job.shape, self.dev)
        return found[1] if found and found[0] == "exact" else None

    def fresh_record(self, job: Job) -> Record | None:
        found = self.exact_record(job)
        return found if found is not None and self.db.is_fresh(found) else None

    def study(self, job: Job) -> str:
        from .study import study_name

        return study_name(job.spec, job.phase, job.shape, self.dev)

    def out_of_time(self) -> bool:
        return self.deadline is not None and now() >= self.deadline

    def run(self, i: int, *, known: bool = False, timeout: float | None = None, skip: dict | None = None) -> None:
        """Search job ``i`` (or run its known configs) and store its record; a failure keeps the record it had."""
        job = self.jobs[i]
        if self.lost:
            if self.results[i] is None:
                self.results[i] = JobResult(job, "not run", detail="the CUDA context was lost")
            return
        reason = misfit(job, self.device)
        if reason is not None:
            self.fail(i, JobResult(job, "skipped", detail=reason))
            return
        before, start = outside_allocator_mib(self.device), now()
        try:
            result = self.attempt(i, known=known, timeout=timeout, skip=skip)
        finally:
            if not self.lost:
                release_memory(self.device)
        result.outside_before_mib = before
        result.outside_after_mib = None if self.lost else outside_allocator_mib(self.device)
        if not self.lost:
            release_stack(self.device)  # the local memory a spilling config made the driver keep goes back
        record = result.record
        if record is None:
            self.fail(i, result)
            return
        if known:
            self.pass_s[i] = now() - start
            self.studies.note(self.dev, job.spec.name, self.study(job), "known_pass_s", self.pass_s[i])
        self.db.add([record])
        self.results[i] = result
        after = result.outside_after_mib
        memory = "" if after is None else f", {after:.0f} MiB outside the allocator"
        self.log(f"{self.head(i)}: {record.status} {record.config} {record.median_us:.1f} us, default "
                 f"{record.default_us:.1f} us ({record.speedup():.2f}x, {record.timing}), {record.trials} configs run"
                 f"{memory}")

    def attempt(self, i: int, *, known: bool, timeout: float | None, skip: dict | None) -> JobResult:
        """Job ``i``'s search (or known configs): a result with its record, or with why it has none."""
        job = self.jobs[i]
        try:
            record = tune_job(job, self.db, self.device, timeout=timeout, studies=self.studies, known=known,
                              skip=skip, deadline=self.deadline, **self.settings)
        except DeviceLost as exc:
            self.lost = True
            self.log("run the same command again in a new process to go on")
            return JobResult(job, "failed", detail=f"device lost: {exc}"[:300])
        except NoPass as exc:
            return JobResult(job, "failed", detail=str(exc), causes=exc.causes)
        except OutOfTime as exc:
            return self.kept(i, str(exc), exc.causes)
        except Exception as exc:  # a kernel that cannot even build its inputs must not stop the others
            cause = "out of memory: " if failure_cause(exc) == OOM else ""
            return JobResult(job, "failed", detail=error_text(exc, cause))
        return JobResult(job, record.status, record)

    def kept(self, i: int, why: str, causes: dict[str, int] | None = None) -> JobResult:
        """Job ``i`` without a record of its own: what ops use for it, the nearest stored record, else the default."""
        job = self.jobs[i]
        found = self.db.match(job.spec, job.phase, job.shape, self.dev)
        if found is None:
            return JobResult(job, KEPT_DEFAULT, detail=why, causes=dict(causes or {}),
                             config=config_text(job.spec.default(job.phase, job.shape)))
        level, record = found
        return JobResult(job, KEPT_RECORD, detail=f"{why}; ops use the {level} record {record.shape}",
                         causes=dict(causes or {}), config=record.config)

    def fail(self, i: int, result: JobResult) -> None:
        earlier = self.results[i]
        if earlier is not None and earlier.record is not None:  # the job keeps the record it has
            earlier.detail = f"search failed: {result.detail}"
            earlier.outside_before_mib, earlier.outside_after_mib = result.outside_before_mib, result.outside_after_mib
        else:
            self.results[i] = result
        self.log(f"{self.head(i)}: {result.status}: {result.detail}")

    def search_all(self, retune: bool) -> None:
        for i, job in enumerate(self.jobs):
            found = self.fresh_record(job)
            if not retune and found is not None and found.tuned:
                self.results[i] = JobResult(job, "skipped", found, "a fresh record exists")
                self.log(f"{self.head(i)}: skipped, a fresh record exists")
                continue
            self.run(i, timeout=self.timeout)

    def by_gain(self, todo: list[int]) -> list[int]:
        """Jobs ``todo`` in falling :func:`expected_gain` (ties in their order)."""
        gain = {i: expected_gain(self.jobs[i], self.exact_record(self.jobs[i]), self.ceilings) for i in todo}
        return sorted(todo, key=lambda i: -gain[i])

    def known_pass(self, retune: bool) -> None:
        """A record for every job without a fresh exact one, from the configs known for it, in falling expected gain
        while the budget lasts; the jobs it does not reach keep what ops use for them now."""
        todo = []
        for i, job in enumerate(self.jobs):
            found = self.fresh_record(job)
            if found is not None and not retune:
                self.results[i] = JobResult(job, found.status, found, "a fresh record exists")
            else:
                todo.append(i)
        todo = self.by_gain(todo)
        skips = self.precompile(todo)
        for i in todo:
            if self.out_of_time():
                self.results[i] = self.kept(i, "the budget ran out before its known configs")
            else:
                self.run(i, known=True, skip=skips.get(i))
        kept = sum(1 for i in todo if self.results[i].status in (KEPT_RECORD, KEPT_DEFAULT))
        if kept:
            self.log(f"the budget reached the known configs of {len(todo) - kept} of {len(todo)} jobs; {kept} keep "
                     f"the nearest stored record or the default")

    def precompile(self, todo: list[int]) -> dict[int, dict]:
        """On a GPU, the known configs of jobs ``todo`` compiled in worker processes, in order, for at most
        :data:`PRECOMPILE_SHARE` of the time left; job index -> the configs to skip (fatal in a worker)."""
        from .precompile import precompile_jobs

        known = {i: known_configs(self.jobs[i], self.db, self.dev) for i in todo}
        if self.device.type == "cuda" and len(todo) > 1:
            self.log(f"compiling the known configs of {len(todo)} jobs in worker processes")
        seconds = None if self.deadline is None else PRECOMPILE_SHARE * max(self.deadline - now(), 0.0)
        skips = precompile_jobs([(self.jobs[i].spec.name, self.jobs[i].phase, self.jobs[i].shape, known[i])
                                 for i in todo], str(self.device), self.settings.get("workers"), seconds)
        return dict(zip(todo, skips))

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
        gaps = {i: search_gap(r.record, self.jobs[i], self.ceilings) for i, r in enumerate(self.results)
                if r is not None and r.record is not None}
        top = max(gaps.values(), default=1.0) or 1.0
        # a job none of whose known configs passed is first in line (a job that raised otherwise is not searched)
        gaps.update({i: top for i, r in enumerate(self.results) if r is not None and r.record is None and r.causes
                     and r.status == "failed"})
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
    """Tune ``jobs``: each one searched, or, within ``total_s`` seconds, known configs for every job the budget
    reaches first (in falling expected gain) and searches where the default is furthest from the floor after (see
    the module's docstring).

    A config that breaks the CUDA context ends the run (the jobs left are marked so); its study keeps it
    as failed, so the same command run again resumes without trying it twice.
    """
    start = now()
    deadline = None if total_s is None else start + total_s - margin_s(total_s)
    run = _Run(jobs, db, device, timeout=timeout, storage_dir=storage_dir, log=log, deadline=deadline,
               sampler=sampler, trials=trials, seed=seed, progress=progress, workers=workers)
    if total_s is None:
        run.search_all(retune)
    else:
        if device.type == "cuda" and not run.out_of_time():
            from dsa_triton.bench.harness import measure_ceilings

            run.ceilings = measure_ceilings(device)
        run.known_pass(retune)
        have = sum(1 for r in run.results if r is not None and r.record is not None)
        log(f"known configs: {have} of {len(jobs)} jobs have a record ({now() - start:.1f} s)")
        run.searches(deadline)
    return [r or JobResult(job, "not run") for job, r in zip(jobs, run.results)]


def summary_rows(results: list[JobResult]) -> list[dict[str, Any]]:
    """One row per job: its record's config and times (a kept job: the config ops use), its configs' failures by
    cause, and the device memory outside PyTorch's allocator after it (MiB, NaN off CUDA)."""
    from .study import causes_text

    rows = []
    for o in results:
        r = o.record
        outside = math.nan if o.outside_after_mib is None else o.outside_after_mib
        rows.append({"kernel": o.job.spec.name, "phase": o.job.phase, "shape": shape_text(o.job.shape),
                     "status": o.status, "config": r.config if r else o.config, "us": r.median_us if r else math.nan,
                     "default_us": r.default_us if r else math.nan,
                     "tuned/default": r.speedup() if r else math.nan,
                     "baseline/tuned": r.baseline_us / r.median_us if r else math.nan,
                     "timing": r.timing if r else "", "configs run": r.trials if r else 0,
                     "failures": causes_text(o.causes), "outside allocator MiB": outside, "detail": o.detail})
    return rows
