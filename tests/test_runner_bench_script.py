"""scripts/runner_bench.py: the MoE floor follows the experts a step reaches, and the tiny decode part (interpreter)
writes a results file with those counts."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


def test_tiny_decode_counts_the_experts_each_step_reaches(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "runner_bench.py"), "--tiny", "--part", "decode",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = tmp_path.rglob("runner_bench-decode-*.json")
    rows = json.loads(results.read_text())["decode"]
    assert [r["batch"] for r in rows] == [3]
    top_k = 2  # the tiny config's experts a token
    assert all(top_k <= r["active_experts"] <= top_k * r["batch"] for r in rows)
    assert all(r["graph_vs_eager_argmax_equal"] for r in rows)
