"""The Optuna search over one kernel's config space for one (device, kernel, phase, shape).

One study per (device, kernel, phase, shape key), named with the kernel's source and space hashes so
changed code starts afresh, stored in a journal file per (device, kernel) so an interrupted run resumes.
Each trial suggests one value per parameter (sorted numeric candidates by index, so TPE sees their
order; others categorical). A config measured before (in this or an earlier session) is answered from
the study without running again, and after such a repeat the next trial is an unmeasured valid config,
so the budget buys new measurements: ``--trials`` counts those.

Samplers: ``tpe`` (multivariate TPE), ``random``, ``exhaustive`` (every valid config, seeds first) and
``auto`` (exhaustive when the valid space fits in the trial budget, else TPE). Studies are seeded
(``enqueue_trial``) with the default config and the nearest stored ones.

A study is run by one process at a time: trials an earlier run left running (a process killed, or stopped by
SIGTERM, mid-trial) or waiting (its queue) are failed when the study resumes, and this run queues again what it
wants, so an interrupted config is measured by the next run. Ctrl-C inside a trial ends the search with the trial
pruned (nothing is recorded for its config) and raises ``KeyboardInterrupt`` to the caller.

Optuna is imported here only: ``import dsa_triton`` and the database work without it.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna

from dsa_triton.registry import KernelSpec
from dsa_triton.registry import shape_text
from tuning_db.records import config_text

from .objective import LAUNCH, WRONG, DeviceLost, Outcome

SAMPLERS = ("auto", "tpe", "exhaustive", "random")
MAX_ENUMERATED = 100_000  # spaces larger than this are not enumerated (no exhaustive search)

Config = dict[str, Any]


@dataclass
class Step:
    """One trial of a study, in order: the config, its outcome, and whether it was measured by this trial."""

    number: int
    config: str
    outcome: Outcome
    new: bool


@dataclass
class SearchResult:
    name: str
    steps: list[Step] = field(default_factory=list)  # every trial of the study, earlier sessions included
    cut: bool = False  # stopped by the deadline before it ran what it was asked to

    def measured(self) -> dict[str, Outcome]:
        """Config JSON -> outcome, one per distinct config that was checked (or rejected)."""
        return {s.config: s.outcome for s in self.steps if s.new}

    def ranked(self) -> list[tuple[Config, float]]:
        """Configs that passed the check, fastest first."""
        ok = [(json.loads(c), o.us) for c, o in self.measured().items() if o.ok]
        return sorted(ok, key=lambda item: item[1])

    def runs(self) -> int:
        """Configs that were run (checked, and timed if they passed): what the search cost."""
        return sum(1 for o in self.measured().values() if o.status != "invalid")

    def causes(self) -> Counter:
        """Cause -> how many distinct configs failed with it (:data:`~tuner.objective.WRONG` and the others)."""
        return Counter(o.cause for o in self.measured().values() if o.cause)


def causes_text(causes: Counter | dict[str, int]) -> str:
    """``"3 out of memory, 1 compile error"``: most frequent first."""
    return ", ".join(f"{n} {cause}" for cause, n in sorted(causes.items(), key=lambda item: (-item[1], item[0])))


def space_hash(spec: KernelSpec) -> str:
    return hashlib.sha256(json.dumps(spec.space, sort_keys=True, default=str).encode()).hexdigest()[:8]


def study_name(spec: KernelSpec, phase: str, shape: dict[str, int], device: str) -> str:
    """``device/kernel/<source>-<space>/<shape key>``, plus ``@exact shape`` when it is not the bucket itself."""
    key = spec.shape_key(phase, shape)
    name = f"{device}/{spec.name}/{spec.source_hash()}-{space_hash(spec)}/{key}"
    exact = shape_text(shape)
    return name if exact == shape_text(key.as_dict()) else f"{name}@{exact}"


def journal_storage(folder: str | Path, device: str, kernel: str) -> "optuna.storages.BaseStorage":
    """A resumable journal file ``<folder>/<device>/<kernel>.journal`` (several processes may share it)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = Path(folder) / device / f"{kernel}.journal"
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


class Studies:
    """Where the studies of one run live: a journal file per (device, kernel) under ``folder`` (resumable across
    runs), or, without a folder, one in-memory storage for the run (a job's studies still see each other's trials).
    Also a small per-study note pad (``note`` / ``noted``: study user attributes, e.g. how long a pass took)."""

    def __init__(self, folder: str | Path | None):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.folder = None if folder is None else Path(folder)
        self._storages: dict[tuple[str, str] | None, "optuna.storages.BaseStorage"] = {}

    def storage(self, device: str, kernel: str) -> "optuna.storages.BaseStorage":
        key = None if self.folder is None else (device, kernel)
        if key not in self._storages:
            self._storages[key] = (optuna.storages.InMemoryStorage() if key is None
                                   else journal_storage(self.folder, device, kernel))
        return self._storages[key]

    def note(self, device: str, kernel: str, name: str, key: str, value: Any) -> None:
        """Note ``key = value`` on the study ``name`` (created when it does not exist yet)."""
        storage = self.storage(device, kernel)
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True)
        study.set_user_attr(key, value)

    def noted(self, device: str, kernel: str, name: str, key: str) -> Any:
        """The value noted for the study ``name`` (None when the study or the note does not exist)."""
        storage = self.storage(device, kernel)
        try:
            return storage.get_study_user_attrs(storage.get_study_id_from_name(name)).get(key)
        except KeyError:
            return None


def valid_configs(spec: KernelSpec, shape: dict[str, int]) -> list[Config] | None:
    """Every valid config (None when the space is too large to enumerate)."""
    return list(spec.configs(shape)) if spec.space_size() <= MAX_ENUMERATED else None


def choose_sampler(kind: str, n_valid: int | None, trials: int) -> str:
    if kind not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {kind!r}")
    if kind == "auto":
        return "exhaustive" if n_valid is not None and n_valid <= trials else "tpe"
    if kind == "exhaustive" and n_valid is None:
        raise ValueError("exhaustive search: the space is too large to enumerate")
    return kind


def make_sampler(kind: str, n_valid: int | None, seed: int) -> "optuna.samplers.BaseSampler":
    if kind == "tpe":
        startup = max(3, min(10, (n_valid or 80) // 8))
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True)
    return optuna.samplers.RandomSampler(seed=seed)  # random, and exhaustive (whose trials are all enqueued)


def ordinal(values: tuple) -> bool:
    """Sorted numbers (tile sizes, warps, stages, splits): searched by index, so neighbours inform each other."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return numbers and len(values) > 2 and list(values) == sorted(values)


def suggest(trial: "optuna.trial.Trial", space: dict[str, tuple]) -> Config:
    return {p: values[trial.suggest_int(p, 0, len(values) - 1)] if ordinal(values)
            else trial.suggest_categorical(p, list(values)) for p, values in space.items()}


def in_space(config: Config, space: dict[str, tuple]) -> bool:
    return config.keys() == space.keys() and all(v in space[p] for p, v in config.items())


def encode(config: Config, space: dict[str, tuple]) -> dict[str, Any]:
    """A config as the study's parameters (indices for ordinal parameters), for ``enqueue_trial``."""
    return {p: space[p].index(v) if ordinal(space[p]) else v for p, v in config.items()}


def _step(trial: "optuna.trial.FrozenTrial") -> Step | None:
    attrs = trial.user_attrs
    if trial.state != optuna.trial.TrialState.COMPLETE or "status" not in attrs:
        return None
    status = attrs["status"]
    older = {"wrong": WRONG, "error": LAUNCH, "fatal": LAUNCH}.get(status, "")  # trials stored before causes were
    outcome = Outcome(status, attrs.get("us", float("nan")), attrs.get("detail", ""), attrs.get("cause", older))
    return Step(trial.number, attrs["config"], outcome, not attrs.get("repeat", False))


def fail_leftovers(storage: "optuna.storages.BaseStorage", name: str) -> int:
    """Fail the trials of study ``name`` an earlier run left running or waiting (this run queues again what it
    wants); how many."""
    from optuna.trial import TrialState

    study_id = storage.get_study_id_from_name(name)
    left = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
    for trial in left:
        storage.set_trial_state_values(storage.get_trial_id_from_study_id_trial_number(study_id, trial.number),
                                       TrialState.FAIL)
    return len(left)


def search(
    spec: KernelSpec,
    shape: dict[str, int],
    evaluate: Callable[[Config], Outcome],
    *,
    name: str,
    storage: "optuna.storages.BaseStorage | None" = None,
    sampler: str = "auto",
    trials: int = 40,
    timeout: float | None = None,
    seeds: list[Config] = (),
    seed: int = 0,
    progress: bool = True,
    stop_below: float | None = None,
    only_seeds: bool = False,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchResult:
    """Run (or resume) the study ``name`` until ``trials`` new configs ran, the valid space is exhausted,
    ``timeout`` seconds passed or a config ran in at most ``stop_below`` us; ``seeds`` are tried first.
    ``only_seeds``: run the seeds the study has not measured yet and nothing else (``trials`` aside).
    ``deadline`` (on ``clock``): no evaluation starts after it (the result is then ``cut``)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    valid = valid_configs(spec, shape)
    kind = choose_sampler(sampler, None if valid is None else len(valid), trials)
    rng = random.Random(seed)
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                sampler=make_sampler(kind, None if valid is None else len(valid), seed))
    if storage is not None:
        fail_leftovers(storage, name)
    known: dict[str, Outcome] = {s.config: s.outcome for t in study.trials if (s := _step(t)) and s.new}
    queue = {config_text(c): c for c in [*seeds, *(valid if kind == "exhaustive" and not only_seeds else [])]}
    queued = [text for text, config in queue.items() if text not in known and in_space(config, spec.space)]
    for text in queued:  # not skip_if_exists: that also skips a config whose trial failed or was interrupted
        study.enqueue_trial(encode(queue[text], spec.space))
    valid_texts = None if valid is None else [config_text(c) for c in valid]
    goal = trials if valid is None else min(trials, sum(t not in known for t in valid_texts))
    if only_seeds:  # the enqueued seeds run first, one call each: stop after them
        goal = min(goal, len(queued))
    counts = {"new": 0, "calls": 0}
    lost: list[str] = []
    stopped: dict[str, Any] = {}  # "cut": the deadline passed; "interrupted": Ctrl-C (or SIGTERM) inside a trial
    bar = _progress(goal, name, progress)

    def measure(trial: "optuna.trial.Trial", config: Config) -> Outcome:
        """``evaluate(config)``, unless the deadline passed; a trial cut or interrupted is pruned (not recorded)."""
        if deadline is not None and clock() >= deadline:
            stopped["cut"] = True
        else:
            try:
                return evaluate(config)
            except KeyboardInterrupt as exc:
                stopped["interrupted"] = exc
        trial.study.stop()
        raise optuna.TrialPruned()

    def objective(trial: "optuna.trial.Trial") -> float:
        config = suggest(trial, spec.space)
        text = config_text(config)
        trial.set_user_attr("config", text)
        counts["calls"] += 1
        outcome = known.get(text)
        trial.set_user_attr("repeat", outcome is not None)
        if outcome is None:
            outcome = known[text] = measure(trial, config)
            if outcome.status != "invalid":
                counts["new"] += 1
                bar.update(1)
                best = min((o.us for o in known.values() if o.ok), default=None)
                if best is not None:
                    bar.set_postfix_str(f"best {best:.1f} us")
        trial.set_user_attr("status", outcome.status)
        trial.set_user_attr("us", outcome.us)
        trial.set_user_attr("detail", outcome.detail)
        trial.set_user_attr("cause", outcome.cause)
        if outcome.status == "fatal":
            lost.append(f"{text}: {outcome.detail}")
            trial.study.stop()
        return outcome.value

    def budget(study: "optuna.Study", trial: "optuna.trial.FrozenTrial") -> None:
        exhausted = valid is not None and all(t in known for t in valid_texts)
        reached = stop_below is not None and any(o.ok and o.us <= stop_below for o in known.values())
        seeded = only_seeds and counts["calls"] >= len(queued)
        if lost or counts["new"] >= goal or exhausted or reached or seeded or counts["calls"] >= 20 * max(goal, 1) + 100:
            study.stop()
        elif trial.user_attrs.get("repeat") and valid is not None:
            fresh = [c for c, t in zip(valid, valid_texts) if t not in known]
            study.enqueue_trial(encode(rng.choice(fresh), spec.space))

    try:
        if goal > 0:
            study.optimize(objective, timeout=timeout, callbacks=[budget])
    finally:
        bar.close()
    if "interrupted" in stopped:
        raise stopped["interrupted"]
    if lost:
        raise DeviceLost(f"{name}: {lost[0]}")
    steps = [s for t in sorted(study.trials, key=lambda t: t.number) if (s := _step(t))]
    return SearchResult(name, steps, cut=stopped.get("cut", False))


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=name.split("/", 1)[-1], file=sys.stderr, disable=not enabled, leave=False,
                unit="cfg")
