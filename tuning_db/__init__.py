"""Tuned launch configs per device, and the code that reads them.

``import dsa_triton`` installs the database in ``$DSA_TUNING_DB`` (default: ``tuning_db/data``) as the registry's
config lookup, once and in plain sight, so every op launches with the stored config for its shape; :func:`use`
installs another folder. Schema, lookup order and the stale-record policy: README.md and :mod:`tuning_db.database`.
"""
from __future__ import annotations

from pathlib import Path

import dsa_triton  # noqa: F401  (first: the registry this database serves; its import installs the default database)

from .database import DEFAULT_FOLDER, ENV_VAR, Database, install, installed
from .records import COLUMNS, Record, read_records, write_records


def use(folder: str | Path | None = None) -> Database:
    """Install the database in ``folder`` (None: ``$DSA_TUNING_DB`` or the packaged one) and return it."""
    return install(Database(folder))


def active() -> Database:
    """The installed database."""
    return installed() or use()


__all__ = ["COLUMNS", "DEFAULT_FOLDER", "ENV_VAR", "Database", "Record", "active", "read_records", "use",
           "write_records"]
