"""Harness arithmetic: floors, ratios, rotation sizing and the bench entry point on the CPU."""
import json
import math

import pytest
import torch

from dsa_triton.bench import harness
from dsa_triton.bench.harness import Ceilings, error_text, floor_us, measurement, rotation
from dsa_triton.registry import Cost

CEIL = Ceilings(copy_tbps=4.0, bf16_tflops=500.0, fp8_tflops=1000.0)


def test_floor_picks_the_larger_term():
    # 4 GB at 4 TB/s = 1000 us; 1e12 flop at 500 TFLOP/s = 2000 us -> compute bound
    us, bound = floor_us(Cost(bytes=4e9, flops=1e12, flop_dtype="bf16"), CEIL)
    assert us == pytest.approx(2000.0) and bound == "bf16 compute"
    us, bound = floor_us(Cost(bytes=4e9, flops=1e12, flop_dtype="fp8"), CEIL)
    assert us == pytest.approx(1000.0) and bound == "memory"
    us, bound = floor_us(Cost(bytes=8e9), CEIL)
    assert us == pytest.approx(2000.0) and bound == "memory"


def test_floor_rejects_unknown_flop_dtype():
    with pytest.raises(KeyError):
        floor_us(Cost(bytes=1.0, flops=1.0, flop_dtype="int4"), CEIL)


def test_measurement_ratios():
    row = measurement(kernel="k", phase="decode", shape="T=1", config="{}", median_us=500.0,
                      cost=Cost(bytes=1e9, flops=1e11), ceilings=CEIL, baseline="torch", baseline_us=2000.0)
    assert row.speedup == pytest.approx(4.0)
    assert row.floor_us == pytest.approx(250.0)  # 1e9 B at 4 TB/s
    assert row.floor_fraction == pytest.approx(0.5)
    assert row.tbps == pytest.approx(2.0)
    assert row.tflops == pytest.approx(200.0)
    without_baseline = measurement(kernel="k", phase="decode", shape="", config="{}", median_us=1.0,
                                   cost=Cost(bytes=1.0), ceilings=None)
    assert math.isnan(without_baseline.speedup) and math.isnan(without_baseline.floor_fraction)
    assert math.isnan(row.graph_us) and math.isnan(row.graph_speedup), "no graph figures unless given"
    graphed = measurement(kernel="k", phase="decode", shape="T=1", config="{}", median_us=500.0,
                          cost=Cost(bytes=1e9), ceilings=CEIL, baseline_us=2000.0, graph_us=400.0,
                          graph_baseline_us=1800.0)
    assert graphed.graph_speedup == pytest.approx(4.5) and graphed.graph_floor_fraction == pytest.approx(0.625)


@pytest.mark.parametrize("check", ["output 0: 3 of 8 elements differ from the reference", "baseline error: boom"])
def test_a_row_that_failed_its_check_has_times_but_no_figures(check):
    """A ratio to a baseline that failed, or of a kernel that is wrong, is no figure: only the medians stay."""
    row = measurement(kernel="k", phase="decode", shape="T=1", config="{}", median_us=500.0,
                      cost=Cost(bytes=1e9, flops=1e11), ceilings=CEIL, baseline_us=2000.0, check=check,
                      graph_us=400.0, graph_baseline_us=1800.0)
    assert row.median_us == 500.0 and row.baseline_us == 2000.0 and row.check == check
    figures = (row.speedup, row.graph_speedup, row.floor_fraction, row.graph_floor_fraction, row.tbps, row.tflops)
    assert all(math.isnan(x) for x in figures)


def test_rotation_covers_twice_l2(monkeypatch):
    monkeypatch.setattr(harness, "l2_bytes", lambda device=None: 60 * 2**20)
    made = []
    fake_cuda = torch.device("cuda")
    sets = rotation(lambda i: made.append(i) or i, 10 * 2**20, fake_cuda)
    assert sets == list(range(12))  # 12 x 10 MiB = 2 x 60 MiB
    assert rotation(lambda i: i, 4 * 2**30, fake_cuda) == [0, 1]  # huge sets: still two
    assert len(rotation(lambda i: i, 1, fake_cuda)) == 16  # tiny sets: capped
    assert rotation(lambda i: i, 1, torch.device("cpu")) == [0]


def test_time_us_cpu_is_positive_and_runs_fn():
    calls = []
    us = harness.time_us(lambda: calls.append(1), "cpu", rep_ms=5)
    assert us >= 0 and len(calls) >= 4


def test_bench_entry_point_runs_a_registered_kernel(tmp_path, capsys):
    from dsa_triton import registry
    from dsa_triton.bench import run as bench
    from tests.test_registry import toy_spec

    registry.register(toy_spec("toy_bench", baseline=lambda inputs: inputs["x"] + inputs["x"], baseline_name="torch add"))
    try:
        assert bench.main(["--kernels", "toy_bench", "--out", str(tmp_path)]) == 0
        results = list(tmp_path.rglob("*.json"))
        assert len(results) == 1 and results[0].parent.parent.name == "cpu-interpreter"
        payload = json.loads(results[0].read_text())
        assert payload["environment"]["device"] == "cpu-interpreter"
        assert payload["git"]["commit"] != "" and "dirty" in payload["git"]
        rows = payload["rows"]
        assert len(rows) == 2 and {r["phase"] for r in rows} == {"decode", "prefill"}
        assert all(r["check"] == "ok" and r["baseline"] == "torch add" for r in rows)
        assert all(r["graph_us"] is None or math.isnan(r["graph_us"]) for r in rows), "no graphs without a GPU"
        text = results[0].with_suffix(".md").read_text()
        assert "| interpreter s |" in text and "speedup |" not in text, "the interpreter prints no speedups"
        assert results[0].with_suffix(".png").stat().st_size > 1000
        assert capsys.readouterr().out.rstrip().endswith("2/2 checks ok")
    finally:
        registry.unregister("toy_bench")


def test_bench_reports_a_wrong_kernel_and_a_failing_baseline(tmp_path, capsys):
    from dsa_triton import registry
    from dsa_triton.bench import run as bench
    from tests.test_registry import toy_spec

    def broken_baseline(inputs):
        raise RuntimeError("no such kernel image")

    registry.register(toy_spec("toy_wrong", run=lambda inputs, config: inputs["x"] * 3))
    registry.register(toy_spec("toy_base", baseline=broken_baseline, baseline_name="broken"))
    try:
        assert bench.main(["--kernels", "toy_wrong,toy_base", "--out", str(tmp_path)]) == 1
        text = next(tmp_path.rglob("*.json")).read_text()
        rows = json.loads(text)["rows"]
        assert "NaN" not in text and "Infinity" not in text, "strict JSON: what was not measured is null"
        assert all(r["speedup"] is None and r["floor_fraction"] is None for r in rows), "no figure of a failed row"
        assert [r["check"] for r in rows if r["kernel"] == "toy_wrong"] == ["mismatch"] * 2
        assert all("baseline error" in r["check"] and "no such kernel image" in r["check"]
                   for r in rows if r["kernel"] == "toy_base")
        out = capsys.readouterr().out
        assert "0/4 checks ok; failed:" in out and "toy_base decode" in out
    finally:
        registry.unregister("toy_wrong")
        registry.unregister("toy_base")


def test_graph_timing_is_nan_off_the_gpu():
    calls = []
    assert math.isnan(harness.graph_time_us(calls.append, [1, 2], "cpu"))
    assert math.isnan(harness.graph_us(lambda: calls.append(0), "cpu"))
    assert calls == [], "nothing is captured or run without a GPU"


def test_timed_us_graph_when_it_captures_else_eager(monkeypatch):
    """The modes of the tuner's timer, with the two timers stubbed (no GPU here): auto falls back to eager when
    the capture fails, eager never tries a capture, and off the GPU every mode is eager."""
    captures = []

    def graph(call, sets, device, **kw):
        captures.append(kw)
        if fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 5.0

    monkeypatch.setattr(harness, "graph_time_us", graph)
    monkeypatch.setattr(harness, "time_rotating", lambda call, sets, device, **kw: 9.0)
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda device=None: None)
    fails = False
    assert harness.timed_us(None, [0], "cuda", warmup_ms=1, rep_ms=2) == (5.0, "graph")
    assert captures == [{"warmup_ms": 1, "rep_ms": 2}], "the budget reaches the graph timer"
    assert harness.timed_us(None, [0], "cuda", "eager") == (9.0, "eager") and len(captures) == 1
    fails = True
    assert harness.timed_us(None, [0], "cuda") == (9.0, "eager") and len(captures) == 2
    assert harness.timed_us(None, [0], "cpu") == (9.0, "eager") and len(captures) == 2
    with pytest.raises(ValueError, match="mode"):
        harness.timed_us(None, [0], "cpu", "graph")


def test_error_text_keeps_an_out_of_memory_message_whole():
    summary = "Of the allocated memory 30.21 GiB is allocated by PyTorch, and 48.00 GiB is reserved but unallocated."
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. " + "x" * 400 + summary)
    assert error_text(oom, "baseline failed: ").endswith(summary)
    assert error_text(oom).startswith("OutOfMemoryError: CUDA out of memory")
    other = error_text(ValueError("y" * 1000), "error: ")
    assert other.startswith("error: ValueError: yyy") and len(other) == 300
