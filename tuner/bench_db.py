"""``dsa-tune bench``: every stored record of this device re-checked and re-timed, tuned vs default vs baseline,
all three in the same run, plus whether an op would launch with the stored config right now."""
from __future__ import annotations

import math
from typing import Any

import torch

from dsa_triton import registry
from dsa_triton.bench.harness import error_text
from dsa_triton.runtime import device_name
from tuning_db import Database, Record

from .objective import Evaluator
from .tune import timing_budget


def bench_record(record: Record, device: torch.device, db: Database) -> dict[str, Any]:
    spec = registry.get(record.kernel)
    shape = record.shape_dict()
    budget = timing_budget(device)
    evaluator = Evaluator(spec, record.phase, shape, device)
    tuned, default = record.config_dict(), dict(spec.default(record.phase, shape))
    failures = {name: evaluator.check(c) for name, c in (("tuned", tuned), ("default", default))}
    ok = {name: c for name, c in (("tuned", tuned), ("default", default)) if failures[name] is None}
    times = dict.fromkeys(("tuned", "default"), math.nan)
    times.update(zip(ok, evaluator.time_all(list(ok.values()), budget["final_warmup_ms"], budget["final_rep_ms"])))
    base = evaluator.time_baseline(budget["final_warmup_ms"], budget["final_rep_ms"])
    failed = [f"{name} {f.cause or f.status}: {f.detail}" for name, f in failures.items() if f is not None]
    check = "; ".join(failed) or "ok"
    return {"kernel": record.kernel, "phase": record.phase, "shape": record.shape, "config": record.config,
            "tuned us": times["tuned"], "default us": times["default"], "baseline": spec.baseline_name or "-",
            "baseline us": base, "tuned/default": times["default"] / times["tuned"],
            "baseline/tuned": base / times["tuned"], "stored tuned/default": record.speedup(),
            "ops use it": spec.launch_config(record.phase, shape, device) == tuned,
            "fresh": db.is_fresh(record), "timing": evaluator.timing or "eager", "stored timing": record.timing,
            "check": check}


def bench(db: Database, device: torch.device, kernels: list[str] | None = None, log=print) -> list[dict[str, Any]]:
    """One row per stored record of ``device`` whose kernel is registered (and named in ``kernels``)."""
    rows = []
    names = {s.name for s in registry.kernels()}
    records = [r for r in db.records(device_name(device)) if r.kernel in names and (not kernels or r.kernel in kernels)]
    for i, record in enumerate(records):
        try:
            rows.append(bench_record(record, device, db))
        except Exception as exc:  # one broken record must not hide the others
            rows.append({"kernel": record.kernel, "phase": record.phase, "shape": record.shape,
                         "check": error_text(exc, "error: ")})
        log(f"[{i + 1}/{len(records)}] {record.kernel} {record.phase} {record.shape}: {rows[-1]['check']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
