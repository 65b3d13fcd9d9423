"""Day 0 with a model that is not DeepSeek-V3.2: every job's dims come from its config.json where the config has them
(other head, expert and group counts, another hidden size), only dims no config has come from bench shapes, and
the CLI names those."""
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
         "index_n_heads": 32, "index_head_dim": 128, "index_topk": 1024}
BATCHES, CONTEXTS, CHUNKS = (1, 8, 64), (8192, 32768, 131072), (2048, 8192)
# what the config gives each dim name (H and D: the indexer's in kernels named *index*, else attention's)
MODEL = {"hidden": 6144, "E": 384, "top_k": 6, "I": 1536, "n_group": 1, "topk_group": 1, "softmax": 0, "k": 1024,
         "DK": 128, "Dv": 384, "P": 64}
GEMMS = {(3072, 6144, 1), (6144, 1536, 0)}  # (N, K, gather): gate_up and down
GEMMS_GATHER = {(n, k): g for n, k, g in GEMMS}  # the MXFP4 kernels have no gather dim
# dims no config has (decode queries per sequence, selected pages, alignment, experts per conversion, cached
# tokens before an append, index form, a context outside the shape key)
NOT_MODEL = {"Q", "S", "SEL", "block_m", "G", "ctx", "logical", "L"}


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
    assert {j.spec.name for j in jobs} == {s.name for s in registry.kernels() if not s.name.startswith("toy_")}
    counts = {"B": set(BATCHES) | {1}, "T": set(BATCHES) | set(CHUNKS), "N": set(BATCHES) | set(CHUNKS),
              "L": set(CONTEXTS), "pages": {c // 64 for c in CONTEXTS},
              "M": {6 * c for c in CHUNKS}, "Q": set(CHUNKS)}
    for job in jobs:
        name, shape = job.spec.name, job.shape
        model = {**MODEL, "H": 32 if "index" in name else 64, "D": 128 if "index" in name else 448}
        weights = name.startswith(("moe_fused", "moe_workspace", "mxfp4"))
        if weights:
            assert (shape["N"], shape["K"], shape.get("gather", GEMMS_GATHER[(shape["N"], shape["K"])])) in GEMMS, str(job)
        for dim, value in shape.items():
            if weights and dim in ("N", "K", "gather"):
                continue
            if dim in job.spec.bucketed_dims and value in counts.get(dim, ()):
                continue
            if dim in model:
                assert value == model[dim], (str(job), dim)
            else:
                assert dim in NOT_MODEL, (str(job), dim)
                assert f"{name} {job.phase}: " in notes and f"{dim}={value}" in notes, (str(job), dim)  # named
    path = [j.shape for j in jobs if j.spec.name == "moe_path"]
    assert path and all((s["n_group"], s["topk_group"]) == (1, 1) for s in path)  # outside its shape key
    route = [j.shape for j in jobs if j.spec.name == "moe_route"]
    assert route and all((s["n_group"], s["topk_group"], s["softmax"]) == (1, 1, 0) for s in route)
    assert "n_group" not in notes and "topk_group" not in notes and "softmax" not in notes


@pytest.mark.parametrize("groups, expected", [({}, (1, 1)), ({"n_group": None, "topk_group": None}, (1, 1)),
                                              ({"n_group": 1, "topk_group": 4}, (1, 1)),
                                              ({"n_group": 8, "topk_group": 3}, (8, 3))])
def test_expert_groups_from_the_config(groups, expected):
    config = {k: v for k, v in OTHER.items() if k not in ("n_group", "topk_group")} | groups
    for name, phase in (("moe_path", "prefill"), ("moe_route", "decode")):
        shapes = sh.model_shapes(registry.get(name), phase, config, batches=(8,), chunks=(2048,))
        assert {(s["n_group"], s["topk_group"]) for s in shapes} == {expected}, name


def test_missing_model_dims_are_errors_unless_set(tmp_path, capsys):
    grouped = {**OTHER, "n_group": 4, "topk_group": None}
    with pytest.raises(ValueError, match="lacks 'topk_group'.*--set topk_group="):
        sh.model_shapes(registry.get("moe_path"), "decode", grouped)
    assert {s["topk_group"] for s in sh.model_shapes(registry.get("moe_path"), "decode", grouped,
                                                     overrides={"topk_group": 2}, batches=(1,))} == {2}
    with pytest.raises(ValueError, match="scoring_func 'relu'"):
        sh.model_shapes(registry.get("moe_route"), "decode", {**OTHER, "scoring_func": "relu"})
    no_topk = {k: v for k, v in OTHER.items() if k != "index_topk"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(no_topk))
    assert main(["tune", "--kernels", "topk_indices", "--model", str(path), "--list"]) == 2
    assert "lacks 'index_topk'" in capsys.readouterr().err
    assert main(["tune", "--kernels", "topk_indices", "--model", str(path), "--set", "k=512", "--batches", "1",
                 "--contexts", "8192", "--chunks", "2048", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["topk_indices any L=8192,T=1,k=512",
                                                    "topk_indices any L=8192,T=2048,k=512", "2 jobs"]
