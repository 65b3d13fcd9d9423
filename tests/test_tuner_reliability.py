"""Tuner reliability (issue 33): failures classified by cause, interrupted runs resumed, budgets that bound the
wall time, device memory per job. Real toy Triton kernels in the interpreter; the CUDA-only paths by monkeypatch."""
import os
import signal
import subprocess
import time

import optuna
import pytest
import torch

from dsa_triton import registry  # noqa: F401  (first: turns the interpreter on before triton is imported)
from dsa_triton.registry import Cost
from dsa_triton.runtime import default_device
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError
from tuner import tune as tune_module
from tuner.cli import main
from tuner.objective import COMPILE, LAUNCH, OOM, WRONG, Evaluator, Outcome, failure_cause
from tuner.study import encode, journal_storage, search
from tuner.tune import KEPT_DEFAULT, KEPT_RECORD, Job, JobResult, summary_rows, tune
from tuning_db import Database
from tuning_db.records import config_text

from .test_tuner_toys import database, registered, toy_spec

DEVICE = default_device()
SHAPE = {"T": 3, "D": 40}
QUIET = dict(progress=False)


# -- 1. failures by cause -------------------------------------------------------------------------
def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def _raised_in_triton_compile() -> BaseException:
    """An exception raised inside a function ``compile`` of a file ``.../triton/compiler/compiler.py`` (a lowering
    pass that fails raises a plain RuntimeError there)."""
    scope: dict = {}
    code = "def compile():\n    raise RuntimeError('PassManager::run failed')\n"
    exec(compile(code, "/site-packages/triton/compiler/compiler.py", "exec"), scope)
    try:
        scope["compile"]()
    except RuntimeError as exc:
        return exc


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as caught:
        return caught


@pytest.mark.parametrize("exc, cause", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), OOM),
    (RuntimeError("CUDA error: out of memory"), OOM),
    (RuntimeError("Triton Error [CUDA]: CUDA_ERROR_OUT_OF_MEMORY"), OOM),
    (CompilationError(None, None, "unsupported layout"), COMPILE),
    (PTXASError("ptxas fatal"), COMPILE),
    (OutOfResources(300000, 232448, "shared memory"), COMPILE),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), LAUNCH),
    (ValueError("q: expected bfloat16"), LAUNCH),
])
def test_failure_cause(exc, cause):
    assert failure_cause(_raised(exc)) == cause


def test_failure_cause_reads_the_chain_and_the_compiler_frames():
    assert failure_cause(_raised_in_triton_compile()) == COMPILE
    wrapped = _chained(RuntimeError("the interpreter failed"), torch.OutOfMemoryError("out of memory"))
    assert failure_cause(wrapped) == OOM
    assert failure_cause(_chained(RuntimeError("x"), CompilationError(None, None, "y"))) == COMPILE


def failing_run(inputs: dict, config: dict) -> torch.Tensor:
    """BLOCK 16 and 32 (the default) run out of memory, 64 does not compile, 128 is wrong."""
    block = config["BLOCK"]
    if block in (16, 32):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if block == 64:
        raise CompilationError(None, None, "unsupported layout")
    return inputs["x"] * 0


def failing_spec():
    return toy_spec("toy_failing", run=failing_run, space={"BLOCK": (16, 32, 64, 128), "num_warps": (1,)})


def test_each_failure_is_recorded_with_its_cause(tmp_path):
    with registered(failing_spec()) as (spec,):
        ev = Evaluator(spec, "decode", SHAPE, DEVICE, warmup_ms=0, rep_ms=1)
        outcomes = {b: ev.evaluate({"BLOCK": b, "num_warps": 1}) for b in (16, 64, 128)}
        assert {b: (o.status, o.cause) for b, o in outcomes.items()} == {
            16: ("error", OOM), 64: ("error", COMPILE), 128: ("wrong", WRONG)}
        assert Evaluator(toy_spec(), "decode", SHAPE, DEVICE).evaluate({"BLOCK": 32, "num_warps": 1}).cause == ""

        logs = []
        with database(tmp_path / "db") as db:
            [result] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, sampler="exhaustive", trials=10,
                            storage_dir=tmp_path / "optuna", log=logs.append, **QUIET)
            assert db.records() == []  # a failed job writes nothing
    assert result.status == "failed" and result.record is None
    assert result.causes == {OOM: 2, COMPILE: 1, WRONG: 1}
    assert result.detail == "no config passed (2 out of memory, 1 compile error, 1 wrong result)"
    assert any(line.endswith("failed: no config passed (2 out of memory, 1 compile error, 1 wrong result)")
               for line in logs)
    [row] = summary_rows([result])
    assert row["failures"] == "2 out of memory, 1 compile error, 1 wrong result" and row["status"] == "failed"
    # the journal keeps each config's cause
    name = next(iter(optuna.get_all_study_names(journal_storage(tmp_path / "optuna", "cpu-interpreter",
                                                                "toy_failing"))))
    resumed = search(spec, SHAPE, lambda c: pytest.fail("nothing is run again"), name=name,
                     storage=journal_storage(tmp_path / "optuna", "cpu-interpreter", "toy_failing"), trials=10,
                     **QUIET)
    assert dict(resumed.causes()) == {OOM: 2, COMPILE: 1, WRONG: 1}


def test_an_oom_is_never_called_a_failed_reference_check(tmp_path):
    """A budgeted run: the default runs out of memory on the known pass, and so do the configs a search tries."""
    oom = toy_spec("toy_oom", run=lambda inputs, config: failing_run(inputs, {"BLOCK": 16}))
    with registered(oom) as (spec,), database(tmp_path / "db") as db:
        logs = []
        [result] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, trials=2, total_s=60.0, storage_dir=None,
                        log=logs.append, **QUIET)
    assert result.status == "failed" and set(result.causes) == {OOM}
    assert "reference check" not in "\n".join(logs) and result.detail.startswith("no config passed (")
    assert "failed: no config passed (1 out of memory)" in "\n".join(logs)  # the known pass: the default


def test_all_wrong_still_says_the_reference_check(tmp_path):
    broken = toy_spec("toy_broken", run=lambda inputs, config: inputs["x"] * 0)
    with registered(broken) as (spec,), database(tmp_path / "db") as db:
        [result] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, trials=3, storage_dir=None, log=lambda s: None,
                        **QUIET)
    assert result.detail == "no config passed the reference check (3 wrong result)"


def test_a_job_that_cannot_build_its_inputs_for_lack_of_memory_says_so(tmp_path):
    def no_memory(phase, shape, device, seed):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    spec = toy_spec("toy_huge").replace(make_inputs=no_memory)
    with registered(spec), database(tmp_path / "db") as db:
        [result] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, trials=2, storage_dir=None, log=lambda s: None,
                        **QUIET)
    assert result.status == "failed" and result.detail.startswith("out of memory: OutOfMemoryError")


# -- 2. interrupted runs resume -------------------------------------------------------------------
def test_a_trial_left_running_by_a_dead_process_runs_again(tmp_path):
    """A killed process leaves its trial RUNNING in the journal (and an earlier run's queue WAITING): the next run
    fails them and queues its seeds again, so the interrupted config is measured."""
    spec = toy_spec()
    default, other = {"BLOCK": 32, "num_warps": 1}, {"BLOCK": 128, "num_warps": 2}
    storage = journal_storage(tmp_path, "dev", spec.name)
    study = optuna.create_study(study_name="s", storage=storage, direction="minimize")
    study.enqueue_trial(encode(default, spec.space))
    study.enqueue_trial(encode(other, spec.space))
    study.ask()  # the dead process's trial: the default, popped and never told
    calls = []

    def evaluate(config):
        calls.append(config_text(config))
        return Outcome("ok", 1.0)

    result = search(spec, SHAPE, evaluate, name="s", storage=journal_storage(tmp_path, "dev", spec.name), trials=1,
                    seeds=[default], only_seeds=True, **QUIET)
    assert calls == [config_text(default)] and result.ranked() == [(default, 1.0)]
    states = [t.state for t in optuna.load_study(study_name="s", storage=storage).trials]
    assert states[:2] == [optuna.trial.TrialState.FAIL] * 2 and states[2] == optuna.trial.TrialState.COMPLETE


def _interrupt_once(monkeypatch, how):
    """Evaluator.evaluate interrupted (``how()``) on its first call, real after."""
    real, calls = Evaluator.evaluate, []

    def evaluate(self, config):
        calls.append(config)
        if len(calls) == 1:
            how()
        return real(self, config)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    return calls


def _ctrl_c():
    raise KeyboardInterrupt


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)  # the handler raises here


@pytest.mark.parametrize("how, code, word", [(_ctrl_c, 130, "interrupted"), (_sigterm, 143, "terminated")])
def test_a_run_interrupted_inside_an_evaluation_resumes(tmp_path, capsys, monkeypatch, how, code, word):
    """Ctrl-C or SIGTERM while a config runs: one line, no record; the same command again checks the configs and
    stores records (it used to find the interrupted default 'already queued' and report that no config passed)."""
    argv = ["tune", "--kernels", "toy_axpy", "--phases", "decode", "--trials", "2", "--budget", "60", "--db",
            str(tmp_path / "db"), "--storage", str(tmp_path / "optuna"), "--no-progress"]
    with registered(toy_spec()):
        try:
            calls = _interrupt_once(monkeypatch, how)
            assert main(argv) == code
            out, err = capsys.readouterr()
            assert err == f"dsa-tune tune: {word}\n" and Database(tmp_path / "db").records() == []
            assert main(argv) == 0
            out, err = capsys.readouterr()
            assert "no config passed" not in out and calls[1] == calls[0] == {"BLOCK": 32, "num_warps": 1}  # again
            [record] = Database(tmp_path / "db").records("cpu-interpreter")
            assert record.median_us > 0 and record.default_us > 0
        finally:
            registry.use_database()


# -- 3. budgets bound the wall time ---------------------------------------------------------------
def test_a_budget_smaller_than_the_jobs_bounds_the_wall_time(tmp_path, monkeypatch):
    """24 jobs whose evaluations take a fifth of a second (the kernel itself is PyTorch's, so that the interpreter's
    time does not blur the bound), 2 s: the known pass takes the biggest problems first and stops on time; every
    other job names what it keeps (the nearest record: one exists once the first job stored its record)."""
    from .test_tuner_toys import reference

    real = Evaluator.evaluate
    monkeypatch.setattr(Evaluator, "evaluate", lambda self, config: time.sleep(0.2) or real(self, config))
    logs = []
    with registered(toy_spec(run=lambda inputs, config: reference(inputs))) as (spec,), database(tmp_path / "db") as db:
        jobs = [Job(spec, "decode", {"T": t, "D": 40}) for t in range(1, 25)]
        start = time.monotonic()
        results = tune(jobs, db, DEVICE, trials=2, total_s=2.0, storage_dir=None, log=logs.append, **QUIET)
        wall = time.monotonic() - start
    assert wall < 2.0 + 0.3, wall  # at most one evaluation (and its job's final timing) past the deadline
    stored = [r for r in results if r.record is not None]
    kept = [r for r in results if r.record is None]
    assert stored and kept and all(r.status == KEPT_RECORD and r.config for r in kept)
    assert sorted(r.job.shape["T"] for r in stored) == list(range(25 - len(stored), 25))  # biggest first
    assert all("ops use the nearest record" in r.detail or "ops use the bucket record" in r.detail for r in kept)
    rows = summary_rows(results)
    assert sum(row["status"] == KEPT_RECORD for row in rows) == len(kept)
    assert any(f"{len(kept)} keep the nearest stored record or the default" in line for line in logs)


def test_the_known_pass_stops_between_a_jobs_configs(tmp_path, monkeypatch):
    """The clock is read before each evaluation: past the deadline a job's remaining known configs (here the default,
    after the nearest record's) do not run, and a job none of whose configs ran keeps the default (no record of its
    kernel anywhere)."""
    from .test_tuning_db import record

    clock = [0.0]
    monkeypatch.setattr(tune_module, "now", lambda: clock[0])
    real = Evaluator.evaluate

    def evaluate(self, config):
        clock[0] += 10.0  # each evaluation "takes" 10 s
        return real(self, config)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    nearest = {"BLOCK": 128, "num_warps": 2}
    with registered(toy_spec(), toy_spec("toy_other")) as (spec, other), database(tmp_path / "db") as db:
        db.add([record({"T": 8, "D": 40}, nearest)])
        jobs = [Job(spec, "decode", {"T": 3, "D": 40}), Job(other, "decode", SHAPE)]
        results = tune(jobs, db, DEVICE, trials=2, total_s=10.0, storage_dir=None, log=lambda s: None, **QUIET)
    assert results[0].record.config_dict() == nearest and results[0].record.trials == 1  # the default did not run
    assert results[1].status == KEPT_DEFAULT and results[1].config == config_text({"BLOCK": 32, "num_warps": 1})


def test_day0_generates_its_tokens_when_the_budget_reaches_no_job(tmp_path, capsys, monkeypatch):
    import json

    from .test_tuner_day0 import OTHER

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(OTHER))
    runs, real = [], subprocess.run

    def run(command, **kwargs):
        if command[1:4] != ["-m", "model_runner", "generate"]:
            return real(command, **kwargs)
        runs.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", run)
    with registered(toy_spec()):
        try:
            assert main(["day0", "--checkpoint", str(checkpoint), "--kernels", "toy_axpy", "--phases", "decode",
                         "--batches", "2,4", "--budget", "0", "--db", str(tmp_path / "db"), "--storage", "none",
                         "--no-progress", "--out", str(tmp_path / "out"), "--flat"]) == 0
        finally:
            registry.use_database()
    out = capsys.readouterr().out
    assert len(runs) == 1 and out.count(f"| {KEPT_DEFAULT} |") == 2 and "0 of 2 jobs have a record" in out


def test_workers_stop_when_their_time_runs_out():
    from tuner.precompile import run_in_workers

    start = time.monotonic()
    out = run_in_workers(subprocess.call, [["true"], ["true"], ["sleep", "30"], ["sleep", "30"]], workers=2,
                         seconds=10)
    assert out == [0, 0, None, None] and time.monotonic() - start < 20
    assert run_in_workers(subprocess.call, [["true"]], workers=2, seconds=0) == [None]


# -- 5. device memory per job -------------------------------------------------------------------
GIB = 2**30


def fake_cuda(monkeypatch, free: int, total: int = 80 * GIB, reserved: int = GIB, allocated: int = GIB // 2):
    """torch.cuda as a device with these byte counts would answer its memory queries."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def memory(free_gib: int, reserved: int = GIB, allocated: int = GIB // 2) -> dict[str, int]:
    """What :func:`tuner.tune.device_memory` answers for an 80 GiB device with ``free_gib`` free."""
    total = 80 * GIB
    return {"total": total, "free": free_gib * GIB, "reserved": reserved, "allocated": allocated,
            "outside": total - free_gib * GIB - reserved}


def test_memory_outside_the_allocator_and_the_fit_on_cuda_and_nothing_elsewhere(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    huge = Job(toy_spec("toy_huge").replace(cost=lambda phase, shape: Cost(bytes=1.0 * GIB)), "decode", SHAPE)
    assert tune_module.outside_allocator_mib(cpu) is None and tune_module.misfit(huge, cpu) is None
    with monkeypatch.context() as m:
        fake_cuda(m, free=70 * GIB)
        assert tune_module.outside_allocator_mib(cuda) == (80 - 70 - 1) * 1024  # MiB
        assert tune_module.misfit(huge, cuda) is None
    with monkeypatch.context() as m:
        fake_cuda(m, free=2 * GIB)  # 2.5 GiB available with what the allocator holds unused; 3 GiB needed
        assert tune_module.misfit(huge, cuda) == "does not fit: needs 3.0 GiB, 2.5 GiB free"
        assert tune_module.misfit(Job(toy_spec(), "decode", SHAPE), cuda) is None


def test_each_job_notes_the_memory_outside_the_allocator(tmp_path, monkeypatch):
    free = iter(range(70, 0, -1))  # every query finds a GiB less free
    monkeypatch.setattr(tune_module, "device_memory", lambda device: memory(next(free)))  # as a CUDA device would
    with registered(toy_spec()) as (spec,), database(tmp_path / "db") as db:
        [result] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, trials=2, storage_dir=None, log=lambda s: None,
                        **QUIET)
    assert result.record is not None
    # before the job: a query for the fit check, one for "before"; then "after"
    assert (result.outside_before_mib, result.outside_after_mib) == ((80 - 69 - 1) * 1024, (80 - 68 - 1) * 1024)
    assert summary_rows([result])[0]["outside allocator MiB"] == (80 - 68 - 1) * 1024
    monkeypatch.undo()
    with registered(toy_spec()) as (spec,), database(tmp_path / "cpu") as db:
        [plain] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, trials=2, storage_dir=None, log=lambda s: None,
                       **QUIET)
    assert plain.outside_before_mib is None and plain.outside_after_mib is None
    assert summary_rows([plain])[0]["outside allocator MiB"] != summary_rows([plain])[0]["outside allocator MiB"]


def test_a_job_whose_inputs_cannot_fit_is_skipped_before_it_runs(tmp_path, monkeypatch):
    huge = toy_spec("toy_huge").replace(cost=lambda phase, shape: Cost(bytes=1.0 * GIB))  # 3 GiB needed
    monkeypatch.setattr(tune_module, "device_memory", lambda device: memory(2))  # 2.5 GiB available
    monkeypatch.setattr(tune_module, "tune_job", lambda *a, **k: pytest.fail("a job that cannot fit must not run"))
    logs = []
    with registered(huge) as (spec,), database(tmp_path / "db") as db:
        [result] = tune([Job(spec, "decode", SHAPE)], db, DEVICE, trials=2, total_s=60.0, storage_dir=None,
                        log=logs.append, **QUIET)
    assert result.status == "skipped" and result.detail == "does not fit: needs 3.0 GiB, 2.5 GiB free"
    assert summary_rows([result])[0]["detail"] == result.detail
    assert any("skipped: does not fit: needs 3.0 GiB, 2.5 GiB free" in line for line in logs)


def test_job_result_defaults():
    result = JobResult(Job(toy_spec(), "decode", SHAPE), "failed")
    assert result.causes == {} and result.config == "" and result.outside_after_mib is None


def test_memory_is_released_after_every_job_and_bench_row(tmp_path, monkeypatch):
    """The tuner releases the device memory a job left (workspaces, cuBLAS workspaces, free blocks) after each job,
    and the bench harness's release does all three on CUDA (nothing elsewhere)."""
    from dsa_triton.bench import harness

    released = []
    monkeypatch.setattr(tune_module, "release_memory", lambda device: released.append(str(device)))
    with registered(toy_spec(), toy_spec("toy_two")) as specs, database(tmp_path / "db") as db:
        tune([Job(spec, "decode", SHAPE) for spec in specs], db, DEVICE, trials=2, storage_dir=None,
             log=lambda s: None, **QUIET)
    assert released == [str(DEVICE)] * 2
    calls = []
    monkeypatch.setattr(harness, "release_shared_workspaces", lambda: calls.append("workspaces"))
    monkeypatch.setattr(harness, "release_cached_memory", lambda device: calls.append(("cached", str(device))))
    harness.release_memory("cpu")
    assert calls == []
    harness.release_memory(torch.device("cuda", 0))
    assert calls == ["workspaces", ("cached", "cuda:0")]
