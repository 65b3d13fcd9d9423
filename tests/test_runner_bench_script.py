"""scripts/runner_bench.py: the MoE floor follows the experts a step reaches, and the tiny decode part (interpreter)
writes a results file with those counts, for V3.2 and for DeepSeek-V4 (``--model``); V4's fill writes every cache
row a decode step reads; shapes over the free memory are skipped with a note."""
import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
V4_FLASH = ROOT / "model_runner" / "configs" / "deepseek-v4-flash.json"


@pytest.fixture(scope="module")
def runner_bench():
    spec = importlib.util.spec_from_file_location("runner_bench", ROOT / "scripts" / "runner_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_moe_floor_moves_with_the_experts_reached(runner_bench):
    """Uniform routing's count gives the registry's cost; each expert fewer takes its MXFP4 bytes off, FLOPs stay."""
    from dsa_triton.moe.fused_moe_gemm_spec import expected_active_experts

    c = runner_bench.v32_config()
    shape = {"T": 64, "E": c.n_routed_experts, "top_k": c.num_experts_per_tok}
    uniform = expected_active_experts(shape)
    default = runner_bench.moe_cost(c, 64, "decode", None)
    assert runner_bench.moe_cost(c, 64, "decode", uniform).bytes == pytest.approx(default.bytes)
    fewer = runner_bench.moe_cost(c, 64, "decode", uniform - 10)
    assert default.bytes - fewer.bytes == pytest.approx(10 * 3 * c.hidden_size * c.moe_intermediate_size * 17 / 32)
    assert fewer.flops == default.flops
    layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    floors = runner_bench.step_floors(c, 64, 64, 4096, "decode", uniform - 10)
    assert floors["moe"].bytes == pytest.approx(layers * fewer.bytes)


@pytest.mark.parametrize("model", [None, V4_FLASH], ids=["v32", "v4"])
def test_tiny_decode_counts_the_experts_each_step_reaches(tmp_path, model):
    flags = [] if model is None else ["--model", str(model)]
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "runner_bench.py"), "--tiny", "--part", "decode",
                          "--out", str(tmp_path), *flags], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = tmp_path.rglob("runner_bench-decode-*.json" if model is None else
                               "runner_bench-deepseek-v4-flash-decode-*.json")
    sections = json.loads(results.read_text())
    rows = sections["decode"]
    assert [r["batch"] for r in rows] == [3] and sections["decode notes"] == []
    top_k = 2  # the tiny configs' experts a token
    assert all(top_k <= r["active_experts"] <= top_k * r["batch"] for r in rows)
    assert all(r["graph_vs_eager_argmax_equal"] for r in rows)


def test_the_v4_fill_writes_every_row_a_decode_step_reads(runner_bench, monkeypatch):
    """Caches poisoned with NaN, two sequences filled to 300 tokens 64 at a time (the window's early pages given
    back): a reference decode step gives finite logits; one filled compressed entry poisoned again does not."""
    from model_runner.families.deepseek_v4.config import tiny_config
    from model_runner.ops import ReferenceOps

    monkeypatch.setattr(runner_bench, "FILL_CHUNK", 64)
    c, length = tiny_config(), 300
    cache = runner_bench.build_cache(c, 2, length + 64, torch.float32, "cpu")
    for storage in cache.layers:
        for rows in storage.values():
            rows.fill_(float("nan"))
    seqs = [cache.allocate(0) for _ in range(2)]
    runner_bench.fill_streams(cache, seqs, length)
    assert cache.streams["window"].pages[seqs[0]][:4] == [-1] * 4 and [cache.length(s) for s in seqs] == [length] * 2
    model = runner_bench.build_model(c, torch.float32, "cpu", ReferenceOps())

    def step():
        for s in seqs:
            cache.grow(s, length + 1)
        runner_bench.rewind(cache, seqs, [length] * 2)
        return model.forward(torch.tensor([5, 7]), cache.prepare([(s, 1) for s in seqs]), cache)

    assert step().isfinite().all()
    hca = cache.streams["hca"]
    cache.layers[2]["entries"][hca.block_table[seqs[1], 0] * cache.page_size] = float("nan")  # HCA entry 0
    assert step().isfinite().all(1).tolist() == [True, False]


def test_shapes_over_the_free_memory_are_skipped_with_a_note(runner_bench):
    args = argparse.Namespace(device="cpu", tiny=True, model=str(V4_FLASH), layers=None, budget_s=60)
    bench = runner_bench.Bench(args)
    bench.free_memory = lambda: 2 ** 30
    out = bench.decode([40], [1, 3])
    assert out["decode"] == [] and [n["batch"] for n in out["decode notes"]] == [1, 3]
    assert all(n["note"].startswith("skipped: needs 3.") and "1.0 GiB free" in n["note"] for n in out["decode notes"])
