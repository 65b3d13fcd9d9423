"""Expert-parallel MoE and data-parallel generation (model_runner.distributed) on CPU: gloo process groups.

The acceptance test: ``torchrun`` with two gloo processes (kernel mode in the Triton interpreter, fp16, a tiny
model) writes the same output file, greedy tokens included, as one process. Beside it: the MoE layer split into
routing and :func:`dsa_triton.moe.moe_forward.moe_experts` (what a rank runs on the rows sent to it), expert ownership,
loading only a rank's experts, the expert-parallel layer against the one-process layer in a group of one, and four
reference-mode processes with one rank that has no prompt at all.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dsa_triton as dt
from dsa_triton.moe.moe_forward import moe_experts
from dsa_triton.moe.moe_forward_spec import compare_layer
from dsa_triton.moe.moe_forward_reference import moe_experts_torch, moe_forward_torch
from model_runner import SamplingParams, build_engine, load_checkpoint, save_random_checkpoint, tiny_config
from model_runner.__main__ import main
from model_runner.distributed import Parallel
from model_runner.errors import RunnerError
from model_runner.loader import TensorFiles
from model_runner.model import MoE
from model_runner.ops import KernelOps, ReferenceOps
from tests.poison import poisoned_allocations
from tests.test_moe_layer import DEEPSEEK, layer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tiny_config()  # 6 experts top-2 in layers 1 and 2


@pytest.mark.parametrize("path", ["fused", "workspace"])
def test_moe_experts_is_the_layer_after_routing(path):
    """moe_experts on the router's choice is moe_forward bit for bit; one row per (token, choice) with its one
    expert, unweighted in fp32 and weighted afterwards (an expert-parallel rank's form), gives the same routed sum;
    both against the references."""
    args, kwargs = layer(5, 6, 64, 32, DEEPSEEK)
    x, router, experts = args[0], args[1], args[2:]
    weights, ids = dt.route_topk(x.float() @ router.t(), DEEPSEEK, kwargs["router_bias"])
    shared = {"shared_gate_up": kwargs["shared_gate_up"], "shared_down": kwargs["shared_down"]}
    slots = x[torch.arange(5).repeat_interleave(2)]  # token t's rows 2t and 2t + 1
    with poisoned_allocations():
        whole = dt.moe_forward(*args, **kwargs, config={"path": path})
        after = moe_experts(x, ids, weights, *experts, **shared, config={"path": path})
        routed = moe_experts(x, ids, weights, *experts, out_dtype=torch.float32, config={"path": path})
        rows = moe_experts(slots, ids.view(-1, 1), None, *experts, out_dtype=torch.float32, config={"path": path})
    assert torch.equal(after, whole)
    assert rows.dtype == routed.dtype == torch.float32 and rows.shape == (10, 64)
    torch.testing.assert_close(torch.bmm(weights.view(5, 1, 2), rows.view(5, 2, 64)).view(5, 64), routed,
                               rtol=1e-5, atol=1e-5 * routed.abs().max().item())
    ref = moe_experts_torch(x, ids, weights, *experts)
    ref_rows = moe_experts_torch(slots, ids.view(-1, 1), None, *experts)
    torch.testing.assert_close(torch.bmm(weights.view(5, 1, 2), ref_rows.view(5, 2, 64)).view(5, 64), ref)
    assert compare_layer(rows, ref_rows, 1e-3 if path == "fused" else 0.06) is None  # workspace: e4m3 activations
    torch.testing.assert_close(moe_experts_torch(x, ids, weights, *experts, **shared), moe_forward_torch(*args, **kwargs))


def test_moe_experts_checks_its_ids():
    args, _ = layer(4, 7, 64, 32, DEEPSEEK, shared=False)
    x, experts = args[0], args[2:]
    good = torch.tensor([[0, 6], [1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    moe_experts(x, good, None, *experts)
    with pytest.raises(ValueError, match=r"topk_ids: expert ids must be in \[0, 7\), got values in \[0, 7\]"):
        moe_experts(x, good + (good == 6).int(), None, *experts)
    with pytest.raises(ValueError, match="topk_ids: dimension 0 must be 4"):
        moe_experts(x, good[:3], None, *experts)
    with pytest.raises(ValueError, match="topk_weights: "):
        moe_experts(x, good, torch.ones(4, 3), *experts)


def test_expert_ownership():
    owned = [Parallel(r, 4, torch.device("cpu")).owned(6) for r in range(4)]
    assert owned == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    assert [Parallel(r, 2, torch.device("cpu")).owned(256) for r in range(2)] == [range(0, 128), range(128, 256)]
    with pytest.raises(RunnerError, match="experts: 3 experts cannot be split over 4 ranks"):
        Parallel(0, 4, torch.device("cpu")).owned(3)


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_a_rank_loads_only_its_experts(tmp_path, monkeypatch, experts):
    """Stacked MXFP4 experts: a slice of the file; experts one by one: only the rank's are read (and quantized)."""
    save_random_checkpoint(CONFIG, tmp_path, experts=experts, shards=2, seed=3)
    full = load_checkpoint(tmp_path, CONFIG, torch.float16, "cpu").weights
    read = []
    get, get_rows = TensorFiles.get, TensorFiles.get_rows
    monkeypatch.setattr(TensorFiles, "get", lambda self, name: read.append((name, None)) or get(self, name))
    monkeypatch.setattr(TensorFiles, "get_rows",
                        lambda self, name, rows: read.append((name, rows)) or get_rows(self, name, rows))
    part = load_checkpoint(tmp_path, CONFIG, torch.float16, "cpu", experts=range(2, 4)).weights
    assert part.keys() == full.keys()
    for name, t in full.items():
        if ".experts." in name:
            assert part[name].shape[0] == 2 and torch.equal(part[name], t[2:4]), name
        else:
            assert part[name] is not t and torch.equal(part[name], t), name
    expert_reads = {(name.split(".experts.")[1], rows) for name, rows in read if ".experts." in name}
    if experts == "mxfp4":
        assert expert_reads == {(f"{p}_proj_{k}", range(2, 4)) for p in ("gate_up", "down") for k in ("blocks", "scales")}
    else:
        assert expert_reads == {(f"{e}.{p}_proj.weight", None) for e in (2, 3) for p in ("gate", "up", "down")}


@pytest.fixture
def group_of_one():
    """A gloo process group of one rank in this process (torn down after the test)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Parallel(0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ops", [KernelOps(check_values=True), ReferenceOps()], ids=["kernel", "reference"])
def test_expert_parallel_layer_in_a_group_of_one(tmp_path, group_of_one, ops):
    """Route, pack, all-to-all, unpack, experts, all-to-all back, combine: the one-process layer's output; and a
    rank without tokens gets an empty output."""
    save_random_checkpoint(CONFIG, tmp_path, seed=4)
    weights = load_checkpoint(tmp_path, CONFIG, torch.float16, "cpu").weights
    moe = MoE(CONFIG, weights, "model.layers.1.mlp.")
    x = torch.randn(7, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0)).half()
    with poisoned_allocations():
        got = group_of_one.moe(x, moe, ops)
    want = ops.moe(x, moe.router, *moe.experts, routing=moe.routing, router_bias=moe.bias)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-3 * want.abs().max().item())
    assert group_of_one.moe(x[:0], moe, ops).shape == (0, CONFIG.hidden_size)
    assert group_of_one.stats["collectives"] == 6  # counts, rows there, rows back; twice


def test_an_engine_built_with_a_group_steps_with_it(tmp_path, group_of_one):
    """build_engine(parallel=...) hands the group to the MoE layers and to the engine's loop: the one-process tokens,
    with 3 collectives a MoE layer and step, one all-reduce a step and one to stop; an idle step joins every MoE
    layer's collectives."""
    save_random_checkpoint(CONFIG, tmp_path, seed=4)
    common = dict(mode="reference", dtype=torch.float32, device="cpu")
    prompts, params = [[5, 6, 7], [9, 8, 7, 6]], SamplingParams(max_new_tokens=3)
    want = build_engine(tmp_path, **common).generate(prompts, params, progress=False)
    engine = build_engine(tmp_path, **common, parallel=group_of_one)
    assert "expert parallel: rank 0 of 1 holds experts 0..5 of 6 in each MoE layer" in engine.notes
    assert engine.generate(prompts, params, progress=False) == want
    assert group_of_one.stats["collectives"] == len(engine.steps) * (3 * 2 + 1) + 1
    before = group_of_one.stats["collectives"]
    engine.model.idle()
    assert group_of_one.stats["collectives"] == before + 3 * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(processes: int, *argv: str) -> subprocess.Popen:
    """``torchrun --nproc-per-node processes -m model_runner ARGV`` on this tree, in the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", "model_runner", *argv]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(process: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    assert main(["make-tiny", str(folder), "--shards", "2"]) == 0
    return folder


def write_prompts(path: Path, lines: list) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_two_gloo_processes_give_one_process_tokens(tiny, tmp_path, capsys):
    """Kernel mode, fp16, interpreter. Rank 0 runs prompts 0 and 2, rank 1 prompt 1, which stops after 2 tokens:
    rank 1 then joins the MoE collectives with no tokens until rank 0 is done. One output file, prompts in order."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", [list(range(3, 14)), {"prompt_token_ids": [5, 4, 3],
                            "max_new_tokens": 2}, "hi"])  # 11 tokens (top-k 8 drops some), 3, BOS + 2
    common = ["generate", "--model", str(tiny), "--prompts", str(prompts), "--max-new-tokens", "3", "--ignore-eos",
              "--no-progress", "--chunk", "16"]
    two = torchrun(2, *common, "--out", str(tmp_path / "two.jsonl"))
    assert main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0  # meanwhile, in this process
    log = finished(two)
    one = (tmp_path / "one.jsonl").read_text()
    assert (tmp_path / "two.jsonl").read_text() == one
    assert [len(json.loads(line)["token_ids"]) for line in one.splitlines()] == [3, 2, 3]
    assert "kernel mode, float16 on cpu" in log and "(rank 0 of 2 shown)" in log
    assert "note: expert parallel: rank 0 of 2 holds experts 0..2 of 6 in each MoE layer" in log
    assert "workspace: expert-parallel dispatch / combine" in log and "memory plan totals by rank: " in log
    experts_line = [line for line in log.splitlines() if "weights: experts MXFP4" in line]
    one_line = [line for line in capsys.readouterr().out.splitlines() if "weights: experts MXFP4" in line]
    assert 2 * float(experts_line[0].split()[-2]) == pytest.approx(float(one_line[0].split()[-2]), abs=0.02)
    # every rank the same collectives: 3 a MoE layer and step (2 layers; 1 prefill + 2 decode steps on rank 0) and
    # one all-reduce a step and one to stop: 18 + 4
    assert log.count("collectives: 22 calls") == 2, log


def test_four_processes_one_without_prompts(tiny, tmp_path):
    """Reference mode: 6 experts over 4 ranks (1, 2, 1, 2), 3 prompts: rank 3 has none and joins every step."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", [[9, 8, 7, 6, 5], "abc", [200] * 13])
    common = ["generate", "--model", str(tiny), "--prompts", str(prompts), "--max-new-tokens", "4", "--ignore-eos",
              "--no-progress", "--mode", "reference", "--dtype", "float32"]
    four = torchrun(4, *common, "--out", str(tmp_path / "four.jsonl"))
    assert main([*common, "--out", str(tmp_path / "one.jsonl")]) == 0
    log = finished(four)
    assert (tmp_path / "four.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert "rank 3: prefill: 0 tokens" in log and log.count("memory plan totals by rank: ") == 1
