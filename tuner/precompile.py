"""Compile many configs at once: worker processes run each config's correctness check, which fills Triton's
on-disk cache, so the timing process (one at a time, so timings do not disturb each other) finds every
kernel compiled. Used on a GPU, where compiling dominates: before an exhaustive search (the configs of one job,
:func:`precompile`), and before a budgeted run's pass over the known configs of every job (one job per task,
:func:`precompile_jobs`).

Each worker is a spawned process (CUDA does not survive a fork) with its own inputs and reference. A
config that breaks a worker's CUDA context is reported ``fatal`` and the timing process never runs it;
the worker passes on every config after that (the timing process checks those itself). A worker that
cannot start or dies only costs the speed-up: the timing process then checks (and compiles) as usual. So does a
task left when the time given runs out: the workers are then stopped. Workers ignore Ctrl-C (the timing process
handles it and stops them).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor, wait
from typing import Any, Callable

from .objective import Evaluator, Outcome

_worker: dict[str, Any] = {}


def _start(kernel: str, phase: str, shape: dict[str, int], device: str) -> None:
    _worker["broken"] = True  # until the evaluator exists: pass on everything
    import dsa_triton  # noqa: F401  (registers the kernels in this process)
    from dsa_triton import registry

    try:
        _worker["evaluator"] = Evaluator(registry.get(kernel), phase, shape, device, rotate=False)
        _worker["broken"] = False
    except Exception:  # e.g. out of memory beside the other workers
        pass


def _check(item: tuple[str, dict]) -> tuple[str, Outcome | None]:
    text, config = item
    if _worker["broken"]:
        return text, None
    outcome = _worker["evaluator"].check(config)
    _worker["broken"] = outcome is not None and outcome.status == "fatal"
    return text, outcome


def _check_job(item: tuple[str, str, dict[str, int], str, list[dict]]) -> dict[str, Outcome | None]:
    """One job's configs in this worker: config JSON -> the check's outcome (None: passed); empty when the
    worker's CUDA context broke earlier or the job's inputs cannot be built here."""
    import gc

    import torch

    from tuning_db.records import config_text

    kernel, phase, shape, device, configs = item
    if _worker.get("broken"):
        return {}
    import dsa_triton  # noqa: F401  (registers the kernels in this process)
    from dsa_triton import registry

    try:
        evaluator = Evaluator(registry.get(kernel), phase, shape, device, rotate=False)
    except Exception:  # e.g. out of memory beside the other workers: the timing process checks it itself
        return {}
    out: dict[str, Outcome | None] = {}
    for config in configs:
        out[config_text(config)] = outcome = evaluator.check(config)
        if outcome is not None and outcome.status == "fatal":
            _worker["broken"] = True
            break
    del evaluator
    gc.collect()
    if torch.device(device).type == "cuda" and not _worker.get("broken"):
        torch.cuda.empty_cache()  # the next job's inputs need the memory
    return out


def _quiet(start: Callable[..., None] | None = None, *args: Any) -> None:
    """A worker's initializer: Ctrl-C is the parent's to handle (no traceback from every worker), then
    ``start(*args)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if start is not None:
        start(*args)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel the tasks not started and end the workers, busy ones included."""
    processes = list((pool._processes or {}).values())  # the executor has no public way to end a busy worker
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()


def run_in_workers(fn: Callable[[Any], Any], items: list, workers: int, seconds: float | None = None,
                   start: Callable[..., None] | None = None, initargs: tuple = ()) -> list:
    """``fn(item)`` for each item in spawned worker processes (each started with ``start(*initargs)``), tasks
    handed out in order; per item its result, or None when it raised, its worker died or ``seconds`` passed first
    (the workers are then stopped)."""
    if seconds is not None and seconds <= 0:
        return [None] * len(items)
    pool = ProcessPoolExecutor(min(workers, len(items)), mp_context=multiprocessing.get_context("spawn"),
                               initializer=_quiet, initargs=(start, *initargs))
    finished = False
    try:
        futures = [pool.submit(fn, item) for item in items]
        done, pending = wait(futures, timeout=seconds)
        finished = not pending
        return [f.result() if f in done and f.exception() is None else None for f in futures]
    finally:
        if finished:
            pool.shutdown()
        else:
            _stop(pool)


def precompile_jobs(jobs: list[tuple[str, str, dict[str, int], list[dict]]], device: str, workers: int | None = None,
                    seconds: float | None = None) -> list[dict[str, Outcome]]:
    """On a GPU, check the configs of many jobs ``(kernel, phase, shape, configs)`` in worker processes, one job per
    task in order, for at most ``seconds``; returns per job the configs to skip (JSON -> fatal outcome). Elsewhere
    nothing is compiled ahead."""
    workers = workers or default_workers()
    if not str(device).startswith("cuda") or workers < 2 or len(jobs) < 2:
        return [{} for _ in jobs]
    items = [(kernel, phase, shape, str(device), configs) for kernel, phase, shape, configs in jobs]
    checked = run_in_workers(_check_job, items, workers, seconds)
    return [{t: o for t, o in (c or {}).items() if o is not None and o.status == "fatal"} for c in checked]


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def check_in_workers(kernel: str, phase: str, shape: dict[str, int], device: str, configs: list[dict],
                     workers: int, seconds: float | None = None) -> dict[str, Outcome | None]:
    """Config JSON -> the check's outcome in a worker (None: passed, or not checked after a fatal one); a config
    whose worker died or that ``seconds`` did not reach is left out (the caller checks it itself)."""
    from tuning_db.records import config_text

    items = [(config_text(c), c) for c in configs]
    checked = run_in_workers(_check, items, workers, seconds, _start, (kernel, phase, shape, device))
    return dict(c for c in checked if c is not None)


def precompile(evaluator: Evaluator, configs: list[dict], workers: int | None = None,
               seconds: float | None = None) -> dict[str, Outcome]:
    """On a GPU, check ``configs`` in worker processes for at most ``seconds``; returns the configs to skip: JSON
    -> fatal outcome."""
    workers = workers or default_workers()
    if evaluator.device.type != "cuda" or workers < 2 or len(configs) < 2:
        return {}  # the interpreter compiles nothing
    checked = check_in_workers(evaluator.spec.name, evaluator.phase, evaluator.shape, str(evaluator.device),
                               configs, workers, seconds)
    return {text: o for text, o in checked.items() if o is not None and o.status == "fatal"}
