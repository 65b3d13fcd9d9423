"""Tuner: the correctness gate and penalties, the search (seeds, samplers, budgets, resume), records reaching
the ops, model-derived shapes and the sampler comparison. Real toy Triton kernels in the interpreter."""
import dataclasses
import json
import math

import pytest
import torch

from dsa_triton import registry  # first: turns the interpreter on before triton is imported
import triton
from dsa_triton.registry import KernelSpec
from dsa_triton.runtime import default_device, device_name
from tuner import shapes as sh
from tuner.compare import compare_kernel, runs_to_reach
from tuner.objective import PENALTY_US, Evaluator, Outcome
from tuner.study import journal_storage, search, study_name
from tuner.tune import Job, tune
from tuning_db.records import config_text

from .test_tuner_toys import axpy, buggy_spec, database, registered, toy_spec

DEVICE = default_device()
SHAPE = {"T": 3, "D": 40}  # 120 elements: BLOCK=64 leaves a tail
FAST = dict(progress=False)


@pytest.fixture
def toys():
    with registered(toy_spec(), buggy_spec()) as specs:
        yield specs


def evaluator(spec: KernelSpec) -> Evaluator:
    return Evaluator(spec, "decode", SHAPE, DEVICE, warmup_ms=0, rep_ms=1)


# -- the gate -----------------------------------------------------------------------------------
def test_wrong_failing_and_invalid_configs_are_penalised(toys):
    _, buggy = toys
    ev = evaluator(buggy)
    assert ev.evaluate({"BLOCK": 32, "num_warps": 1}).ok
    wrong = ev.evaluate({"BLOCK": 64, "num_warps": 1})
    error = ev.evaluate({"BLOCK": 32, "num_warps": 2})
    invalid = ev.evaluate({"BLOCK": 16, "num_warps": 2})
    assert (wrong.status, error.status, invalid.status) == ("wrong", "error", "invalid")
    assert "max error" in wrong.detail and "does not launch" in error.detail and "16 x num_warps" in invalid.detail
    assert all(o.value == PENALTY_US and math.isnan(o.us) for o in (wrong, error, invalid))


def test_a_config_failing_while_timed_is_penalised():
    from .test_tuner_toys import launch

    calls = []

    def flaky(inputs, config):  # right on the check, raises once it is timed
        calls.append(config)
        if len(calls) > 1:
            raise RuntimeError("timing broke")
        return launch(inputs, config)

    outcome = evaluator(toy_spec("toy_flaky", run=flaky)).evaluate({"BLOCK": 32, "num_warps": 1})
    assert outcome.status == "error" and "timing broke" in outcome.detail and outcome.value == PENALTY_US


def test_evaluator_times_every_call_the_way_its_first_was(monkeypatch):
    """The first timed config fixes graph or eager for the evaluator; the baseline is timed the same way, and
    NaN when the kernel was graph-timed and the baseline does not capture (never a graph/eager mix)."""
    from tuner import objective

    modes = []

    def timer(call, sets, device, mode="auto", **kw):
        modes.append(mode)
        return 1.0, "graph" if mode == "auto" else "eager"

    def graph_only(call, sets, device, **kw):  # as harness.graph_time_or_nan: the baseline syncs
        modes.append("graph")
        return math.nan if call is baseline else 1.0

    monkeypatch.setattr(objective, "timed_us", timer)
    monkeypatch.setattr(objective, "graph_time_or_nan", graph_only)
    ev = evaluator(toy_spec())
    baseline = ev.spec.baseline
    assert ev.timing is None
    assert ev.time({"BLOCK": 32, "num_warps": 1}) == 1.0 and ev.timing == "graph"
    ev.time({"BLOCK": 64, "num_warps": 2})
    assert math.isnan(ev.time_baseline()) and modes == ["auto", "auto", "graph"]


def test_a_config_that_does_not_capture_turns_the_evaluator_eager(monkeypatch):
    """Graph-timed so far, then a config whose call syncs: it is timed eagerly (not penalised) and so is
    everything after it, the baseline included."""
    from tuner import objective

    modes = []

    def timer(call, sets, device, mode="auto", **kw):  # as harness.timed_us: auto falls back to eager
        modes.append(mode)
        captures = mode == "auto" and not syncing[0]
        return (1.0, "graph") if captures else (2.0, "eager")

    monkeypatch.setattr(objective, "timed_us", timer)
    syncing = [False]
    ev = evaluator(toy_spec())
    assert ev.time({"BLOCK": 32, "num_warps": 1}) == 1.0 and ev.timing == "graph"
    syncing[0] = True
    assert ev.evaluate({"BLOCK": 64, "num_warps": 2}).status == "ok" and ev.timing == "eager"
    assert ev.time({"BLOCK": 32, "num_warps": 1}) == 2.0 and ev.time_baseline() == 2.0
    assert modes == ["auto", "auto", "eager", "eager"]


def test_time_all_gives_one_mode(monkeypatch):
    """The record's times come from one mode: when the second finalist turns the evaluator eager, the first one is
    timed again."""
    from tuner import objective

    def timer(call, sets, device, mode="auto", **kw):  # as harness.timed_us; BLOCK 64's call does not capture
        captures = mode != "eager" and call(None) != 64
        if mode == "graph" and not captures:
            raise RuntimeError("operation not permitted when stream is capturing")
        return (1.0, "graph") if captures else (2.0, "eager")

    monkeypatch.setattr(objective, "timed_us", timer)
    configs = [{"BLOCK": 32, "num_warps": 1}, {"BLOCK": 64, "num_warps": 2}]
    fresh = evaluator(toy_spec(run=lambda inputs, config: config["BLOCK"]))  # its first time decides the mode
    assert fresh.time_all(configs) == [2.0, 2.0] and fresh.timing == "eager"
    graphed = evaluator(toy_spec(run=lambda inputs, config: config["BLOCK"]))
    graphed.time(configs[0])  # graph from here
    assert graphed.time_all(configs) == [2.0, 2.0] and graphed.timing == "eager"
    assert graphed.time_all(configs[:1]) == [2.0]


def test_invalid_config_is_never_run(toys):
    axpy_spec, _ = toys
    ev = evaluator(axpy_spec)
    runs = []
    axpy_spec.run = lambda inputs, config: runs.append(config)
    assert ev.evaluate({"BLOCK": 16, "num_warps": 4}).status == "invalid"
    assert ev.evaluate({"BLOCK": 999, "num_warps": 1}).status == "invalid"  # outside the space
    assert runs == []


def test_tuning_never_stores_a_wrong_or_failing_config(toys, tmp_path):
    _, buggy = toys
    with database(tmp_path / "db") as db:
        [result] = tune([Job(buggy, "decode", SHAPE)], db, DEVICE, sampler="exhaustive", trials=10,
                        storage_dir=tmp_path / "optuna", log=lambda s: None, **FAST)
        assert result.status == "tuned"
        assert result.record.config_dict() in ({"BLOCK": 16, "num_warps": 1}, {"BLOCK": 32, "num_warps": 1})
        assert result.record.trials == 5  # every valid config ran once: 2 right, 2 wrong, 1 raising
        assert [r.config_dict() for r in db.records()] == [result.record.config_dict()]
    # the study holds the penalties
    storage = journal_storage(tmp_path / "optuna", device_name(DEVICE), "toy_buggy")
    steps = search(buggy, SHAPE, lambda c: pytest.fail("resumed study must not run again"),
                   name=study_name(buggy, "decode", SHAPE, device_name(DEVICE)), storage=storage, trials=10, **FAST)
    statuses = sorted(s.outcome.status for s in steps.steps if s.new)
    assert statuses == ["error", "ok", "ok", "wrong", "wrong"]


def test_all_configs_wrong_gives_no_record(tmp_path):
    broken = toy_spec("toy_broken", run=lambda inputs, config: inputs["x"] * 0)
    with registered(broken), database(tmp_path / "db") as db:
        [result] = tune([Job(broken, "decode", SHAPE)], db, DEVICE, trials=3, storage_dir=None,
                        log=lambda s: None, **FAST)
        assert result.status == "failed" and result.record is None and db.records() == []


def test_inputs_that_are_not_reproducible_get_a_reference_per_check(toys):
    from .test_tuner_toys import make_inputs

    calls = []
    drifting = toy_spec("toy_drifting")
    drifting.make_inputs = lambda phase, shape, device, seed: make_inputs(phase, shape, device, len(calls.append(0) or calls))
    ev = evaluator(drifting)
    assert ev.expected is None
    assert ev.evaluate({"BLOCK": 64, "num_warps": 2}).ok
    assert evaluator(toys[0]).expected is not None


def test_same_inputs_is_bitwise():
    from tuner.objective import same_inputs

    a = {"x": torch.tensor([1.0, float("nan")]), "s": torch.tensor(2.0), "n": 3, "obj": object()}
    assert same_inputs(a, {**a, "x": a["x"].clone(), "obj": object()})
    assert not same_inputs(a, {**a, "x": torch.tensor([1.0, 2.0])})
    assert not same_inputs(a, {**a, "n": 4})
    assert not same_inputs(a, {**a, "s": torch.tensor(2.0, dtype=torch.float64)})


# -- the search -----------------------------------------------------------------------------------
def fake(spec: KernelSpec, us, calls: list, delay: float = 0.0):
    """An evaluate function that rejects invalid configs like the real one and logs what it 'ran'."""
    import time

    def evaluate(config):
        if not spec.is_valid(config, SHAPE):
            return Outcome("invalid")
        calls.append(config_text(config))
        time.sleep(delay)
        return Outcome("ok", us(config))

    return evaluate


def test_seeds_run_first_then_budget_counts_new_runs(toys):
    axpy_spec, _ = toys
    calls = []
    seeds = [{"BLOCK": 32, "num_warps": 1}, {"BLOCK": 128, "num_warps": 4}]
    evaluate = fake(axpy_spec, lambda c: float(c["BLOCK"] + c["num_warps"]), calls)
    result = search(axpy_spec, SHAPE, evaluate, name="s", sampler="tpe", trials=4, seeds=seeds, **FAST)
    assert calls[:2] == [config_text(c) for c in seeds]
    assert result.runs() == 4 and len(calls) == 4 == len(set(calls))  # invalid ones cost nothing, repeats re-use


def test_exhaustive_runs_every_valid_config_once(toys):
    axpy_spec, _ = toys
    calls = []
    valid = list(axpy_spec.configs(SHAPE))
    result = search(axpy_spec, SHAPE, fake(axpy_spec, lambda c: 1.0 + len(calls), calls),
                    name="e", sampler="exhaustive", trials=100, **FAST)
    assert sorted(calls) == sorted(map(config_text, valid))
    assert result.runs() == len(valid) == 9


@pytest.mark.parametrize("sampler", ["tpe", "random", "auto"])
def test_samplers_find_the_best_of_a_small_space(toys, sampler):
    axpy_spec, _ = toys
    valid = list(axpy_spec.configs(SHAPE))
    cost = {config_text(c): 10.0 + i for i, c in enumerate(reversed(valid))}  # the last config is the fastest
    result = search(axpy_spec, SHAPE, fake(axpy_spec, lambda c: cost[config_text(c)], []), name=sampler,
                    sampler=sampler, trials=len(valid), **FAST)
    assert result.ranked()[0] == (valid[-1], 10.0)


def test_search_resumes_from_its_journal(toys, tmp_path):
    axpy_spec, _ = toys
    storage = lambda: journal_storage(tmp_path, "dev", axpy_spec.name)
    calls = []
    evaluate = fake(axpy_spec, lambda c: float(c["BLOCK"]), calls)
    first = search(axpy_spec, SHAPE, evaluate, name="r", storage=storage(), sampler="random", trials=3, **FAST)
    second = search(axpy_spec, SHAPE, evaluate, name="r", storage=storage(), sampler="random", trials=3, seed=1,
                    **FAST)
    assert first.runs() == 3 and second.runs() == 6
    assert len(calls) == 6 and len(set(calls)) == 6  # nothing measured twice across sessions


def test_timeout_stops_the_search(toys):
    axpy_spec, _ = toys
    slow = fake(axpy_spec, lambda c: 1.0, [], delay=0.3)
    result = search(axpy_spec, SHAPE, slow, name="t", sampler="random", trials=9, timeout=0.5, **FAST)
    assert 1 <= result.runs() < 9


def test_a_config_that_breaks_the_device_stops_the_run_and_is_not_retried(toys, tmp_path):
    from tuner.objective import DeviceLost

    axpy_spec, buggy = toys
    bad = config_text({"BLOCK": 128, "num_warps": 2})
    calls = []

    def evaluate(config):
        calls.append(config_text(config))
        return Outcome("fatal", detail="illegal memory access") if calls[-1] == bad else Outcome("ok", 1.0)

    storage = lambda: journal_storage(tmp_path, "dev", axpy_spec.name)
    with pytest.raises(DeviceLost, match="illegal memory access"):
        search(axpy_spec, SHAPE, evaluate, name="f", storage=storage(), sampler="exhaustive", trials=9,
               seeds=[json.loads(bad)], **FAST)
    assert calls == [bad]
    result = search(axpy_spec, SHAPE, evaluate, name="f", storage=storage(), sampler="exhaustive", trials=9, **FAST)
    assert calls.count(bad) == 1 and result.runs() == 9  # resumed: the culprit is known, the rest ran

    import tuner.tune as tune_module

    def lose(job, *args, **kw):
        raise DeviceLost("boom")

    with database(tmp_path / "db") as db, pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune_module, "tune_job", lose)
        results = tune([Job(axpy_spec, "decode", SHAPE), Job(buggy, "decode", SHAPE)], db, DEVICE,
                       storage_dir=None, log=lambda s: None, **FAST)
    assert [r.status for r in results] == ["failed", "not run"] and "device lost" in results[0].detail


def test_study_name_has_code_shape_and_exact_shape(toys):
    axpy_spec, _ = toys
    assert study_name(axpy_spec, "decode", {"T": 4, "D": 40}, "dev").endswith("/decode:D=40,T=4")
    assert study_name(axpy_spec, "decode", {"T": 3, "D": 40}, "dev").endswith("/decode:D=40,T=4@D=40,T=3")
    assert axpy_spec.source_hash() in study_name(axpy_spec, "decode", SHAPE, "dev")


# -- records reach the ops ----------------------------------------------------------------------
def test_a_stored_record_changes_the_launch_config(toys, tmp_path):
    axpy_spec, _ = toys
    x, y = torch.randn(5, 40, device=DEVICE), torch.randn(5, 40, device=DEVICE)
    with database(tmp_path / "db") as db:
        out, programs = axpy(x, y, 1.5)
        assert programs == triton.cdiv(200, 32)  # the default BLOCK=32
        [result] = tune([Job(axpy_spec, "decode", {"T": 5, "D": 40})], db, DEVICE, sampler="exhaustive", trials=9,
                        storage_dir=None, log=lambda s: None, **FAST)
        stored = result.record.config_dict()
        if stored["BLOCK"] == 32:  # the default won the timing: store another record to see it change
            stored = {"BLOCK": 128, "num_warps": 2}
            db.add([dataclasses.replace(result.record, config=config_text(stored), median_us=0.001)])
        assert axpy_spec.launch_config("decode", {"T": 5, "D": 40}, DEVICE) == stored
        out, programs = axpy(x, y, 1.5)
        assert programs == triton.cdiv(200, stored["BLOCK"])
        torch.testing.assert_close(out, 1.5 * x + y)
    out, programs = axpy(x, y, 1.5)  # the default database again: the default config
    assert programs == triton.cdiv(200, 32)


REAL_KERNELS = [s for s in registry.kernels() if not s.name.startswith("toy_")]


@pytest.mark.parametrize("spec", REAL_KERNELS or [None], ids=lambda s: getattr(s, "name", "none-registered"))
def test_a_stored_record_reaches_every_real_kernel(spec, tmp_path):
    if spec is None:
        pytest.skip("no real kernel registered yet")
    from .test_tuning_db import record

    phase = spec.phases[0]
    shape = spec.bench_shapes(phase, False)[0]
    default = spec.default(phase, shape)
    other = next((c for c in spec.configs(shape) if c != default), None)
    if other is None:
        pytest.skip(f"{spec.name}: a single valid config")
    with database(tmp_path) as db:
        assert spec.launch_config(phase, shape, DEVICE) == default
        db.add([record(shape, other, phase=phase, kernel=spec.name)])
        assert spec.launch_config(phase, shape, DEVICE) == other


# -- shapes from a model --------------------------------------------------------------------------
V32 = {"hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
       "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "n_routed_experts": 256,
       "num_experts_per_tok": 8, "moe_intermediate_size": 2048}


def shaped(name, fixed, bucketed, phases=("decode", "prefill"), bench=None, dims=lambda m: [{}], roles=None
           ) -> KernelSpec:
    """A toy spec of these dims: ``dims`` its ``model_dims``, ``roles`` its ``count_roles``."""
    base = toy_spec(name)
    bench = bench or {d: 2 for d in (*fixed, *bucketed)}
    return base.replace(fixed_dims=fixed, bucketed_dims=bucketed, phases=phases,
                        bench_shapes=lambda phase, gpu: [dict(bench)],
                        default=lambda phase, shape: {"BLOCK": 32, "num_warps": 1}, constraint=lambda c, s: None,
                        model_dims=dims, count_roles=roles or {})


INDEXER = lambda m: [{"H": m.index_heads, "D": m.index_dim, "P": m.page}]  # noqa: E731
EXPERT_GEMMS = lambda m: [{"E": m.experts, "top_k": m.top_k, **g} for g in m.expert_gemms()]  # noqa: E731


def test_model_shapes_decode_batches_times_contexts():
    spec = shaped("indexer_decode", ("H", "D", "P"), ("B", "L"), phases=("decode",), dims=INDEXER,
                  roles={"B": "batch", "L": "context"})
    got = sh.model_shapes(spec, "decode", V32)
    assert len(got) == 8 * 6
    assert {s["H"] for s in got} == {64} and {s["D"] for s in got} == {128} and {s["P"] for s in got} == {64}
    assert {s["B"] for s in got} == set(sh.DECODE_BATCHES) and {s["L"] for s in got} == set(sh.CONTEXTS)
    attn = shaped("sparse_attention", ("H", "D", "Dv", "k"), ("B",), phases=("decode",), roles={"B": "batch"},
                  dims=lambda m: [{"H": m.heads, "D": m.qk, "Dv": m.latent, "k": m.index_topk}])
    assert sh.model_shapes(attn, "decode", V32, batches=(1, 64))[1] == {"H": 128, "D": 576, "Dv": 512, "k": 2048, "B": 64}


def test_model_shapes_prefill_chunks_and_expert_gemms():
    gemm = shaped("moe_gemm", ("E", "top_k", "N", "K", "gather"), ("T",), dims=EXPERT_GEMMS, roles={"T": "tokens"})
    got = sh.model_shapes(gemm, "prefill", V32, chunks=(4096,))
    assert got == [{"E": 256, "top_k": 8, "N": 4096, "K": 7168, "gather": 1, "T": 4096},
                   {"E": 256, "top_k": 8, "N": 7168, "K": 2048, "gather": 0, "T": 4096}]
    grouped = shaped("fp8_grouped_gemm", ("E", "N", "K"), ("M",), phases=("prefill",), roles={"M": "rows"},
                     dims=lambda m: [{"E": m.experts, "N": g["N"], "K": g["K"]} for g in m.expert_gemms()])
    assert [(s["M"], s["N"]) for s in sh.model_shapes(grouped, "prefill", V32, chunks=(512, 4096))] == [
        (4096, 4096), (32768, 4096), (4096, 7168), (32768, 7168)]  # M: routed rows, 8 per token
    assert {s["M"] for s in sh.model_shapes(grouped, "prefill", V32, overrides={"top_k": 4}, chunks=(512,))} == {2048}
    pages = shaped("select_pages", (), ("T", "pages", "SEL"), phases=("decode",),
                   roles={"T": "tokens", "pages": "pages"})
    assert {(s["T"], s["pages"]) for s in sh.model_shapes(pages, "decode", V32, batches=(64,), contexts=(4096, 131072))} == {
        (64, 64), (64, 2048)}  # pages: context over the 64-token page
    assert {s["pages"] for s in sh.model_shapes(pages, "decode", V32, overrides={"P": 16}, batches=(1,),
                                                contexts=(4096,))} == {256}
    weights = shaped("mxfp4_convert", ("K",), ("N",), phases=("load",),
                     dims=lambda m: [{"N": g["N"], "K": g["K"]} for g in m.expert_gemms()])
    assert [(s["N"], s["K"]) for s in sh.model_shapes(weights, "load", V32)] == [(4096, 7168), (7168, 2048)]
    decode = sh.model_shapes(gemm, "decode", V32, batches=(1, 128))
    assert sorted((s["T"], s["N"]) for s in decode) == [(1, 4096), (1, 7168), (128, 4096), (128, 7168)]
    topk_dims, topk_roles = lambda m: [{"k": m.index_topk}], {"T": "tokens", "L": "context"}
    topk = shaped("topk", ("k",), ("T", "L"), dims=topk_dims, roles=topk_roles)
    prefill = sh.model_shapes(topk, "prefill", V32, contexts=(4096, 16384), chunks=(1024, 8192))
    assert [(s["T"], s["L"]) for s in prefill] == [(1024, 4096), (1024, 16384), (8192, 16384)]  # context >= chunk
    anyphase = shaped("topk_any", ("k",), ("T", "L"), phases=("any",), dims=topk_dims, roles=topk_roles)
    both = sh.model_shapes(anyphase, "any", V32, batches=(1, 64), contexts=(4096,), chunks=(4096, 8192))
    assert [(s["T"], s["L"]) for s in both] == [(1, 4096), (64, 4096), (4096, 4096)]  # decode rows, then prefill


def test_model_shapes_overrides_bench_fallbacks_and_errors():
    spec = shaped("indexer", ("H", "D", "P", "qmax"), ("B",), bench={"H": 64, "D": 128, "P": 64, "qmax": 4, "B": 8,
                                                                     "extra": 3}, dims=INDEXER, roles={"B": "batch"})
    notes = []
    got = sh.model_shapes(spec, "decode", V32, overrides={"P": 16}, batches=(2,), notes=notes)
    assert got == [{"extra": 3, "H": 64, "D": 128, "P": 16, "qmax": 4, "B": 2}]  # qmax, extra from the bench shape
    assert notes == ["indexer decode: extra=3, qmax=4 from its GPU bench shapes (not model dims; --set to change)"]
    # an unknown dim comes from the bench shape that agrees most with the derived ones
    odd = shaped("odd", ("k", "W"), ("B", "Z"), dims=lambda m: [{"k": m.index_topk}], roles={"B": "batch"})
    odd = odd.replace(bench_shapes=lambda phase, gpu: [
        {"k": 1024, "W": 1, "B": 1, "Z": 5}, {"k": 2048, "W": 2, "B": 1, "Z": 6}])
    assert sh.model_shapes(odd, "decode", V32, batches=(4,)) == [{"k": 2048, "W": 2, "B": 4, "Z": 6}]
    assert sh.model_shapes(odd, "decode", V32, overrides={"W": 5}, batches=(1,)) == [{"k": 2048, "W": 5, "B": 1, "Z": 6}]
    with pytest.raises(ValueError, match="lacks 'index_n_heads'.*--set H="):
        sh.model_shapes(spec, "decode", {k: v for k, v in V32.items() if k != "index_n_heads"})


def test_model_shapes_decode_tokens_per_sequence_or_tied_to_the_batch():
    queries = shaped("indexer", ("H",), ("B", "Q", "L"), phases=("decode",), dims=lambda m: [{"H": m.index_heads}],
                     roles={"B": "batch", "Q": "tokens", "L": "context"})
    queries = queries.replace(bench_shapes=lambda phase, gpu: [
        {"H": 64, "B": 64, "Q": 1, "L": 9}, {"H": 64, "B": 64, "Q": 2, "L": 9}])
    assert {s["Q"] for s in sh.model_shapes(queries, "decode", V32)} == {1}  # queries per sequence
    tied = shaped("append", ("P",), ("B", "N"), bench={"P": 64, "B": 64, "N": 64}, dims=lambda m: [{"P": m.page}],
                  roles={"B": "batch", "N": "tokens"})
    assert [(s["B"], s["N"]) for s in sh.model_shapes(tied, "decode", V32, batches=(2, 8))] == [(2, 2), (8, 8)]
    assert [(s["B"], s["N"]) for s in sh.model_shapes(tied, "prefill", V32, chunks=(512,))] == [(1, 512)]


def test_parse_and_lay_given_shapes():
    assert sh.parse_shapes(["B=64,L=131072", "B=1,L=4096; B=8,L=4096"]) == [
        {"B": 64, "L": 131072}, {"B": 1, "L": 4096}, {"B": 8, "L": 4096}]
    with pytest.raises(ValueError, match="must be an integer"):
        sh.parse_shapes(["B=x"])
    spec = shaped("k1", ("D",), ("T",))
    templates = [{"D": 40, "T": 1}, {"D": 80, "T": 1}]
    assert sh.job_shapes(spec, "decode", given=[{"T": 64}], templates=templates, overrides={}) == [
        {"D": 40, "T": 64}, {"D": 80, "T": 64}]
    assert sh.job_shapes(spec, "decode", given=[{"L": 64}], templates=templates, overrides={}) == []  # not its dim


# -- compare ----------------------------------------------------------------------------------------
def test_compare_replays_samplers_on_the_exhaustive_table(toys):
    axpy_spec, _ = toys
    summary, runs = compare_kernel(axpy_spec, "decode", SHAPE, DEVICE, repeats=2, **FAST)
    assert summary["valid configs"] == 9 and summary["grid"] == 12 and summary["passed check"] == 9
    assert summary["best us"] <= summary["default us"]
    assert len(runs) == 4 and all(1 <= r["configs run"] <= 9 for r in runs)
    assert all(0 < r["fraction of space"] <= 1 for r in runs)
    json.dumps(summary)


def test_runs_to_reach_counts_measured_configs_only():
    from tuner.study import SearchResult, Step

    steps = [Step(0, "a", Outcome("ok", 9.0), True), Step(1, "b", Outcome("invalid"), True),
             Step(2, "a", Outcome("ok", 9.0), False), Step(3, "c", Outcome("ok", 5.0), True)]
    assert runs_to_reach(SearchResult("x", steps), 5.2) == (2, 4)
    assert runs_to_reach(SearchResult("x", steps), 1.0) == (-1, -1)


# -- parallel compile -----------------------------------------------------------------------------
def test_precompile_workers_check_and_stop_after_a_fatal_config(toys, monkeypatch):
    from tuner import precompile as pc

    _, buggy = toys
    pc._start("toy_buggy", "decode", SHAPE, str(DEVICE))
    assert pc._worker["evaluator"].sets == []  # a checking evaluator makes no timing sets
    assert pc._check(("a", {"BLOCK": 32, "num_warps": 1})) == ("a", None)
    assert pc._check(("b", {"BLOCK": 64, "num_warps": 1}))[1].status == "wrong"
    monkeypatch.setattr(pc._worker["evaluator"], "check", lambda config: Outcome("fatal", detail="illegal"))
    assert pc._check(("c", {"BLOCK": 16, "num_warps": 1}))[1].status == "fatal"
    assert pc._check(("d", {"BLOCK": 32, "num_warps": 1})) == ("d", None)  # not checked any more: left to the caller
    assert pc.precompile(evaluator(buggy), list(buggy.configs(SHAPE))) == {}  # the interpreter compiles nothing


def test_check_in_spawned_workers_with_a_real_kernel():
    from tuner.precompile import check_in_workers

    if "mxfp4_dequantize" not in {s.name for s in registry.kernels()}:
        pytest.skip("mxfp4_dequantize is not registered")
    spec = registry.get("mxfp4_dequantize")
    shape = spec.bench_shapes("load", False)[0]
    configs = list(spec.configs(shape))[:3]
    checked = check_in_workers(spec.name, "load", shape, "cpu", configs, workers=2)
    assert checked == {config_text(c): None for c in configs}
