"""The runner against Hugging Face transformers' ``DeepseekV32ForCausalLM`` on tiny checkpoints that transformers
itself writes (``save_pretrained``): identical greedy tokens.

Both in fp32; the runner in its reference mode (the kernels take bf16 / fp16 activations; tests/test_model_runner.py
holds the kernel mode to the reference mode) with the indexer in the activation dtype (Hugging Face's indexer does
not round to FP8). The experts are made MXFP4-representable before saving, so the runner's load-time conversion is
lossless. Weights are redrawn at the runner's scales (transformers' init, std 0.02, leaves the logits nearly flat).
Cases: index_topk at or above every context, and below it (the indexer really drops tokens); plain RoPE and YaRN
with another theta, attention factor != 1 and attention biases (also with its config.json rewritten in the older
top-level rope_theta + rope_scaling form); one model.safetensors and shards.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_runner import SamplingParams, build_engine  # noqa: E402
from tests.hf_oracle import hf_greedy, randomize  # noqa: E402

PROMPTS = [[3, 17, 9, 44, 2, 91, 23, 5, 60, 7, 71, 12, 33, 8], [100, 4, 4, 18, 77, 1, 36], [55] * 3 + [9, 120]]
NEW_TOKENS = 8
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=6, kv_lora_rank=32,
             q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=3, topk_group=2,
             num_experts_per_tok=2, index_head_dim=32, index_n_heads=16)
CASES = {
    "topk above context, plain rope, single file": dict(
        index_topk=64, mlp_layer_types=["sparse", "dense", "sparse"], shard=None),
    "topk below context, yarn theta 50000, biases, shards": dict(
        index_topk=5, first_k_dense_replace=1, attention_bias=True, shard="40KB", max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 0.8}),
}


def hf_checkpoint(folder, seed: int, shard, **overrides):
    """A transformers model in fp32 with runner-scale random weights and MXFP4-representable experts, saved."""
    config = transformers.DeepseekV32Config(**{**SIZES, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(config).float().eval()
    randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(tmp_path, case):
    overrides = dict(CASES[case])
    shard = overrides.pop("shard")
    model = hf_checkpoint(tmp_path, seed=len(case), shard=shard, **overrides)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = runner(tmp_path)
    assert engine.notes == ["experts: float32 -> MXFP4 at load in 2 layers; 0 of 2304 32-element blocks lossy "
                            "(0.00%)"]
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), progress=False) == expected
    if "rope_parameters" in overrides:
        config = json.loads((tmp_path / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": rope.pop("rope_type"), **rope})
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert runner(tmp_path).generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), progress=False) == expected


def runner(folder):
    return build_engine(folder, mode="reference", dtype=torch.float32, device="cpu", num_pages=12, page_size=16,
                        max_seqs=3, max_seq_len=32, max_num_batched_tokens=9, index_precision="activation", poison=True)
