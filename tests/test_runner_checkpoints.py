"""Checkpoints the way a user meets them: an FP8 block-scaled checkpoint against its dequantized bf16 twin, every
way a checkpoint, config or prompt can be wrong (one-line errors naming it), and the CLI (``generate``,
``make-tiny``) end to end on tiny random checkpoints (CPU, Triton interpreter)."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsa_triton.linear.formats import dequantize_fp8_blockwise
from model_runner import (ModelConfig, RopeConfig, RunnerError, SamplingParams, build_engine, load_checkpoint,
                          save_random_checkpoint, tiny_config)
from model_runner.__main__ import main
from model_runner.ops import FP8Weight

PROMPTS = [list(range(1, 14)), [5, 4, 3]]  # 13 tokens: the indexer (top-k 8) drops some


def fp8_twin(folder, twin):
    """``twin``: ``folder``'s checkpoint with every FP8 tensor dequantized to bf16 (exact: power-of-two scales)."""
    tensors = load_file(folder / "model.safetensors")
    dense = {}
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            values = dequantize_fp8_blockwise(t, tensors[name + "_scale_inv"])
            dense[name] = values.bfloat16()
            assert torch.equal(dense[name].float(), values)
        elif not name.endswith("_scale_inv"):
            dense[name] = t
    twin.mkdir()
    save_file(dense, str(twin / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (twin / "config.json").write_text(json.dumps(config))


def test_fp8_checkpoint_equals_dequantized_twin(tmp_path):
    """Kernel mode: FP8 projections through dt.fp8_blockwise_linear (hidden 160: two scale blocks, neither full),
    FP8 experts converted to MXFP4 at load; the bf16 twin through F.linear and bf16 experts. Same tokens."""
    fp8, twin = tmp_path / "fp8", tmp_path / "twin"
    save_random_checkpoint(tiny_config(hidden_size=160, num_hidden_layers=2), fp8, experts="fp8", dense="fp8", seed=3)
    fp8_twin(fp8, twin)
    kwargs = dict(mode="kernel", dtype=torch.float16, device="cpu", num_pages=8, max_seqs=2, max_seq_len=32,
                  max_num_batched_tokens=32, poison=True)
    engines = [build_engine(folder, **kwargs) for folder in (fp8, twin)]
    assert engines[0].notes == ["dense weights: 18 FP8 projections kept in FP8 (blockwise-FP8 GEMM), 2 FP8 tensors "
                                "dequantized to float16 at load",
                                "experts: fp8 -> MXFP4 at load in 1 layers; 2880 of 2880 32-element blocks lossy "
                                "(100.00%)"]
    assert isinstance(engines[0].model.layers[0][1].q_a, FP8Weight)
    params = SamplingParams(max_new_tokens=3)
    assert engines[0].generate(PROMPTS, params, progress=False) == engines[1].generate(PROMPTS, params, progress=False)
    config = ModelConfig.from_json(fp8 / "config.json")
    dequantized = load_checkpoint(fp8, config, torch.float16, "cpu", dequantize_fp8=True).weights
    twin_weights = load_checkpoint(twin, config, torch.float16, "cpu").weights
    assert all(torch.equal(dequantized[n], twin_weights[n]) for n in twin_weights)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    save_random_checkpoint(tiny_config(), folder, experts="mxfp4", dense="fp8", seed=4)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def edit_tensors(folder, drop=(), **add):
    tensors = load_file(folder / "model.safetensors")
    for name in drop:
        del tensors[name]
    save_file({**tensors, **{k.replace("__", "."): v for k, v in add.items()}}, str(folder / "model.safetensors"))


Q_A = "model.layers.0.self_attn.q_a_proj.weight"
BAD = {  # case -> (edit of a copy of the FP8 checkpoint, the error it gives)
    "fp8 weights, no quantization_config": (
        lambda f: edit_config(f, quantization_config=None),
        f"tensor {Q_A} is float8_e4m3fn but config.json has no quantization_config"),
    "fp8 weight without its scales": (
        lambda f: edit_tensors(f, drop=[Q_A + "_scale_inv"]), f"FP8 tensor {Q_A} has no {Q_A}_scale_inv"),
    "unknown quantization method": (
        lambda f: edit_config(f, quantization_config={"quant_method": "awq"}), "quant_method 'awq' is not implemented"),
    "other fp8 block size": (
        lambda f: edit_config(f, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}),
        r"weight_block_size = \[64, 64\] is not implemented"),
    "unknown config key": (lambda f: edit_config(f, sliding_window=4096), "key 'sliding_window' is not implemented"),
    "unknown rope type": (
        lambda f: edit_config(f, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
        "rope type 'llama3' is not implemented"),
    "unknown rope parameter": (
        lambda f: edit_config(f, rope_parameters=None, rope_scaling={"type": "yarn", "factor": 4, "low_freq_factor": 1}),
        "rope parameter 'low_freq_factor' is not implemented"),
    "two rope forms": (
        lambda f: edit_config(f, rope_scaling={"type": "yarn", "factor": 4}), "both rope_parameters and rope_scaling"),
    "other activation": (lambda f: edit_config(f, hidden_act="gelu"), 'hidden_act = "gelu" is not implemented'),
    "unknown tensor": (
        lambda f: edit_tensors(f, model__layers__0__self_attn__q_norm__weight=torch.ones(4)),
        "tensor model.layers.0.self_attn.q_norm.weight is not implemented by the runner"),
    "missing tensor": (lambda f: edit_tensors(f, drop=["model.norm.weight"]), "tensor model.norm.weight is missing"),
    "no weights file": (lambda f: (f / "model.safetensors").unlink(), "holds neither model.safetensors nor"),
    "MTP layer without num_nextn_predict_layers": (
        lambda f: edit_tensors(f, model__layers__3__eh_proj__weight=torch.ones(2, 2)),
        "tensor model.layers.3.eh_proj.weight is not implemented"),
}


def load(folder):
    return load_checkpoint(folder, ModelConfig.from_json(folder / "config.json"), torch.float32, "cpu")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_give_one_line_errors(fp8_checkpoint, tmp_path, case):
    edit, message = BAD[case]
    folder = shutil.copytree(fp8_checkpoint, tmp_path / "ckpt")
    edit(folder)
    with pytest.raises(RunnerError, match=message) as error:
        load(folder)
    assert "\n" not in str(error.value)


def test_mtp_layers_are_skipped_with_a_note(fp8_checkpoint, tmp_path):
    folder = shutil.copytree(fp8_checkpoint, tmp_path / "ckpt")
    edit_config(folder, num_nextn_predict_layers=1)
    edit_tensors(folder, model__layers__3__eh_proj__weight=torch.ones(2, 2),
                 model__layers__3__enorm__weight=torch.ones(2))
    assert load(folder).notes[-1] == ("multi-token-prediction layers 3..3 (num_nextn_predict_layers = 1): 2 tensors "
                                      "skipped (not used for generation)")


def test_tied_embeddings(fp8_checkpoint, tmp_path):
    folder = shutil.copytree(fp8_checkpoint, tmp_path / "ckpt")
    edit_config(folder, tie_word_embeddings=True)
    edit_tensors(folder, drop=["lm_head.weight"])
    weights = load(folder).weights
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_rope_round_trip():
    rope = RopeConfig(5e5, "yarn", factor=8, original_max_position_embeddings=64, mscale=0.5, truncate=False)
    config = tiny_config(rope=rope)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_prompt_token_ids_are_checked(fp8_checkpoint):
    engine = build_engine(fp8_checkpoint, mode="reference", dtype=torch.float32, device="cpu", num_pages=4,
                          max_seqs=1, max_seq_len=32)
    for prompt, message in (([1, 128], r"prompt: token 1 is 128, not an id in \[0, 128\)"),
                            ([-2], r"prompt: token 0 is -2, not an id"), ([1.0], r"token 0 is 1.0"),
                            ([], "at least one token id"), ([1] * 30, r"30 tokens \+ 4 new tokens exceed")):
        with pytest.raises(RunnerError, match=message):
            engine.add(prompt, SamplingParams(max_new_tokens=4))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    assert main(["make-tiny", str(folder), "--shards", "2"]) == 0
    return folder


def run_cli(tiny, tmp_path, lines, *extra):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code = main(["generate", "--model", str(tiny), "--prompts", str(prompts), "--out", str(out), "--mode", "reference",
                 "--max-new-tokens", "4", "--no-progress", *extra])
    return code, [json.loads(line) for line in out.read_text().splitlines()] if code == 0 else None


def test_cli_generate(tiny, tmp_path, capsys):
    """Token ids, text and per-request settings in; ids, text, finish reasons and counts out; the memory plan
    before and the throughput after; generation stops at the checkpoint's EOS (generation_config.json)."""
    lines = [[5, 6, 7], "Hello", {"prompt": "Hi", "max_new_tokens": 2, "temperature": 0.5, "top_p": 0.9}]
    code, results = run_cli(tiny, tmp_path, lines, "--ignore-eos")
    assert code == 0
    stdout = capsys.readouterr().out
    assert "memory plan:" in stdout and "kv cache" in stdout and "indexer cache" in stdout
    assert "prefill: 12 tokens in" in stdout and "decode: 7 tokens in" in stdout and "tokens/s" in stdout
    assert [(r["prompt_tokens"], r["generated_tokens"], r["finish_reason"]) for r in results] == [
        (3, 4, "length"), (6, 4, "length"), (3, 2, "length")]  # text: BOS + one byte per character
    assert all(isinstance(r["text"], str) and len(r["token_ids"]) == r["generated_tokens"] for r in results)
    first = results[0]["token_ids"]
    (tiny / "generation_config.json").write_text(json.dumps({"eos_token_id": [first[1]]}))
    code, stopped = run_cli(tiny, tmp_path, lines[:1])
    assert stopped[0]["token_ids"] == first[:first.index(first[1]) + 1] and stopped[0]["finish_reason"] == "stop"


@pytest.mark.parametrize("lines, extra, message", [
    (["[1, 2"], (), "line 1: not JSON"),
    ([{"prompt": "a", "n": 2}], (), "line 1: unknown key 'n'"),
    ([{"prompt": "a", "prompt_token_ids": [1]}], (), "line 1: give exactly one of prompt"),
    ([[1, 999]], (), r"line 1: token 1 is 999, not an id in \[0, 258\)"),
    ([[1, -2]], (), r"line 1: token 1 is -2"),
    ([{"prompt_token_ids": [1], "top_p": 0}], (), "line 1: sampling: need"),
    ([[1]], ("--mode", "kernel", "--dtype", "float32"), "dtype: kernel mode runs in bfloat16 or float16"),
    ([[1]], ("--mode", "kernel", "--dtype", "bfloat16"), "bfloat16 kernels give wrong results in the Triton interp"),
    ([[1]], ("--index-precision", "activation", "--page-size", "20"), "page_size: must be one of"),
])
def test_cli_errors_are_one_line(tiny, tmp_path, capsys, lines, extra, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    code = main(["generate", "--model", str(tiny), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--mode", "reference", "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("error: ")
    assert re.search(message, err), err


def test_cli_errors_without_tokenizer_or_checkpoint(tiny, tmp_path, capsys):
    bare = shutil.copytree(tiny, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"text"\n')
    for model, message in ((bare, "a text prompt needs the checkpoint's tokenizer.json"),
                           (tmp_path / "nowhere", "nowhere is not a checkpoint folder")):
        code = main(["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and message in err, err
