"""The tuning database: per-device record files in one folder, and the run-time config lookup.

Lookup for (kernel, phase, exact shape, device), host side only:

1. ``exact``: a record for the same exact shape;
2. ``bucket``: a record with the same shape key (fixed dims equal, counts in the same power-of-two bucket);
3. ``nearest``: same fixed dims, other buckets;
4. nothing: the registry falls back to the kernel's default.

Within a level the record whose bucketed dims are nearest in log2 distance wins (ties: the smaller shape).

A record made by other code (its kernel source hash or Triton version differs from what runs now) is
*stale*: it is still used, since every config of the space is a correct one and only its speed may have
moved, but within each level a fresh record wins, ``dsa-tune show`` flags it and ``dsa-tune tune``
re-tunes it. A stored config that is no longer valid for the shape (the space changed) is skipped.
Merging keeps one record per (device, kernel, phase, exact shape): a fresh one over a stale one, then a
graph-timed one over an eager one, then a tuned one over an untuned one (``status``), else the faster.

A study's seeds (:meth:`Database.nearest_configs`) look further than the lookup: any record of the kernel and
phase, whatever its fixed dims (another model's), nearest over every dim of the shape key.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from .keys import ShapeKey, shape_text
from .records import Record, read_records, update_file

DEFAULT_FOLDER = Path(__file__).resolve().parent / "data"
ENV_VAR = "DSA_TUNING_DB"
LEVELS = ("exact", "bucket", "nearest")


class Kernel(Protocol):
    """What a lookup needs of a kernel (the registry's ``LaunchSpace`` has it): its name, its shape-key dims, its
    shape key and whether a config is valid for a shape."""

    name: str
    fixed_dims: tuple[str, ...]
    bucketed_dims: tuple[str, ...]

    def shape_key(self, phase: str, shape: dict[str, int]) -> ShapeKey: ...

    def is_valid(self, config: dict[str, Any], shape: dict[str, int]) -> bool: ...


@functools.cache
def triton_version() -> str:
    import triton

    return triton.__version__


def log_distance(a: dict[str, int], b: dict[str, int], dims: Iterable[str]) -> float:
    """Sum over ``dims`` of |log2 a - log2 b| (counts below 1 count as 1)."""
    return sum(abs(math.log2(max(a[d], 1)) - math.log2(max(b[d], 1))) for d in dims)


def shape_distance(a: dict[str, int], b: dict[str, int], dims: Iterable[str]) -> float:
    """:func:`log_distance` where a dim that differs costs at least 1 (flags such as ``softmax`` 0 / 1 count)."""
    return sum(max(log_distance(a, b, (d,)), float(a[d] != b[d])) for d in dims)


class Database:
    """Records under ``folder`` (default: ``$DSA_TUNING_DB``, else ``tuning_db/data``), one ``<device>.csv`` each.

    ``source_hash(kernel)``: the hash of the code that runs now for a kernel name (None: no such kernel); a record
    of another hash is stale. Without it every record counts as stale. Files are read once per device and indexed;
    :meth:`add` and :meth:`merge_files` write atomically and refresh the index, which bumps :attr:`generation` (what
    caches of lookups key on).
    """

    def __init__(self, folder: str | Path | None = None, source_hash: Callable[[str], str | None] | None = None):
        self.folder = Path(folder or os.environ.get(ENV_VAR) or DEFAULT_FOLDER)
        self.source_hash = source_hash
        self.generation = 0
        self._by_device: dict[str, dict[tuple[str, str], list[Record]]] = {}
        self._hashes: dict[str, str | None] = {}

    def __repr__(self) -> str:
        return f"Database({str(self.folder)!r})"

    # -- files ------------------------------------------------------------------------------
    def path(self, device: str) -> Path:
        return self.folder / f"{device}.csv"

    def devices(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.csv")) if self.folder.is_dir() else []

    def records(self, device: str | None = None) -> list[Record]:
        """Every record of ``device`` (all devices when None), sorted."""
        devices = self.devices() if device is None else [device]
        return [r for d in devices for group in self._index(d).values() for r in group]

    def _index(self, device: str) -> dict[tuple[str, str], list[Record]]:
        if device not in self._by_device:
            index: dict[tuple[str, str], list[Record]] = {}
            for r in read_records(self.path(device)):
                index.setdefault((r.kernel, r.phase), []).append(r)
            self._by_device[device] = index
        return self._by_device[device]

    def refresh(self) -> None:
        """Forget what was read and bump :attr:`generation`."""
        self._by_device.clear()
        self._hashes.clear()
        self.generation += 1

    # -- freshness ----------------------------------------------------------------------------
    def current_hash(self, kernel: str) -> str | None:
        """The source hash of the code that runs ``kernel`` now (None: unknown kernel, or no ``source_hash``)."""
        if kernel not in self._hashes:
            self._hashes[kernel] = None if self.source_hash is None else self.source_hash(kernel)
        return self._hashes[kernel]

    def is_fresh(self, record: Record) -> bool:
        """Made by the code and Triton version that run now."""
        return record.source_hash == self.current_hash(record.kernel) and record.triton == triton_version()

    def prefer(self, record: Record) -> tuple:
        """Merge order: fresh before stale, graph-timed before eager (device time, not the host's launch path),
        tuned before untuned (a searched shape stays searched, so a later run does not search it again), then
        faster."""
        return (not self.is_fresh(record), record.timing != "graph", not record.tuned, record.median_us)

    # -- writing ------------------------------------------------------------------------------
    def add(self, records: Iterable[Record]) -> None:
        """Merge ``records`` into their devices' files (atomic per file)."""
        by_device: dict[str, list[Record]] = {}
        for r in records:
            by_device.setdefault(r.device, []).append(r)
        for device, group in by_device.items():
            update_file(self.path(device), group, self.prefer)
        self.refresh()

    def merge_files(self, paths: Iterable[str | Path]) -> int:
        """Merge record files (of any devices) into this database; returns how many records were read."""
        incoming = [r for p in paths for r in read_records(_existing(p))]
        self.add(incoming)
        return len(incoming)

    # -- lookup -------------------------------------------------------------------------------
    def matches(self, spec: Kernel, phase: str, shape: dict[str, int], device: str) -> list[tuple[str, Record]]:
        """Stored records usable for this shape, best first, each with its level (exact, bucket, nearest)."""
        key = spec.shape_key(phase, shape).as_dict()
        exact = shape_text(shape)
        ranked = []
        for r in self._index(device).get((spec.name, phase), []):
            r_key = ShapeKey.parse(r.shape_key).as_dict()
            if r_key.keys() != key.keys() or any(r_key[d] != key[d] for d in spec.fixed_dims):
                continue  # another problem (fixed dims), or made when the kernel had other dims
            if r.shape == exact:
                level = 0
            elif r_key == key:
                level = 1
            else:
                level = 2
            distance = log_distance(r.shape_dict(), shape, spec.bucketed_dims)
            ranked.append(((level, not self.is_fresh(r), distance, r.sort_key()), LEVELS[level], r))
        ranked.sort(key=lambda item: item[0])
        return [(level, r) for _, level, r in ranked]

    def match(self, spec: Kernel, phase: str, shape: dict[str, int], device: str) -> tuple[str, Record] | None:
        """The record a launch uses (level, record), or None: the first match whose config is valid here."""
        for level, r in self.matches(spec, phase, shape, device):
            if spec.is_valid(r.config_dict(), shape):
                return level, r
        return None

    def lookup(self, spec: Kernel, phase: str, shape: dict[str, int], device: str) -> dict[str, Any] | None:
        """A stored config valid for ``shape`` (what the registry's launch configs ask), or None."""
        found = self.match(spec, phase, dict(shape), device)
        return None if found is None else found[1].config_dict()

    def nearest_configs(self, spec: Kernel, phase: str, shape: dict[str, int], device: str, n: int = 3) -> list[dict]:
        """Up to ``n`` distinct stored configs valid for ``shape``, nearest first: the seeds of a study.

        Unlike the run-time lookup, fixed dims need not match (another model's records seed a new model's
        shapes): records rank by :func:`shape_distance` over every dim of the shape key, then searched before
        untuned, then fresh before stale; a config not valid for ``shape`` is passed over.
        """
        key = spec.shape_key(phase, shape).as_dict()
        dims = (*spec.fixed_dims, *spec.bucketed_dims)
        ranked = []
        for r in self._index(device).get((spec.name, phase), []):
            r_shape = r.shape_dict()
            if ShapeKey.parse(r.shape_key).as_dict().keys() != key.keys() or not set(dims) <= r_shape.keys():
                continue  # made when the kernel had other dims
            ranked.append(((shape_distance(r_shape, shape, dims), not r.tuned, not self.is_fresh(r), r.sort_key()), r))
        ranked.sort(key=lambda item: item[0])
        out: list[dict] = []
        for _, r in ranked:
            config = r.config_dict()
            if config not in out and spec.is_valid(config, shape):
                out.append(config)
            if len(out) == n:
                break
        return out


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"merge: no record file at {path}")
    return path
