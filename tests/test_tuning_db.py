"""Tuning database: record files, lookup order (exact, bucket, nearest, default), staleness, merge, install."""
import math
import os
import subprocess
import sys
import threading

import pytest

import tuning_db
from dsa_triton import registry
from tuning_db import records as rec
from tuning_db.database import Database, shape_distance, triton_version
from dsa_triton.registry import shape_text
from tuning_db.records import Record, config_text, read_records, write_records

from .test_tuner_toys import database, registered, toy_spec

DEV = "cpu-interpreter"


def record(shape: dict, config: dict, median_us: float = 10.0, phase: str = "decode", kernel: str = "toy_axpy",
           source_hash: str | None = None, device: str = DEV, baseline_us: float = 20.0,
           timing: str = "eager", status: str = "tuned") -> Record:
    spec = registry.get(kernel) if kernel in {s.name for s in registry.kernels()} else toy_spec(kernel)
    return Record(device=device, triton=triton_version(), kernel=kernel,
                  source_hash=spec.source_hash() if source_hash is None else source_hash, phase=phase,
                  shape_key=str(spec.shape_key(phase, shape)), shape=shape_text(shape), dtypes="x=float32",
                  config=config_text(config), median_us=median_us, default_us=2 * median_us,
                  baseline_us=baseline_us, trials=7, date="2026-11-30T00:00:00Z", timing=timing,
                  status=status)


B128 = {"BLOCK": 128, "num_warps": 2}
B64 = {"BLOCK": 64, "num_warps": 4}
B16 = {"BLOCK": 16, "num_warps": 1}
DEFAULT = {"BLOCK": 32, "num_warps": 1}


@pytest.fixture
def spec():
    with registered(toy_spec()) as (s,):
        yield s


def test_record_file_round_trip_sorted_stable(tmp_path):
    rows = [record({"T": 16, "D": 40}, B64, 3.14159), record({"T": 4, "D": 40}, B16, baseline_us=math.nan),
            record({"T": 4, "D": 40}, B128, phase="prefill"), record({"T": 100, "D": 8}, B64)]
    path = tmp_path / "dev.csv"
    write_records(path, rows)
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(rec.COLUMNS)
    # sorted by kernel, phase, then numerically by shape key: D=8 before D=40, T=4 before T=16
    assert [line.split(",")[4] for line in lines[1:]] == ["decode"] * 3 + ["prefill"]
    back = read_records(path)
    assert [r.shape for r in back] == ["D=8,T=100", "D=40,T=4", "D=40,T=16", "D=40,T=4"]
    assert math.isnan(back[1].baseline_us)
    assert back[2].median_us == pytest.approx(3.142) and back[2].config_dict() == B64
    # rewriting what was read gives the same bytes (diffs stay small)
    write_records(path, reversed(back))
    assert path.read_text().splitlines() == lines


def test_files_without_the_timing_column_read_as_eager(tmp_path):
    path = tmp_path / "old.csv"
    write_records(path, [record({"T": 4, "D": 40}, B64, timing="graph")])
    header, row = path.read_text().splitlines()
    assert header.endswith(",timing,status") and row.endswith(",graph,tuned")
    path.write_text(header.rsplit(",", 2)[0] + "\n" + row.rsplit(",", 2)[0] + "\n")  # a file of before the columns
    (back,) = read_records(path)
    assert back.timing == "eager" and back.config_dict() == B64


def test_files_without_the_status_column_read_as_tuned(tmp_path):
    path = tmp_path / "old.csv"
    write_records(path, [record({"T": 4, "D": 40}, B64, status="untuned")])
    header, row = path.read_text().splitlines()
    assert header.endswith(",timing,status") and row.endswith(",eager,untuned")
    assert not read_records(path)[0].tuned
    path.write_text(header.rsplit(",", 1)[0] + "\n" + row.rsplit(",", 1)[0] + "\n")  # a file of before the column
    (back,) = read_records(path)
    assert back.status == "tuned" and back.tuned and back.timing == "eager"


def test_read_rejects_a_foreign_csv(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        read_records(path)


def test_lookup_order_exact_bucket_nearest_default(spec, tmp_path):
    with database(tmp_path) as db:
        db.add([record({"T": 3, "D": 40}, B128), record({"T": 4, "D": 40}, B64), record({"T": 64, "D": 40}, B16),
                record({"T": 3, "D": 48}, B16)])
        assert db.match(spec, "decode", {"T": 3, "D": 40}, DEV)[0] == "exact"
        assert spec.launch_config("decode", {"T": 3, "D": 40}, "cpu") == B128
        # T=4 and T=3 share the bucket 4: each exact record wins for its own shape
        assert spec.launch_config("decode", {"T": 4, "D": 40}, "cpu") == B64
        assert db.match(spec, "decode", {"T": 4, "D": 40}, DEV)[0] == "exact"
        # no record for T=2 (bucket 2): nearest bucket in log2 distance is 4 (distance 1), not 64
        assert db.match(spec, "decode", {"T": 2, "D": 40}, DEV)[0] == "nearest"
        assert spec.launch_config("decode", {"T": 2, "D": 40}, "cpu") == B128  # tie: the smaller shape (T=3)
        # T=40 (bucket 64): same bucket as the T=64 record
        assert db.match(spec, "decode", {"T": 40, "D": 40}, DEV)[0] == "bucket"
        assert spec.launch_config("decode", {"T": 40, "D": 40}, "cpu") == B16
        # another fixed dim (D=24) or phase has no record: the default
        assert db.match(spec, "decode", {"T": 3, "D": 24}, DEV) is None
        assert spec.launch_config("decode", {"T": 3, "D": 24}, "cpu") == DEFAULT
        assert spec.launch_config("prefill", {"T": 3, "D": 40}, "cpu") == DEFAULT
        # another device's file is not consulted
        assert db.lookup(spec, "decode", {"T": 3, "D": 40}, "nvidia-h200") is None


def test_same_bucket_prefers_the_nearest_exact_shape(spec, tmp_path):
    with database(tmp_path) as db:
        db.add([record({"T": 33, "D": 40}, B128), record({"T": 60, "D": 40}, B64)])
        assert spec.launch_config("decode", {"T": 58, "D": 40}, "cpu") == B64
        assert spec.launch_config("decode", {"T": 35, "D": 40}, "cpu") == B128


def test_nearest_ties_and_distance(spec, tmp_path):
    with database(tmp_path) as db:
        db.add([record({"T": 2, "D": 40}, B16), record({"T": 32, "D": 40}, B64), record({"T": 512, "D": 40}, B128)])
        assert spec.launch_config("decode", {"T": 8, "D": 40}, "cpu") == B16  # 2 and 32 both 2 octaves away: the smaller
        assert spec.launch_config("decode", {"T": 16, "D": 40}, "cpu") == B64
        assert spec.launch_config("decode", {"T": 4096, "D": 40}, "cpu") == B128


def test_invalid_stored_config_is_skipped(spec, tmp_path):
    with database(tmp_path) as db:
        db.add([record({"T": 4, "D": 40}, {"BLOCK": 16, "num_warps": 4}),  # breaks the constraint
                record({"T": 8, "D": 40}, B64)])
        assert db.match(spec, "decode", {"T": 4, "D": 40}, DEV)[0] == "nearest"
        assert spec.launch_config("decode", {"T": 4, "D": 40}, "cpu") == B64


def test_stale_records_are_used_but_fresh_ones_win(spec, tmp_path):
    with database(tmp_path) as db:
        db.add([record({"T": 3, "D": 40}, B128, 1.0, source_hash="0ld0ld0ld0ld")])
        assert not db.is_fresh(db.records(DEV)[0])
        assert spec.launch_config("decode", {"T": 3, "D": 40}, "cpu") == B128  # still used
        assert spec.launch_config("decode", {"T": 2, "D": 40}, "cpu") == B128
        db.add([record({"T": 4, "D": 40}, B64, 5.0)])
        assert spec.launch_config("decode", {"T": 3, "D": 40}, "cpu") == B128  # exact beats fresh
        # within one level a fresh record wins (the tie-break alone would pick the smaller shape, T=3)
        assert spec.launch_config("decode", {"T": 2, "D": 40}, "cpu") == B64
        db.add([record({"T": 3, "D": 40}, B16, 9.0)])  # fresh, same exact shape: replaces the faster stale one
        assert [r.config_dict() for r in db.records(DEV) if r.shape == "D=40,T=3"] == [B16]


def test_merge_keeps_the_faster_record_per_shape(spec, tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_records(a, [record({"T": 4, "D": 40}, B64, 5.0), record({"T": 8, "D": 40}, B64, 5.0)])
    write_records(b, [record({"T": 4, "D": 40}, B128, 4.0), record({"T": 8, "D": 40}, B128, 6.0),
                      record({"T": 8, "D": 40}, B16, 1.0, device="nvidia-h200")])
    db = Database(tmp_path / "db")
    assert db.merge_files([a, b]) == 5
    assert db.devices() == [DEV, "nvidia-h200"]
    got = {r.shape: (r.config_dict(), r.median_us) for r in db.records(DEV)}
    assert got == {"D=40,T=4": (B128, 4.0), "D=40,T=8": (B64, 5.0)}
    assert len(db.records("nvidia-h200")) == 1
    # merging the same files again changes nothing
    before = db.path(DEV).read_text()
    db.merge_files([b, a])
    assert db.path(DEV).read_text() == before
    with pytest.raises(ValueError, match="no record file"):
        db.merge_files([tmp_path / "missing.csv"])


def test_merge_prefers_a_graph_timed_record_over_a_faster_eager_one(spec, tmp_path):
    db = Database(tmp_path / "db")
    db.add([record({"T": 4, "D": 40}, B64, 3.0), record({"T": 4, "D": 40}, B128, 5.0, timing="graph")])
    (kept,) = db.records(DEV)
    assert (kept.config_dict(), kept.timing) == (B128, "graph")
    db.add([record({"T": 4, "D": 40}, B16, 4.0, timing="graph")])  # between graph records: the faster
    assert [(r.config_dict(), r.median_us) for r in db.records(DEV)] == [(B16, 4.0)]


def test_merge_prefers_a_tuned_record_over_a_faster_untuned_one(spec, tmp_path):
    db = Database(tmp_path / "db")
    db.add([record({"T": 4, "D": 40}, B64, 3.0, status="untuned"), record({"T": 4, "D": 40}, B128, 5.0)])
    assert [(r.config_dict(), r.status) for r in db.records(DEV)] == [(B128, "tuned")]
    db.add([record({"T": 8, "D": 40}, B64, 3.0, status="untuned")])
    assert db.match(spec, "decode", {"T": 8, "D": 40}, DEV)[1].config_dict() == B64  # untuned records are used


def test_seeds_come_from_any_fixed_dims_nearest_over_every_dim(tmp_path):
    # BLOCK must not exceed D here, so a config of a wider shape may be invalid for a narrower one
    narrow = toy_spec().replace(constraint=lambda c, s: None if c["BLOCK"] <= s["D"] else "BLOCK > D")
    with registered(narrow) as (spec,), database(tmp_path) as db:
        db.add([record({"T": 4, "D": 128}, B128), record({"T": 64, "D": 48}, DEFAULT),
                record({"T": 4, "D": 64}, B16, status="untuned"), record({"T": 4, "D": 32}, {"BLOCK": 32, "num_warps": 2})])
        assert db.match(spec, "decode", {"T": 4, "D": 40}, DEV) is None  # the lookup keeps fixed dims exact
        # distance to T=4,D=40: D=32 and D=64 1 (a differing dim costs at least 1; the tuned one first),
        # D=128 1.68 (but BLOCK=128 > 40), T=64,D=48 5
        assert db.nearest_configs(spec, "decode", {"T": 4, "D": 40}, DEV) == [
            {"BLOCK": 32, "num_warps": 2}, B16, DEFAULT]
        assert db.nearest_configs(spec, "decode", {"T": 4, "D": 40}, DEV, n=1) == [{"BLOCK": 32, "num_warps": 2}]
        assert db.nearest_configs(spec, "prefill", {"T": 4, "D": 40}, DEV) == []  # another phase
    assert shape_distance({"a": 0, "b": 8}, {"a": 1, "b": 2}, ("a", "b")) == 3.0  # a differing flag costs 1


def test_write_is_atomic(spec, tmp_path, monkeypatch):
    db = Database(tmp_path)
    db.add([record({"T": 4, "D": 40}, B64)])
    before = db.path(DEV).read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(rec.os, "replace", crash)
    with pytest.raises(OSError):
        db.add([record({"T": 8, "D": 40}, B64)])
    assert db.path(DEV).read_text() == before  # the old file is intact
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []  # no temp file left


def test_concurrent_adds_lose_nothing(spec, tmp_path):
    db = Database(tmp_path)
    threads = [threading.Thread(target=db.add, args=([record({"T": 2**i, "D": 40}, B64)],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(Database(tmp_path).records(DEV)) == 8


def test_folder_from_env_or_argument(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_db.ENV_VAR, str(tmp_path / "env"))
    assert Database().folder == tmp_path / "env"
    assert Database(tmp_path / "arg").folder == tmp_path / "arg"
    monkeypatch.delenv(tuning_db.ENV_VAR)
    assert Database().folder == tuning_db.DEFAULT_FOLDER


def test_lookup_reads_the_file_once_and_is_cached(spec, tmp_path, monkeypatch):
    with database(tmp_path) as db:
        db.add([record({"T": 4, "D": 40}, B64)])
        reads = []
        real = rec.read_records
        monkeypatch.setattr("tuning_db.database.read_records", lambda p: reads.append(p) or real(p))
        for t in (1, 2, 3, 4, 5, 4, 3):
            spec.launch_config("decode", {"T": t, "D": 40}, "cpu")
        assert len(reads) == 1


def test_import_opens_no_database_and_the_first_lookup_opens_the_env_folder():
    code = ("import sys, dsa_triton; from dsa_triton import registry; "
            "assert registry._database is None and 'optuna' not in sys.modules; "
            "print(registry.database().folder)")
    env = {**os.environ, tuning_db.ENV_VAR: "/nonexistent-db"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "/nonexistent-db"
