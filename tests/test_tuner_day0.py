"""Day 0 with a model that is not DeepSeek-V3.2: every job's dims come from its config.json where the config has them
(other head, expert and group counts, another hidden size), only dims no config has come from bench shapes, and
the CLI names those."""
import argparse
import json

import pytest

from dsa_triton import registry  # noqa: F401  (first: registers the kernels, interpreter on before triton)
from tuner import shapes as sh
from tuner.cli import build_jobs, build_parser, main
from dsa_triton.runtime import default_device

# 64 heads, 384 experts top-6 without expert groups, hidden 6144, a narrower latent and a smaller indexer
OTHER = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 6144,
         "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 64, "q_lora_rank": 1024,
         "kv_lora_rank": 384, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 1536,
         "n_group": None, "topk_group": None, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
         "index_n_heads": 32, "index_head_dim": 128, "index_topk": 1024, "intermediate_size": 12288}
BATCHES, CONTEXTS, CHUNKS = (1, 8, 64), (8192, 32768, 131072), (2048, 8192)
# what the config gives each dim name (H and D: the indexer's in kernels named *index*, else attention's)
MODEL = {"hidden": 6144, "E": 384, "top_k": 6, "I": 1536, "n_group": 1, "topk_group": 1, "softmax": 0, "k": 1024,
         "DK": 128, "Dv": 384, "Dr": 64, "P": 64}
GEMMS = {(3072, 6144, 1), (6144, 1536, 0)}  # (N, K, gather): gate_up and down
GEMMS_GATHER = {(n, k): g for n, k, g in GEMMS}  # the MXFP4 kernels have no gather dim
# (N, K) of the dense projections: q_a, q_b, kv_a, kv_b, o, and the shared expert's two (no intermediate_size:
# the dense MLP's are absent from this config, so they would raise: given below)
LINEAR = {(1024, 6144), (64 * 192, 1024), (384 + 64, 6144), (64 * 256, 384), (6144, 64 * 128), (1536, 6144),
          (6144, 1536), (12288, 6144), (6144, 12288)}
# dims no config has (decode queries per sequence, selected pages, alignment, experts per conversion, cached
# tokens before an append, index form, a context outside the shape key)
NOT_MODEL = {"Q", "S", "SEL", "block_m", "G", "ctx", "logical", "L"}
V4_ONLY = {"compress_entries", "v4_indexer_logits"}  # DeepSeek-V4's own ops: no job for another model


def jobs_for(config, tmp_path, *extra):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = build_parser().parse_args(["tune", "--model", str(path), "--batches", ",".join(map(str, BATCHES)),
                                      "--contexts", ",".join(map(str, CONTEXTS)),
                                      "--chunks", ",".join(map(str, CHUNKS)), *extra])
    return build_jobs(args, default_device())


def test_every_job_carries_the_configs_dims(tmp_path, capsys):
    jobs = jobs_for(OTHER, tmp_path)
    notes = capsys.readouterr().err
    real = {s.name for s in registry.kernels() if not s.name.startswith("toy_")}
    assert {j.spec.name for j in jobs} == real - V4_ONLY
    counts = {"B": set(BATCHES) | {1}, "T": set(BATCHES) | set(CHUNKS), "N": set(BATCHES) | set(CHUNKS),
              "L": set(CONTEXTS), "pages": {c // 64 for c in CONTEXTS},
              "M": {6 * c for c in CHUNKS}, "Q": set(CHUNKS)}
    for job in jobs:
        name, shape = job.spec.name, job.shape
        model = {**MODEL, "H": 32 if "index" in name else 64, "D": 128 if "index" in name else 448,
                 "Dr": 64 if shape.get("fp8") else 0, "fp8": shape.get("fp8")}  # both caches: rows, or FP8 rows
        weights = name.startswith(("fused_moe_gemm", "fp8_grouped_gemm", "mxfp4"))
        linear = "linear" in name
        if weights:
            assert (shape["N"], shape["K"], shape.get("gather", GEMMS_GATHER[(shape["N"], shape["K"])])) in GEMMS, str(job)
        if linear:
            assert (shape["N"], shape["K"]) in LINEAR and shape["M"] in set(BATCHES) | set(CHUNKS), str(job)
        for dim, value in shape.items():
            if (weights and dim in ("N", "K", "gather")) or (linear and dim in ("N", "K", "M")):
                continue
            if dim in job.spec.bucketed_dims and value in counts.get(dim, ()):
                continue
            if dim in model:
                assert value == model[dim], (str(job), dim)
            else:
                assert dim in NOT_MODEL, (str(job), dim)
                assert f"{name} {job.phase}: " in notes and f"{dim}={value}" in notes, (str(job), dim)  # named
    assert {(j.shape["N"], j.shape["K"]) for j in jobs if "linear" in j.spec.name} == LINEAR
    path = [j.shape for j in jobs if j.spec.name == "moe_forward"]
    assert path and all((s["n_group"], s["topk_group"]) == (1, 1) for s in path)  # outside its shape key
    route = [j.shape for j in jobs if j.spec.name == "route_topk"]
    assert route and all((s["n_group"], s["topk_group"], s["softmax"]) == (1, 1, 0) for s in route)
    assert "n_group" not in notes and "topk_group" not in notes and "softmax" not in notes


@pytest.mark.parametrize("groups, expected", [({}, (1, 1)), ({"n_group": None, "topk_group": None}, (1, 1)),
                                              ({"n_group": 1, "topk_group": 4}, (1, 1)),
                                              ({"n_group": 8, "topk_group": 3}, (8, 3))])
def test_expert_groups_from_the_config(groups, expected):
    config = {k: v for k, v in OTHER.items() if k not in ("n_group", "topk_group")} | groups
    for name, phase in (("moe_forward", "prefill"), ("route_topk", "decode")):
        shapes = sh.model_shapes(registry.get(name), phase, config, batches=(8,), chunks=(2048,))
        assert {(s["n_group"], s["topk_group"]) for s in shapes} == {expected}, name


def test_missing_model_dims_are_errors_unless_set(tmp_path, capsys):
    grouped = {**OTHER, "n_group": 4, "topk_group": None}
    with pytest.raises(ValueError, match="lacks 'topk_group'.*--set topk_group="):
        sh.model_shapes(registry.get("moe_forward"), "decode", grouped)
    assert {s["topk_group"] for s in sh.model_shapes(registry.get("moe_forward"), "decode", grouped,
                                                     overrides={"topk_group": 2}, batches=(1,))} == {2}
    with pytest.raises(ValueError, match="scoring_func 'relu'"):
        sh.model_shapes(registry.get("route_topk"), "decode", {**OTHER, "scoring_func": "relu"})
    no_topk = {k: v for k, v in OTHER.items() if k != "index_topk"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(no_topk))
    assert main(["tune", "--kernels", "topk_indices", "--model", str(path), "--list"]) == 2
    assert "lacks 'index_topk'" in capsys.readouterr().err
    assert main(["tune", "--kernels", "topk_indices", "--model", str(path), "--set", "k=512", "--batches", "1",
                 "--contexts", "8192", "--chunks", "2048", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["topk_indices any L=8192,T=1,k=512",
                                                    "topk_indices any L=8192,T=2048,k=512", "2 jobs"]


# -- budgets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("20m", 1200), ("90s", 90), ("1h", 3600), ("450", 450), ("7.5", 7.5),
                                           ("1h30m", 5400), (" 2M ", 120)])
def test_durations(text, seconds):
    from tuner.cli import duration

    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "20q", "-5", "ten"])
def test_bad_durations(text, capsys):
    from tuner.cli import duration

    with pytest.raises(argparse.ArgumentTypeError, match="20m, 90s, 1h"):
        duration(text)
    with pytest.raises(SystemExit):
        main(["tune", "--budget", text, "--list"])
    assert "--budget" in capsys.readouterr().err


def test_affordable_is_the_longest_prefix_whose_shares_cover_their_costs():
    from tuner.tune import affordable

    none = [0, 0, 0, 0]
    assert affordable([40, 30, 20, 10], [2, 2, 2, 2], none, 6) == 2  # 6 * 30/70 = 2.6 >= 2; 6 * 20/90 = 1.3 < 2
    assert affordable([40, 30, 20, 10], [2, 2, 2, 2], none, 20) == 4
    assert affordable([40, 30, 20, 10], none, none, 0.1) == 4
    assert affordable([40, 30], [5, 0], [0, 0], 4) == 0  # the first cannot afford it: no search at all
    assert affordable([40, 30, 20, 10], [2, 2, 2, 2], [4, 2, 0, 0], 6) == 3  # what earlier runs used counts too
    assert affordable([], [], [], 10) == 0


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_budget_goes_where_the_default_is_furthest_from_the_floor(tmp_path, monkeypatch):
    """Known pass for every job first (each "takes" 1 s here; bigger problems first), then searches in falling gap
    (the default's time on the CPU), each with its gap's share of the time less its fixed cost, while the shares
    cover twice the known pass; the jobs the budget does not reach keep their untuned records. The last 5% of a
    budget is its margin. Two runs of 10 s give each job the search time one run of 20 s would."""
    from tuner import tune as tune_module
    from tuner.tune import Job, tune

    from .test_tuner_toys import database, registered, toy_spec
    from .test_tuning_db import record

    clock, calls = FakeClock(), []
    default_us = {1: 20.0, 2: 40.0, 3: 10.0, 4: 30.0}  # by T: gaps 40 (T=2), 30 (T=4), 20 (T=1), 10 (T=3)

    def fake(job, db, device, *, timeout, known, **kw):
        calls.append((job.shape["T"], known, timeout))
        clock.t += 1.0 if known else timeout + 1.0  # a search uses its whole share (timeout + its fixed cost)
        return record(job.shape, {"BLOCK": 32, "num_warps": 1}, median_us=default_us[job.shape["T"]] / 2,
                      status="untuned" if known else "tuned", kernel=job.spec.name)

    def run(total_s, storage):
        calls.clear()
        with registered(toy_spec()) as (spec,), database(tmp_path / storage) as db:
            jobs = [Job(spec, "decode", {"T": t, "D": 40}) for t in (1, 2, 3, 4)]
            return tune(jobs, db, default_device(), total_s=total_s, storage_dir=tmp_path / storage,
                        log=lambda s: None)

    def searched():  # seconds each job's searches used (timeout + fixed cost), by T
        return {t: timeout + 1.0 for t, known, timeout in calls if not known}

    monkeypatch.setattr(tune_module, "now", clock)
    monkeypatch.setattr(tune_module, "tune_job", fake)
    results = run(10.0, "two")
    assert [(t, known) for t, known, _ in calls[:4]] == [(4, True), (3, True), (2, True), (1, True)]
    # 9.5 - 4 = 5.5 s left, costs 2 s: T=2 and T=4 can afford a search (5.5 * 30/70 >= 2, 5.5 * 20/90 < 2): T=2
    # gets 5.5 * 40/70 less its fixed cost 1; then 5.5 - 5.5 * 40/70 = 2.36 s are left, all for T=4 (less 1)
    assert [(t, known) for t, known, _ in calls[4:]] == [(2, False), (4, False)]
    assert calls[4][2] == pytest.approx(5.5 * 40 / 70 - 1) and calls[5][2] == pytest.approx(5.5 - 5.5 * 40 / 70 - 1)
    assert [r.status for r in results] == ["untuned", "tuned", "untuned", "tuned"]
    assert all(r.record is not None for r in results)
    first = searched()

    results = run(10.0, "two")  # records exist: no known pass; 9.5 s of searches on top of the 5.5 s used
    assert all(known is False for _, known, _ in calls)
    second = searched()
    assert [r.status for r in results] == ["tuned", "tuned", "untuned", "tuned"]

    run(20.0, "one")  # one run of 20 s: 19 - 4 = 15 s for searches, T=2, T=4 and T=1 (15 * 10/100 < 2 for T=3)
    once = searched()
    assert once == pytest.approx({2: 15 * 40 / 90, 4: 15 * 30 / 90, 1: 15 * 20 / 90})
    assert {t: first.get(t, 0) + second.get(t, 0) for t in once} == pytest.approx(once)


def test_a_tiny_budget_leaves_a_record_for_every_job_and_the_next_run_goes_on(tmp_path, capsys, monkeypatch):
    """Interpreter, real toy kernels and one real kernel: a budget too small for anything names what each job keeps
    (the default: nothing is stored); a budget that reaches the known configs but no search leaves a checked record
    for every job (``untuned``); a later run with time searches on from the journal, measuring no config twice, and
    its records are ``tuned``."""
    from dsa_triton.registry import shape_text
    from tuner.objective import Evaluator
    from tuner.tune import _Run
    from tuning_db import Database
    from tuning_db.records import config_text

    from .test_tuner_toys import buggy_spec, registered, toy_spec

    measured = []
    real = Evaluator.evaluate
    monkeypatch.setattr(Evaluator, "evaluate", lambda self, config: measured.append(
        (self.spec.name, self.phase, shape_text(self.shape), config_text(config))) or real(self, config))
    db, storage = tmp_path / "db", tmp_path / "optuna"
    args = ["tune", "--kernels", "toy_axpy,toy_buggy,mxfp4_dequantize", "--db", db, "--storage", storage,
            "--trials", "3", "--no-progress"]
    with registered(toy_spec(bench=((3, 40), (9, 40))), buggy_spec()):
        try:
            assert main([str(a) for a in [*args, "--budget", "0"]]) == 0
            out = capsys.readouterr().out
            assert "known configs: 0 of 7 jobs have a record" in out and out.count("| kept: default |") == 7
            assert measured == [] and Database(db).records("cpu-interpreter") == []

            with monkeypatch.context() as m:
                m.setattr(_Run, "searches", lambda self, deadline: None)
                assert main([str(a) for a in [*args, "--budget", "2m"]]) == 0
            out = capsys.readouterr().out
            records = Database(db).records("cpu-interpreter")
            assert "known configs: 7 of 7 jobs have a record" in out
            assert len(records) == 7 and {r.status for r in records} == {"untuned"}
            assert all(r.median_us > 0 and r.trials == 1 for r in records)  # the default only: nothing stored before
            first = len(measured)

            assert main([str(a) for a in [*args, "--budget", "2m"]]) == 0
            out = capsys.readouterr().out
            records = Database(db).records("cpu-interpreter")
            assert "searched 7 jobs" in out and len(records) == 7 and {r.status for r in records} == {"tuned"}
            assert len(measured) > first and len(set(measured)) == len(measured)  # resumed, nothing measured twice
            assert all(r.trials >= 2 for r in records)  # the known pass's config and the new ones
        finally:
            registry.use_database()


def test_a_job_whose_known_configs_all_fail_is_searched_first(tmp_path):
    from tuner.tune import Job, tune

    from .test_tuner_toys import buggy_spec, database, registered

    # BLOCK=64 drops the tail of 120 elements: the default is wrong here, only a search finds a config
    wrong_default = buggy_spec().replace(default=lambda phase, shape: {"BLOCK": 64, "num_warps": 1})
    with registered(wrong_default) as (spec,), database(tmp_path / "db") as db:
        logs = []
        [result] = tune([Job(spec, "decode", {"T": 3, "D": 40})], db, default_device(), trials=3, total_s=60.0,
                        storage_dir=None, log=logs.append, progress=False)
    assert any("no config passed the reference check" in line for line in logs)
    assert result.status == "tuned" and json.loads(result.record.config)["BLOCK"] != 64


def test_known_configs_of_many_jobs_compile_in_workers(monkeypatch):
    from tuner import precompile as pc
    from tuning_db.records import config_text

    from .test_tuner_toys import buggy_spec, registered

    monkeypatch.setattr(pc, "_worker", {})  # a fresh worker's state
    with registered(buggy_spec()):
        good, wrong = {"BLOCK": 32, "num_warps": 1}, {"BLOCK": 64, "num_warps": 1}
        out = pc._check_job(("toy_buggy", "decode", {"T": 3, "D": 40}, "cpu", [good, wrong]))
        assert out[config_text(good)] is None and out[config_text(wrong)].status == "wrong"
        assert pc._check_job(("toy_buggy", "decode", {"T": -1, "D": 40}, "cpu", [good])) == {}  # no inputs: none
        jobs = [("toy_buggy", "decode", {"T": 3, "D": 40}, [good])] * 2
        assert pc.precompile_jobs(jobs, "cpu", workers=4) == [{}, {}]  # the interpreter compiles nothing


# -- day0 -------------------------------------------------------------------------------------------
def day0_files(out):
    """The day0 results file written into ``out`` (``--flat``): its JSON."""
    [path] = out.glob("day0-*.json")
    assert path.with_suffix(".md").exists()
    return json.loads(path.read_text())


def test_day0_tunes_then_generates_with_the_runner_and_times_each_stage(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    import tuning_db

    from .test_tuner_toys import registered, toy_spec

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(OTHER))
    runs, real = [], subprocess.run

    def run(command, **kwargs):  # the runner's command is recorded, not run (git's, for the results file, runs)
        if command[1:4] != ["-m", "model_runner", "generate"]:
            return real(command, **kwargs)
        runs.append((command, kwargs["env"]))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", run)
    db, out = tmp_path / "db", tmp_path / "out"
    common = ["--kernels", "toy_axpy", "--phases", "decode", "--batches", "2", "--budget", "10s", "--db", str(db),
              "--storage", "none", "--no-progress", "--out", str(out), "--flat"]
    with registered(toy_spec()):
        try:
            assert main(["day0", *common, "--checkpoint", str(checkpoint)]) == 0
            text = capsys.readouterr().out
            [(command, env)] = runs
            prompts = command[command.index("--prompts") + 1]
            assert command[:6] == [sys.executable, "-m", "model_runner", "generate", "--model", str(checkpoint)]
            assert "--random-weights" not in command and command[-3:] == ["--max-new-tokens", "16", "--no-progress"]
            assert prompts.endswith("prompts.jsonl") and command[command.index("--stats") + 1].endswith("stats.json")
            assert env["DSA_TUNING_DB"] == str(db.resolve())  # the runner reads the database just tuned
            assert [r.shape for r in tuning_db.Database(db).records("cpu-interpreter")] == ["D=448,T=2"]  # config's D
            for stage in ("plan:", "tune:", "generate:", "total:"):
                assert stage in text
            assert "1 of 1 jobs have a record" in text
            assert [s["stage"] for s in day0_files(out)["stages"]] == ["plan", "tune", "generate", "total"]

            assert main(["day0", *common, "--checkpoint", str(checkpoint), "--random-weights"]) == 2
            assert "exclude each other" in capsys.readouterr().err
            assert main(["day0", *common, "--model", "deepseek-v3.2"]) == 2  # shape fields only: no vocab_size
            assert "the runner cannot build random weights from it: config: missing field" in capsys.readouterr().err
            assert len(runs) == 1  # neither got to the runner
        finally:
            registry.use_database()


def test_day0_from_a_config_to_first_tokens_from_random_weights(tmp_path, capsys):
    """A config not in tuner/models (the runner's tiny model) through day0 in the interpreter: a record for every
    job, then the real runner in a subprocess on random weights (1 dense + 1 MoE layer at the config's widths)
    generates tokens; the results file holds the stages, a speedup row per job and the tokens."""
    import math

    import tuning_db
    from model_runner import tiny_config

    config = tmp_path / "config.json"
    tiny_config().to_json(config)
    db, out = tmp_path / "db", tmp_path / "out"
    try:
        assert main(["day0", "--model", str(config), "--kernels", "route_topk", "--batches", "1,2", "--budget", "10s",
                     "--db", str(db), "--storage", "none", "--no-progress", "--random-weights", "--layers", "2",
                     "--max-new-tokens", "2", "--out", str(out), "--flat"]) == 0
        text = capsys.readouterr().out
        jobs = {"E=6,T=1,n_group=3,softmax=0,top_k=2,topk_group=2", "E=6,T=2,n_group=3,softmax=0,top_k=2,topk_group=2"}
        assert {r.shape for r in tuning_db.Database(db).records("cpu-interpreter")} == jobs
        assert "2 of 2 jobs have a record" in text
        results = day0_files(out)
        assert "1 dense + 1 MoE layers" in results["runner"]["notes"][0]
        assert [s["stage"] for s in results["stages"]] == ["plan", "tune", "generate", "total"]
        assert all(s["seconds"] > 0 for s in results["stages"])
        assert {r["shape"] for r in results["speedup"]} == jobs
        assert all(r["default_us"] > 0 and r["us"] > 0 for r in results["speedup"])
        assert math.isfinite(results["geomean_tuned_over_default"])
        assert [len(g["token_ids"]) for g in results["generated"]] == [2, 2, 2]  # three prompts, no EOS stops them
        assert all(0 <= t < 128 for g in results["generated"] for t in g["token_ids"])
        assert {r["kind"] for r in results["throughput"]} >= {"prefill", "decode"}
        assert all(r["tokens_per_s"] > 0 for r in results["throughput"])
        assert results["random_layers"] == 2 and results["config"]["hidden_size"] == 64
    finally:
        registry.use_database()


def test_the_gpu_runs_config_is_new_and_read_by_tuner_and_runner():
    """tests/data/dsa-64h-384e/config.json, the config of the GPU day0 run: not one of tuner/models, most of its
    shapes have no record in the committed database (those it shares with DeepSeek-V3.2 are the indexer's, 64 x 128
    with top-2048, and the 576-wide latent cache's), the tuner plans its jobs and the runner reads it (4 layers:
    1 dense + 3 MoE)."""
    from pathlib import Path

    from model_runner import ModelConfig
    from model_runner.random_weights import reduced
    from tuner.shapes import MODELS
    from tuning_db import Database

    path = Path(__file__).parent / "data" / "dsa-64h-384e" / "config.json"
    config = json.loads(path.read_text())
    assert all(json.loads(p.read_text()) != config for p in MODELS.glob("*.json"))
    runner = reduced(ModelConfig.from_json(path), 4)
    assert runner.mlp_layer_types == ("dense", "sparse", "sparse", "sparse") and runner.n_routed_experts == 384
    args = build_parser().parse_args(["day0", "--model", str(path), "--batches", "1,8,64", "--contexts",
                                      "8192,32768,131072", "--chunks", "2048,8192"])
    jobs = build_jobs(args, default_device())
    stored = {(r.kernel, r.phase, r.shape) for r in Database().records("nvidia-h200")}
    new = [j for j in jobs if (j.spec.name, j.phase, sh.shape_text(j.shape)) not in stored]
    assert len(new) > 100 and {j.spec.name for j in jobs} - {j.spec.name for j in new} == set()


def test_the_tune_stage_in_a_child_process_returns_its_summary(tmp_path):
    """day0's tune stage on a GPU runs in a spawned process (its memory goes back before the runner loads weights):
    here on the CPU, with a real kernel, it leaves the record in the database and hands back the summary rows."""
    import tuning_db
    from model_runner import tiny_config
    from tuner.day0 import tune_in_child

    config, db = tmp_path / "config.json", tmp_path / "db"
    tiny_config().to_json(config)
    args = build_parser().parse_args(["day0", "--model", str(config), "--kernels", "route_topk", "--batches", "1",
                                      "--budget", "10s", "--db", str(db), "--storage", "none", "--no-progress"])
    tuned = tune_in_child(args)
    shape = "E=6,T=1,n_group=3,softmax=0,top_k=2,topk_group=2"
    assert tuned["records"] == 1 and tuned["failed"] == 0
    assert [r["shape"] for r in tuned["rows"]] == [shape] and tuned["rows"][0]["us"] > 0
    assert [r.shape for r in tuning_db.Database(db).records("cpu-interpreter")] == [shape]
