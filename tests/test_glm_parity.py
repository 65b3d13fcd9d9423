"""GLM-5 (``glm_moe_dsa``) against Hugging Face transformers' ``GlmMoeDsaForCausalLM`` on a tiny checkpoint that
transformers writes: identical greedy tokens, the runner in reference mode (fp32, indexer in the activation dtype as
transformers scores it). Every layer type: dense and MoE layers, indexer layers "full" and "shared" (a shared layer
attends over the top-k of the last full one); index_topk 5 below every prompt, so the indexer drops tokens."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_runner import SamplingParams, build_engine  # noqa: E402
from tests.hf_oracle import hf_greedy, randomize  # noqa: E402

PROMPTS = [[3, 17, 9, 44, 2, 91, 23, 5, 60, 7, 71, 12, 33, 8], [100, 4, 4, 18, 77, 1, 36], [55] * 3 + [9, 120, 6]]
NEW_TOKENS = 8
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=6, kv_lora_rank=32,
             q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
             num_experts_per_tok=2, index_head_dim=32, index_n_heads=8, index_topk=5, first_k_dense_replace=1,
             indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=256)


def test_greedy_tokens_equal_transformers(tmp_path):
    config = transformers.GlmMoeDsaConfig(**SIZES)
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(config).float().eval()
    randomize(model, torch.Generator().manual_seed(5))
    model.save_pretrained(tmp_path)
    assert "model.layers.1.self_attn.indexer.wk.weight" not in model.state_dict()  # a shared layer: no indexer
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    engine = build_engine(tmp_path, mode="reference", dtype=torch.float32, device="cpu", num_pages=12, page_size=16,
                          max_seqs=3, max_seq_len=32, max_num_batched_tokens=9, index_precision="activation",
                          poison=True)
    assert engine.model.config.indexer_types == ("full", "shared", "full", "shared")
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), progress=False) == expected
