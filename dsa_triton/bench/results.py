"""Results files: where a run's files go, what stamps them (environment, git commit), and their tables.

Every results file records the commit it measured and whether the tree was dirty (:func:`git_state`). Runs are
filed by device and date: ``results/<device>/<YYYY-MM-DD>/<stem>-<device>-<YYYYMMDD-HHMMSS>.json|md``.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

from ..runtime import environment

REPO = Path(__file__).resolve().parents[2]
COMMIT_ENV = "DSA_GIT_COMMIT"  # "<sha>" or "<sha>-dirty": the commit a copy of the tree was made from


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the code that runs: ``$DSA_GIT_COMMIT`` when set (a copy of the tree sent
    to a GPU machine, whose ``.git`` need not match the files), else the checkout's git; ``commit: "unknown"``
    when neither says."""
    given = os.environ.get(COMMIT_ENV, "")
    if given:
        sha, _, flag = given.partition("-")
        return {"commit": sha, "dirty": flag == "dirty"}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True,
                             timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True, timeout=30).stdout
        return {"commit": sha, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def run_folder(root: str | Path, device: str, stamp: dt.datetime) -> Path:
    """``root/<device without the vendor>/<date>``: ``results/h200/<YYYY-MM-DD>``."""
    short = device.removeprefix("nvidia-")
    return Path(root) / short / f"{stamp:%Y-%m-%d}"


def fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x or math.isinf(x) else f"{x:.{digits}f}"


def dict_table(items: list[dict]) -> str:
    """A markdown table of report rows (the union of their keys, in first-seen order)."""
    cols = list(dict.fromkeys(k for row in items for k in row))
    cell = lambda v: fmt(v, 3) if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in cols) + " |" for row in items]
    return "\n".join(lines)


def finite_or_null(value):
    """``value`` with every NaN or infinite float, at any depth of its dicts, lists and tuples, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_results(root: str | Path, stem: str, sections: dict[str, list[dict[str, Any]]], *, note: str = "",
                  lead: str = "", data: dict[str, Any] | None = None, flat: bool = False) -> Path:
    """Write ``<stem>-<device>-<UTC date>.json`` and ``.md`` under :func:`run_folder` (``flat``: straight into
    ``root``), stamped with the environment and :func:`git_state`; returns the .md path.

    JSON: ``date``, ``environment``, ``git``, ``note``, ``data``'s items and one list of rows per section; strict
    (:func:`finite_or_null`: a figure not measured is null, never NaN).
    Markdown: a title, the environment and commit, ``note``, ``lead`` (a ready table) and one :func:`dict_table`
    per section.
    """
    env = environment()
    git = git_state()
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(root) if flat else run_folder(root, env["device"], stamp)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{env['device']}-{stamp:%Y%m%d-%H%M%S}"
    payload = {"date": stamp.isoformat(timespec="seconds"), "environment": env, "git": git, "note": note,
               **(data or {}), **sections}
    path.with_suffix(".json").write_text(json.dumps(finite_or_null(payload), indent=1, default=str, allow_nan=False)
                                         + "\n")
    dirty = " (dirty tree)" if git["dirty"] else ""
    text = [f"# {stem} on {env['device']}, {payload['date']}", "",
            " ".join(f"{k}={v}" for k, v in env.items()) + f" commit={git['commit']}{dirty}"]
    for part in (note, lead):
        if part:
            text += ["", part]
    for name, rows in sections.items():
        text += ["", f"## {name}", "", dict_table(rows) if rows else "(nothing)"]
    path.with_suffix(".md").write_text("\n".join(text) + "\n")
    return path.with_suffix(".md")
