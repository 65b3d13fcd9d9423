"""DeepSeek-V4 (``deepseek_v4``) in the runner against transformers' ``DeepseekV4ForCausalLM`` on a tiny checkpoint
that transformers writes (every layer type: sliding window, CSA with its indexer, HCA; hash-routed and top-k routed
MoE with a SwiGLU clip of 0.5 that binds; 2 residual streams; YaRN on the compressed branches): identical greedy
tokens in reference mode (fp32), logits within fp32 rounding; prompts of up to 30 tokens make every compressor emit
entries (CSA 4:1, HCA 8:1, window 8) and the indexer keep 3 of up to 9 entries. The same tokens with chunked prefill
and with preemption (recompute), from DeepSeek's own tensor names, from FP8 dense weights and FP4 experts, and
(within tolerance) in kernel mode."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import dsa_triton as dt  # noqa: E402
from dsa_triton.linear.formats import dequantize_fp8_blockwise  # noqa: E402
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch  # noqa: E402
from model_runner import RunnerError, SamplingParams, build_engine, read_config  # noqa: E402
from model_runner.families.deepseek_v4.config import DeepseekV4Config, tiny_config  # noqa: E402
from model_runner.ops import FP8Weight  # noqa: E402
from model_runner.tiny import save_random_checkpoint  # noqa: E402
from tests.hf_oracle import hf_greedy, randomize, runner_scale  # noqa: E402
from tests.threads import one_thread  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
SIZES = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             head_dim=64, partial_rotary_factor=0.25, q_lora_rank=48, n_routed_experts=6, num_experts_per_tok=2,
             layer_types=["sliding_attention", CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8}, sliding_window=8,
             o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=3, hc_mult=2,
             num_nextn_predict_layers=0, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=0.5,
             max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                                                           "beta_slow": 1, "original_max_position_embeddings": 64})
PROMPTS = [list(range(3, 33)), [100, 4, 4, 18, 77, 1, 36, 9, 9, 50, 2, 7, 8, 90, 11, 12, 13, 40, 41, 42, 5],
           [55, 3, 9, 120, 6]]  # 30, 21, 5 tokens
NEW_TOKENS = 8
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS)


def runner(folder, mode="reference", **kwargs):
    kwargs = {"num_pages": 16, "page_size": 8, "max_seqs": 3, "max_seq_len": 48, "max_num_batched_tokens": 64,
              "poison": True, "dtype": torch.float32 if mode == "reference" else torch.float16, **kwargs}
    return build_engine(folder, mode=mode, device="cpu", **kwargs)


def v4_scale(name: str, shape, g: torch.Generator) -> torch.Tensor:
    """:func:`runner_scale`, with the hyper-connections' scales near 1 and their bases, position biases and sinks
    N(0, 0.25)."""
    if name.endswith(("hc.scale", "hc_scale")):
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("hc.base", "hc_base", "position_bias", "sinks")):
        return 0.5 * torch.randn(shape, generator=g)
    return runner_scale(name, shape, g)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """transformers' model (fp32, runner-scale weights, MXFP4-representable experts), saved in one file and in
    shards, and its greedy tokens."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**SIZES)).float().eval()
    g = torch.Generator().manual_seed(3)
    randomize(model, g, v4_scale)
    for name, b in model.named_buffers():  # hash routing: distinct experts a token
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], SIZES["n_routed_experts"], generator=g).argsort(1)[:, :b.shape[1]])
    single, shards = tmp_path_factory.mktemp("v4"), tmp_path_factory.mktemp("v4_shards")
    model.save_pretrained(single)
    model.save_pretrained(shards, max_shard_size="100KB")
    return model, single, shards, [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def test_greedy_tokens_equal_transformers(hf):
    model, single, shards, expected = hf
    assert "model.layers.1.attn.indexer.compressor.wkv.weight" in load_file(single / "model.safetensors")
    assert len(json.loads((shards / "model.safetensors.index.json").read_text())["weight_map"]) > 100
    engine = runner(single)
    assert engine.notes == ["experts: float32 -> MXFP4 at load in 4 layers; 0 of 4608 32-element blocks lossy "
                            "(0.00%)"]
    assert engine.generate(PROMPTS, PARAMS, progress=False) == expected
    assert runner(shards).generate(PROMPTS, PARAMS, progress=False) == expected
    logs, forward = [], engine.model.forward  # one sequence: its logits at every step against a full forward
    engine.model.forward = lambda *args: logs.append(forward(*args)) or logs[-1]
    engine.generate(PROMPTS[:1], PARAMS, progress=False)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([PROMPTS[0] + expected[0]])).logits[0, len(PROMPTS[0]) - 1:-1]
    torch.testing.assert_close(torch.cat(logs), full, rtol=0, atol=2e-5)


@pytest.mark.parametrize("chunk, num_pages, max_seqs", [(5, 16, 3), (7, 4, 3)])
def test_chunked_prefill_and_preemption_give_the_same_tokens(hf, chunk, num_pages, max_seqs):
    """Prompts split into chunks of 5 (windows close across chunk boundaries), and a cache of 4 pages a stream where
    sequences are preempted and recomputed: every compressed entry is rebuilt the same."""
    _, single, _, expected = hf
    engine = runner(single, max_num_batched_tokens=chunk, num_pages=num_pages, max_seqs=max_seqs, page_size=4)
    assert engine.generate(PROMPTS * 2, PARAMS, progress=False) == expected * 2
    assert (engine.scheduler.preemptions > 0) == (num_pages == 4)
    assert all(s.allocator.num_free == s.allocator.num_pages for s in engine.cache.streams.values())


def test_deepseek_names_fp8_and_fp4(hf, tmp_path):
    """DeepSeek's own names (``embed.weight``, ``layers.N.*``, ``hc_head_fn``) load as transformers' do, the
    multi-token-prediction layer skipped with a note; FP8 projections (kept FP8; E8M0 block scales named ``.scale``
    as DeepSeek ships them) and FP4 experts (read as MXFP4 without conversion) give the tokens of their dequantized
    twin."""
    _, single, _, expected = hf
    tensors = load_file(single / "model.safetensors")
    renamed = {("embed.weight" if n == "model.embed_tokens.weight" else "norm.weight" if n == "model.norm.weight"
                else n.replace("model.hc_head.hc_", "hc_head_").removeprefix("model.")): t for n, t in tensors.items()}
    (tmp_path / "ds").mkdir()
    save_file({**renamed, "mtp.0.norm.weight": torch.ones(4)}, str(tmp_path / "ds" / "model.safetensors"))
    config = json.loads((single / "config.json").read_text())
    (tmp_path / "ds" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    engine = runner(tmp_path / "ds")
    assert engine.notes[-1] == ("multi-token-prediction layers 0..0 (num_nextn_predict_layers = 1): 1 tensors skipped "
                                "(not used for generation)")
    assert engine.generate(PROMPTS, PARAMS, progress=False) == expected
    quantized, twin = tmp_path / "fp8", tmp_path / "twin"
    save_random_checkpoint(tiny_config(hidden_size=128, o_lora_rank=128), quantized, experts="mxfp4", dense="fp8",
                           seed=2)
    tensors = load_file(quantized / "model.safetensors")
    assert tensors["model.layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # FP4: two e2m1 a byte
    save_file({(n.removesuffix("weight_scale_inv") + "scale" if n.endswith("_scale_inv") else n):
               (t.to(torch.float8_e8m0fnu) if n.endswith("_scale_inv") else t) for n, t in tensors.items()},
              str(quantized / "model.safetensors"))
    dense = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            dense[name] = dequantize_fp8_blockwise(t, tensors[name + "_scale_inv"]).bfloat16()
        elif t.dtype == torch.int8:
            scales = tensors[name.removesuffix("weight") + "scale"].view(torch.uint8)
            dense[name] = mxfp4_dequantize_torch(t.view(torch.uint8).view(*scales.shape, 16), scales).bfloat16()
        elif not name.endswith(("_scale_inv", ".scale")):
            dense[name] = t
    twin.mkdir()
    save_file(dense, str(twin / "model.safetensors"))
    (twin / "config.json").write_text(json.dumps({**read_config(quantized / "config.json").to_dict(),
                                                  "quantization_config": None}))
    engines = [runner(folder) for folder in (quantized, twin)]
    assert engines[0].notes == ["dense weights: 44 FP8 projections kept in FP8 (blockwise-FP8 GEMM), 0 FP8 tensors "
                                "dequantized to float32 at load"]
    assert engines[1].notes == ["experts: bfloat16 -> MXFP4 at load in 4 layers; 0 of 9216 32-element blocks lossy "
                                "(0.00%)"]
    assert engines[0].generate(PROMPTS, PARAMS, progress=False) == engines[1].generate(PROMPTS, PARAMS, progress=False)


def test_config_forms_and_errors(hf):
    """transformers' config.json, its legacy keys (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling)
    and the runner's own to_dict read alike; unknown layer types, scoring functions, quantization methods and keys
    are one-line errors naming them."""
    _, single, _, _ = hf
    values = json.loads((single / "config.json").read_text())
    config = DeepseekV4Config.from_dict(values)
    assert config.layer_types == tuple(SIZES["layer_types"]) and config.qk_rope_head_dim == 16
    assert config.compress_rope.attention_factor == 1.0 and config.compress_rope.factor == 4.0
    assert DeepseekV4Config.from_dict(config.to_dict()) == config
    legacy = {k: v for k, v in values.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                           "partial_rotary_factor", "rope_parameters")}
    legacy.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=16,
                  compress_rate_hca=8, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                                     "original_max_position_embeddings": 64})
    assert DeepseekV4Config.from_dict(legacy) == config
    for change, message in (({"layer_types": ["sliding_attention", "full_attention", HCA, CSA]},
                             "layer_types entry 'full_attention' is not implemented"),
                            ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not implemented"),
                            ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' is not implemented"),
                            ({"n_shared_experts": 2}, "n_shared_experts = 2 is not implemented"),
                            ({"model_type": "deepseek_v5"}, "model_type 'deepseek_v5' is not implemented \\(known: "
                                                            "deepseek_v32, deepseek_v4, glm_moe_dsa\\)"),
                            ({"first_k_dense_replace": 1}, "key 'first_k_dense_replace' is not implemented")):
        (single.parent / "bad").mkdir(exist_ok=True)
        (single.parent / "bad" / "config.json").write_text(json.dumps({**values, **change}))
        with pytest.raises(RunnerError, match=message) as error:
            read_config(single.parent / "bad" / "config.json")
        assert "\n" not in str(error.value)


def test_kernel_mode_matches_reference_mode(tmp_path, monkeypatch):
    """Kernel mode (fp16: FP8 projections on dt.fp8_blockwise_linear, the grouped wo_a per group; the compressors on
    dt.compress_entries, the indexer on dt.v4_indexer_logits and dt.topk_indices, the attention over the window and
    the compressed entries on dt.sparse_attention_prefill / _decode; FP4 experts on dt.fused_moe_gemm with the SwiGLU
    clip between the two GEMMs; dt.swiglu) against reference mode (fp16, their PyTorch references): the same tokens
    (or a near-tie where they part), logits within fp16 rounding."""
    save_random_checkpoint(tiny_config(hidden_size=128, o_lora_rank=128, swiglu_limit=0.5), tmp_path,
                           experts="mxfp4", dense="fp8", seed=2)
    calls = dict.fromkeys(("compress_entries", "v4_indexer_logits", "topk_indices", "sparse_attention_prefill",
                           "sparse_attention_decode"), 0)
    lengths = []  # the count of valid entries a token (CSA, HCA): the kernel walks those, not the full width
    for name in calls:
        def counted(*args, op=getattr(dt, name), name=name, **kwargs):
            calls[name] += 1
            if kwargs.get("extra_topk_length") is not None:
                counts = kwargs["extra_indices"].ge(0).sum(1)
                lengths.append(bool(counts.eq(kwargs["extra_topk_length"]).all()))
            return op(*args, **kwargs)
        monkeypatch.setattr(dt, name, counted)
    runs = {}
    for mode in ("reference", "kernel"):
        engine = runner(tmp_path, mode=mode, dtype=torch.float16)
        logs, forward = [], engine.model.forward
        engine.model.forward = lambda *args, forward=forward, logs=logs: logs.append(forward(*args)) or logs[-1]
        runs[mode] = engine.generate(PROMPTS, PARAMS, progress=False), logs
    attention = engine.model.layers[1][2]
    assert isinstance(attention.wq_a, FP8Weight) and isinstance(attention.wo_a[0], FP8Weight)
    # every step: 3 compressors (CSA's two, HCA's), the CSA indexer from the first entry on, 4 attention layers
    assert calls == {"compress_entries": 5 * NEW_TOKENS, "v4_indexer_logits": 2 * NEW_TOKENS,
                     "topk_indices": 2 * NEW_TOKENS, "sparse_attention_prefill": 4, "sparse_attention_decode": 28}
    assert len(lengths) == 24 and all(lengths)  # 3 compressed layers x (1 prefill + 7 decode): counts exact
    (want, ref_logs), (got, kernel_logs) = runs["reference"], runs["kernel"]
    assert len(ref_logs) == NEW_TOKENS  # one prefill step, then decode steps: step i gives every sequence's token i
    for step, (ref, kernel) in enumerate(zip(ref_logs, kernel_logs)):
        tokens = [seq[step] for seq in want]
        if [seq[step] for seq in got] != tokens:  # a near-tie, then the runs part
            top = ref.topk(2, dim=-1).values
            assert float((top[:, 0] - top[:, 1]).min()) < 0.02
            break
        torch.testing.assert_close(kernel, ref, rtol=0, atol=0.02)
    else:
        assert got == want
