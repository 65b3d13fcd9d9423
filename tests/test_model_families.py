"""Model families: config.json's ``model_type`` picks one (an unknown one is a one-line error naming the known ones);
``make-tiny --arch`` writes a checkpoint of each that ``generate`` runs; DeepSeek-V4's random weights at full widths
cover every layer type; the cache plans (V4's window and compressed entries, V3.2's latent rows) and the window's
pages staying bounded as a sequence grows."""
import json

import pytest
import torch

from model_runner import RunnerError, SamplingParams, build_engine, load_checkpoint, read_config
from model_runner.__main__ import main
from model_runner.cache_manager import CacheManager
from model_runner.families import FAMILIES, family_of
from model_runner.families.deepseek_v4.config import CSA, HCA, SLIDING
from model_runner.memory import bytes_per_token, config_plan
from model_runner.random_weights import random_weights, reduced
from model_runner.tiny import make_tiny
from tests.threads import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIGS = "model_runner/configs"


@pytest.mark.parametrize("model_type, message", [
    ("gpt_oss", "model_type 'gpt_oss' is not implemented (known: deepseek_v32, deepseek_v4, glm_moe_dsa)"),
    (None, "model_type is missing (known: deepseek_v32, deepseek_v4, glm_moe_dsa)")])
def test_unknown_model_type(tmp_path, model_type, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type} if model_type else {}))
    with pytest.raises(RunnerError) as error:
        read_config(tmp_path / "config.json")
    assert str(error.value) == f"config: {message}"


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_make_tiny_then_generate(tmp_path, capsys, arch):
    """Each family's tiny checkpoint (its layer types all present) through the CLI, reference mode, at the family's
    default indexer precision."""
    folder = tmp_path / "tiny"
    assert main(["make-tiny", str(folder), "--arch", arch, "--shards", "2"]) == 0
    config = read_config(folder / "config.json")
    assert config.model_type == arch and family_of(config) is FAMILIES[arch]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text(json.dumps(list(range(2, 40))) + "\n" + json.dumps("Hi") + "\n")
    assert main(["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out), "--mode",
                 "reference", "--max-new-tokens", "3", "--ignore-eos", "--no-progress"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["generated_tokens"] for r in results] == [3, 3]
    indexer = FAMILIES[arch].index_precisions[0]
    assert f"indexer {indexer}" in capsys.readouterr().out


def test_v4_random_weights_cover_every_layer_type():
    """--random-weights --layers N at V4-Flash and V4-Pro widths: sliding, CSA and HCA layers from 3 layers on, the
    first hash-routed; the weights drawn are what the loader returns for a checkpoint of that config."""
    for name, hidden in (("flash", 4096), ("pro", 7168)):
        small = reduced(read_config(f"{CONFIGS}/deepseek-v4-{name}.json"), 4)
        assert small.layer_types == (SLIDING, CSA, HCA, SLIDING) and small.hidden_size == hidden
        assert small.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    tiny = reduced(FAMILIES["deepseek_v4"].tiny_config(), 3)
    drawn = random_weights(tiny, torch.float16, "cpu", seed=1)
    assert drawn["model.layers.0.ffn.gate.tid2eid"].shape == (tiny.vocab_size, tiny.num_experts_per_tok)
    assert drawn["model.layers.1.ffn.experts.gate_up_blocks"].dtype == torch.uint8


def test_v4_random_weights_are_what_the_loader_returns(tmp_path):
    config = FAMILIES["deepseek_v4"].tiny_config()
    make_tiny(tmp_path, arch="deepseek_v4")
    loaded = load_checkpoint(tmp_path, read_config(tmp_path / "config.json"), torch.float16, "cpu").weights
    drawn = random_weights(read_config(tmp_path / "config.json"), torch.float16, "cpu")
    assert {n: (t.shape, t.dtype) for n, t in drawn.items()} == {n: (t.shape, t.dtype) for n, t in loaded.items()}
    assert config.layer_types == (SLIDING, CSA, HCA, CSA)


def test_cache_plans(capsys):
    """V4-Flash in bf16: a CSA layer keeps a 128-token window of 3072 values and 640 values per 4 tokens, an HCA layer
    a window of 1536 values and 512 values per 128 tokens: 6584 B a token in all 43 layers, 6.45 GiB at 1M tokens.
    V3.2-style (tiny): no window, latent rows and FP8 indexer keys with page summaries; GLM-5's shared layers no
    indexer keys."""
    flash = config_plan(f"{CONFIGS}/deepseek-v4-flash.json", 1 << 20, 80 << 30)
    assert "  compressed_sparse_attention x 20: 768.0 KiB a sequence + 320.00 B a token, a layer" in flash[2]
    assert "  heavily_compressed_attention x 23: 384.0 KiB a sequence + 8.00 B a token, a layer" in flash[3]
    assert flash[4] == "  all layers: 6584.0 B a token + 23.62 MiB a sequence"
    assert flash[5] == "  one sequence of 1048576 tokens: 6.453 GiB"
    assert flash[6] == "  in 80.0 GiB: 13042918 tokens in one sequence, 12 sequences of 1048576 tokens"
    pro = config_plan(f"{CONFIGS}/deepseek-v4-pro.json", 1 << 20, 80 << 30)
    assert pro[4] == "  all layers: 9536.0 B a token + 33.75 MiB a sequence"
    assert main(["plan", "--model", f"{CONFIGS}/deepseek-v4-flash.json"]) == 0
    assert capsys.readouterr().out.splitlines() == flash
    for arch in ("deepseek_v32", "glm_moe_dsa"):
        config = FAMILIES[arch].tiny_config()
        cache = CacheManager(config, 4, 16, 2, 64, torch.bfloat16, "cpu")
        assert bytes_per_token(cache) == sum(cache.nbytes().values()) // (4 * 16)


def test_v4_window_pages_stay_bounded(tmp_path):
    """A 200-token sequence through a window of 8 tokens (pages of 4): the window stream holds at most the pages of
    the window and a chunk at any step, the compressed streams every entry."""
    make_tiny(tmp_path, arch="deepseek_v4", max_position_embeddings=512)
    engine = build_engine(tmp_path, mode="reference", dtype=torch.float32, device="cpu", num_pages=64, page_size=4,
                          max_seqs=1, max_seq_len=256, max_num_batched_tokens=16)
    window, held = engine.cache.streams["window"], []
    step = engine.step
    engine.step = lambda: (step(), held.append(window.allocator.num_pages - window.allocator.num_free))[0]
    seq = engine.add(list(range(2, 202)), SamplingParams(max_new_tokens=2))
    while engine.scheduler.busy:
        engine.step()
    assert len(seq.output) == 2 and max(held) <= 2 + 16 // 4 + 1 and window.allocator.num_pages < 64
