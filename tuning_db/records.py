"""Tuning records and their files: one CSV per device, sorted rows, stable columns (they diff well).

A record is the tuner's verdict for one (device, kernel, phase, exact shape): the config that won, its
median time, the default config's and the baseline's times measured in the same run, and what code and
Triton version produced it. Files are rewritten atomically (temp file + ``os.replace``) under a lock,
so concurrent tuners (one per GPU) can add to the same file.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .keys import ShapeKey, shape_from_text

NUMERIC = ("median_us", "default_us", "baseline_us")


@dataclass(frozen=True)
class Record:
    """One tuned shape. ``shape`` is the exact shape (``B=3,L=5000``), ``shape_key`` its bucket with the phase."""

    device: str
    triton: str
    kernel: str
    source_hash: str
    phase: str
    shape_key: str
    shape: str
    dtypes: str
    config: str  # JSON, sorted keys
    median_us: float
    default_us: float
    baseline_us: float
    trials: int
    date: str
    timing: str = "eager"  # how the three times were taken: "graph" (CUDA-graph replay) or "eager"
    status: str = "tuned"  # "tuned": a search ran; "untuned": the best known config only (nearest seed or default)

    @property
    def tuned(self) -> bool:
        """A search ran for this shape (an ``untuned`` record holds the best config known without one)."""
        return self.status != "untuned"

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Identity in the database: one record per (device, kernel, phase, exact shape)."""
        return (self.device, self.kernel, self.phase, self.shape)

    def config_dict(self) -> dict[str, Any]:
        return json.loads(self.config)

    def shape_dict(self) -> dict[str, int]:
        return shape_from_text(self.shape)

    def speedup(self) -> float:
        """default_us / median_us (NaN when the default was not measured)."""
        return self.default_us / self.median_us if self.median_us > 0 else math.nan

    def sort_key(self) -> tuple:
        return (self.device, self.kernel, self.phase, ShapeKey.parse(self.shape_key).dims,
                tuple(sorted(self.shape_dict().items())))


COLUMNS = tuple(f.name for f in fields(Record))


def config_text(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def read_records(path: str | Path) -> list[Record]:
    """Every record of one CSV file (missing file: none)."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        return []
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    for f in fields(Record):  # a column added after a file was written: its default (timing: all eager then;
        # status: every record was searched then)
        if f.name not in frame.columns and f.default is not MISSING:
            frame[f.name] = str(f.default)
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: not a tuning record file, it lacks the columns {missing}")
    out = []
    for row in frame[list(COLUMNS)].to_dict("records"):
        for name in NUMERIC:
            row[name] = float(row[name]) if row[name] not in ("", "nan") else math.nan
        row["trials"] = int(row["trials"])
        out.append(Record(**row))
    return out


def write_records(path: str | Path, records: Iterable[Record]) -> None:
    """Write ``records`` sorted, with the fixed column order, atomically (temp file + os.replace)."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in sorted(records, key=Record.sort_key)]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            frame.to_csv(f, index=False, lineterminator="\n", float_format="%.3f")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock beside ``path`` (``.<name>.lock``) for read-modify-write cycles."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def combine(records: Iterable[Record], prefer: Callable[[Record], tuple]) -> list[Record]:
    """One record per :attr:`Record.key`: the one with the smallest ``prefer(record)``."""
    best: dict[tuple, Record] = {}
    for r in records:
        old = best.get(r.key)
        if old is None or prefer(r) < prefer(old):
            best[r.key] = r
    return sorted(best.values(), key=Record.sort_key)


def update_file(path: str | Path, new: Iterable[Record], prefer: Callable[[Record], tuple]) -> list[Record]:
    """Merge ``new`` into the file at ``path`` (locked, atomic); returns what the file now holds."""
    path = Path(path)
    new = list(new)
    with locked(path):
        merged = combine([*read_records(path), *new], prefer)
        write_records(path, merged)
    return merged
