"""Tuned launch configs per device, and the code that reads them: a leaf package (it imports nothing of
``dsa_triton``). The registry (:mod:`dsa_triton.registry`) opens the database and asks it for launch configs;
schema, lookup order and the stale-record policy: README.md and :mod:`tuning_db.database`.
"""
from .database import DEFAULT_FOLDER, ENV_VAR, Database
from .keys import ShapeKey, bucket, shape_from_text, shape_text
from .records import COLUMNS, Record, read_records, write_records

__all__ = ["COLUMNS", "DEFAULT_FOLDER", "ENV_VAR", "Database", "Record", "ShapeKey", "bucket", "read_records",
           "shape_from_text", "shape_text", "write_records"]
