"""How fast does the sampler find a good config? Exhaustive best vs TPE (and random) on one kernel and shape.

Every valid config is checked and timed once (the exhaustive search); then each sampler is replayed on
those measurements (same timings for both, so the comparison is free of run-to-run noise), seeded with
the default like a real study, several times with different sampler seeds. Reported per run: the configs
run until one came within ``within`` (5%) of the exhaustive best, and that count as a fraction of the
valid space (the goal: at most 25%).
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from dsa_triton.registry import ConfigError, KernelSpec
from dsa_triton.registry import shape_text
from tuning_db.records import config_text

from .objective import Evaluator, Outcome
from .precompile import precompile
from .study import SearchResult, search, valid_configs
from .tune import timing_budget


def runs_to_reach(result: SearchResult, target_us: float) -> tuple[int, int]:
    """(configs run, trials) until the best so far is at most ``target_us``; (-1, -1) if never."""
    runs = 0
    for step in result.steps:
        if step.new and step.outcome.status != "invalid":
            runs += 1
        if step.outcome.ok and step.outcome.us <= target_us:
            return runs, step.number + 1
    return -1, -1


def exhaustive(evaluator: Evaluator, configs: list[dict], progress: bool, workers: int | None = None) -> dict[str, Outcome]:
    """Every config checked and timed (compiled first in parallel on a GPU)."""
    from tqdm import tqdm

    skip = precompile(evaluator, configs, workers)
    bar = tqdm(configs, desc=f"exhaustive {evaluator.spec.name} {evaluator.key}", disable=not progress, leave=False)
    return {config_text(c): skip.get(config_text(c)) or evaluator.evaluate(c) for c in bar}


def compare_kernel(spec: KernelSpec, phase: str, shape: dict[str, int], device: torch.device, *,
                   samplers: tuple[str, ...] = ("tpe", "random"), repeats: int = 5, within: float = 0.05,
                   progress: bool = True, workers: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Returns (summary row, one row per sampler run)."""
    budget = timing_budget(device)
    configs = valid_configs(spec, shape)
    if not configs:
        raise ValueError(f"{spec.name}: no valid config to compare (or the space is too large to enumerate)")
    evaluator = Evaluator(spec, phase, shape, device, budget["trial_warmup_ms"], budget["trial_rep_ms"])
    table = exhaustive(evaluator, configs, progress, workers)
    ok = {c: o.us for c, o in table.items() if o.ok}
    if not ok:
        raise ValueError(f"{spec.name}: no config passed the reference check")
    best = min(ok, key=ok.get)
    target = ok[best] * (1 + within)
    default = config_text(dict(spec.default(phase, shape)))

    def replay(config: dict) -> Outcome:
        try:
            spec.validate(config, shape)
        except ConfigError as exc:
            return Outcome("invalid", detail=str(exc))
        return table[config_text(config)]

    runs = []
    for sampler in samplers:
        for seed in range(repeats):
            result = search(spec, shape, replay, name=f"compare-{sampler}-{seed}", sampler=sampler,
                            trials=len(configs), seeds=[dict(spec.default(phase, shape))], seed=seed,
                            progress=False, stop_below=target)
            n, trials = runs_to_reach(result, target)
            runs.append({"kernel": spec.name, "phase": phase, "shape": shape_text(shape), "sampler": sampler,
                         "seed": seed, "configs run": n, "trials": trials,
                         "fraction of space": n / len(configs) if n > 0 else float("nan")})
    summary = {"kernel": spec.name, "phase": phase, "shape": shape_text(shape), "valid configs": len(configs),
               "grid": spec.space_size(), "passed check": len(ok), "best": best, "best us": ok[best],
               "default us": ok.get(default, float("nan")),
               "default/best": ok[default] / ok[best] if default in ok else float("nan")}
    for sampler in samplers:
        mine = [r["configs run"] for r in runs if r["sampler"] == sampler and r["configs run"] > 0]
        summary[f"{sampler} median runs to {within:.0%}"] = statistics.median(mine) if mine else float("nan")
        summary[f"{sampler} fraction"] = statistics.median(mine) / len(configs) if mine else float("nan")
        summary[f"{sampler} worst fraction"] = max(mine) / len(configs) if mine else float("nan")
    return summary, runs
