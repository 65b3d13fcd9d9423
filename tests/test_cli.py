"""``dsa-tune`` end to end in interpreter mode: tiny bench shapes, few trials, temporary databases."""
import json
import dataclasses

import pytest

import tuning_db
from dsa_triton import registry
from tuner.cli import main
from tuning_db import Database

from .test_tuner_toys import buggy_spec, registered, toy_spec

TOYS = "toy_axpy,toy_buggy"


@pytest.fixture
def toys():
    with registered(toy_spec(bench=((3, 40), (9, 40))), buggy_spec()) as specs:
        yield specs
    registry.use_database()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def tune(capsys, db, storage, *extra):
    return run(capsys, "tune", "--kernels", TOYS, "--phases", "decode", "--trials", 3, "--db", db,
               "--storage", storage, "--no-progress", *extra)


def test_tune_show_bench(toys, tmp_path, capsys):
    db, storage = tmp_path / "db", tmp_path / "optuna"
    rc, out, _ = tune(capsys, db, storage)
    assert rc == 0, out
    assert "tuning 3 jobs" in out and out.count("| tuned |") == 3
    records = Database(db).records("cpu-interpreter")
    assert sorted((r.kernel, r.shape) for r in records) == [
        ("toy_axpy", "D=40,T=3"), ("toy_axpy", "D=40,T=9"), ("toy_buggy", "D=40,T=3")]
    assert all(r.trials >= 3 and r.median_us > 0 and r.default_us > 0 and r.baseline_us > 0 for r in records)
    assert (storage / "cpu-interpreter" / "toy_axpy.journal").is_file()

    rc, out, _ = tune(capsys, db, storage)  # fresh records: nothing to do
    assert rc == 0 and out.count("skipped, a fresh record exists") == 3

    (db / "nvidia-h200.csv").write_text((db / "cpu-interpreter.csv").read_text())
    rc, out, _ = run(capsys, "show", "--db", db, "--plot", tmp_path / "show.png")
    assert rc == 0 and "3 records" in out and out.count("| fresh |") == 3 and "geometric mean" in out
    assert "records for other devices: nvidia-h200" in out
    assert (tmp_path / "show.png").stat().st_size > 1000
    (db / "nvidia-h200.csv").unlink()

    rc, out, _ = run(capsys, "bench", "--db", db, "--out", tmp_path / "results")
    assert rc == 0, out
    [result] = (tmp_path / "results").rglob("tuned-cpu-interpreter-*.json")
    rows = json.loads(result.read_text())["tuned vs default vs baseline"]
    assert len(rows) == 3 and all(r["check"] == "ok" and r["ops use it"] for r in rows)
    assert all(r["tuned us"] > 0 and r["default us"] > 0 and r["baseline us"] > 0 for r in rows)
    assert result.with_suffix(".md").is_file()


def test_tune_given_shapes_and_database_from_env(toys, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(tuning_db.ENV_VAR, str(tmp_path / "envdb"))
    rc, out, _ = run(capsys, "tune", "--kernels", "toy_axpy", "--phases", "prefill", "--shapes", "T=17",
                     "--trials", 2, "--storage", "none", "--no-progress", "--sampler", "random")
    assert rc == 0, out
    [record] = Database(tmp_path / "envdb").records()
    assert (record.phase, record.shape, record.shape_key) == ("prefill", "D=40,T=17", "prefill:D=40,T=32")
    rc, out, _ = run(capsys, "show")
    assert "1 records" in out and "D=40,T=17" in out


def test_tune_lists_model_shapes_and_shards(toys, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512,
                                  "qk_rope_head_dim": 64}))
    args = ("tune", "--kernels", "toy_axpy", "--model", config, "--batches", "1,8", "--chunks", "512", "--list")
    rc, out, _ = run(capsys, *args)
    assert rc == 0
    assert out.splitlines() == ["toy_axpy decode D=576,T=1", "toy_axpy decode D=576,T=8",
                                "toy_axpy prefill D=576,T=512", "3 jobs"]
    rc, out, _ = run(capsys, *args, "--shard", "1/2")
    assert out.splitlines() == ["toy_axpy decode D=576,T=8", "1 jobs"]
    rc, out, _ = run(capsys, "tune", "--kernels", "toy_axpy", "--model", "deepseek-v3.2", "--batches", "4",
                     "--phases", "decode", "--list")  # a model shipped under tuner/models, by name
    assert rc == 0 and out.splitlines() == ["toy_axpy decode D=576,T=4", "1 jobs"]


def test_merge(toys, tmp_path, capsys):
    for name in ("a", "b"):
        rc, out, _ = tune(capsys, tmp_path / name, "none", "--kernels", "toy_axpy", "--shapes", "T=3")
        assert rc == 0, out
    slow = Database(tmp_path / "b").records()[0]
    fast = dataclasses.replace(slow, median_us=round(slow.median_us / 1000, 3), config='{"BLOCK":16,"num_warps":1}')
    tuning_db.write_records(tmp_path / "fast.csv", [fast])
    files = [tmp_path / "a" / "cpu-interpreter.csv", tmp_path / "b" / "cpu-interpreter.csv", tmp_path / "fast.csv"]
    rc, out, _ = run(capsys, "merge", *files, "--db", tmp_path / "merged")
    assert rc == 0 and "merged 3 records from 3 files" in out and "1 records now" in out
    [kept] = Database(tmp_path / "merged").records()
    assert kept == fast


def test_compare(toys, tmp_path, capsys):
    rc, out, _ = run(capsys, "compare", "--kernels", "toy_axpy", "--phases", "decode", "--repeats", 2,
                     "--out", tmp_path, "--no-progress")
    assert rc == 0, out
    [result] = tmp_path.rglob("compare-cpu-interpreter-*.json")
    data = json.loads(result.read_text())
    [summary] = data["summary"]  # one shape per kernel and phase unless --shapes is given
    assert summary["valid configs"] == 9 and 0 < summary["tpe fraction"] <= 1
    assert {r["sampler"] for r in data["sampler runs"]} == {"tpe", "random"} and len(data["sampler runs"]) == 4


def test_env_and_errors(toys, tmp_path, capsys):
    rc, out, _ = run(capsys, "env")
    assert rc == 0 and "toy_axpy" in out and "interpreter: True" in out
    rc, _, err = run(capsys, "tune", "--kernels", "nope", "--list")
    assert rc == 2 and "no kernel 'nope'" in err
    rc, _, err = run(capsys, "tune", "--kernels", "toy_axpy", "--shapes", "T=x", "--list")
    assert rc == 2 and "T must be an integer" in err
    for shard in ("2/2", "3", "a/b"):
        rc, _, err = run(capsys, "tune", "--kernels", "toy_axpy", "--shard", shard, "--list")
        assert rc == 2 and ("--shard" in err or "integers" in err)
    rc, _, err = run(capsys, "merge", tmp_path / "missing.csv", "--db", tmp_path / "db")
    assert rc == 2 and "no record file" in err
    rc, _, err = run(capsys, "tune", "--kernels", "toy_axpy", "--model", tmp_path / "none.json", "--list")
    assert rc == 2 and "no config.json" in err


def test_tune_on_several_gpus_runs_one_shard_per_process(capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc, out, _ = run(capsys, "tune", "--kernels", "append_tokens", "--gpus=2", "--list")
    assert rc == 0, out
    assert sorted(line for line in out.splitlines() if line.endswith(" jobs")) == ["[gpu 0] 2 jobs", "[gpu 1] 2 jobs"]
    rc, _, err = run(capsys, "tune", "--kernels", "append_tokens", "--gpus", "2", "--shard", "0/2", "--list")
    assert rc == 2 and "exclude each other" in err


def test_without_option():
    from tuner.cli import without_option

    assert without_option(["tune", "--gpus", "4", "--x", "--gpus=2", "y"], "--gpus") == ["tune", "--x", "y"]


def test_show_and_bench_name_an_unknown_kernel_in_one_line(toys, tmp_path, capsys):
    for command in (["show"], ["bench", "--out", tmp_path / "results"]):
        rc, out, err = run(capsys, *command, "--kernels", "toy_axpy,nope", "--db", tmp_path / "db")
        assert err.startswith(f"dsa-tune {command[0]}: --kernels: no kernel 'nope'") and err.count("\n") == 1
        assert rc == 2
    assert not (tmp_path / "results").exists()  # bench wrote no empty results file
    from .test_tuning_db import record

    Database(tmp_path / "db").add([record({"T": 3, "D": 40}, {"BLOCK": 32, "num_warps": 1}, kernel="toy_gone")])
    rc, out, _ = run(capsys, "show", "--kernels", "toy_gone", "--db", tmp_path / "db")  # stored, no longer registered
    assert rc == 0 and "1 records" in out


def test_show_plot_without_records_is_an_error(toys, tmp_path, capsys):
    rc, out, err = run(capsys, "show", "--db", tmp_path / "db", "--plot", tmp_path / "show.png")
    assert rc == 2 and err == f"dsa-tune show: --plot: no records to plot in {tmp_path / 'db'}\n"
    assert not (tmp_path / "show.png").exists()


def test_ctrl_c_ends_every_command_with_one_line(capsys, monkeypatch):
    from tuner import cli

    def interrupted(args):
        raise KeyboardInterrupt

    commands = {"env": [], "tune": [], "show": [], "bench": [], "merge": ["x.csv"], "compare": [],
                "day0": ["--model", "deepseek-v3.2"]}
    for name in commands:
        monkeypatch.setattr(cli, f"cmd_{name}", interrupted)
    for name, extra in commands.items():
        rc, out, err = run(capsys, name, *extra)
        assert (rc, out, err) == (130, "", f"dsa-tune {name}: interrupted\n")
