"""Results files of ``dsa-tune bench`` and ``compare``: ``<stem>-<device>-<date>.json`` and ``.md``, stamped
with the environment (device, versions) and the date."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from dsa_triton.bench import dict_table
from dsa_triton.runtime import environment


def write_results(out: str | Path, stem: str, sections: dict[str, list[dict[str, Any]]], note: str = "") -> Path:
    """Write every section (rows of dicts) as JSON and as markdown tables; returns the .md path."""
    env = environment()
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{env['device']}-{stamp:%Y%m%d-%H%M%S}"
    payload = {"date": stamp.isoformat(timespec="seconds"), "environment": env, "note": note, **sections}
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    text = [f"# {stem} on {env['device']}, {payload['date']}", "", " ".join(f"{k}={v}" for k, v in env.items())]
    if note:
        text += ["", note]
    for name, rows in sections.items():
        text += ["", f"## {name}", "", dict_table(rows) if rows else "(nothing)"]
    path.with_suffix(".md").write_text("\n".join(text) + "\n")
    return path.with_suffix(".md")
