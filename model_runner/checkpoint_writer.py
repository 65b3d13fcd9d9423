"""Writing checkpoints in the Hugging Face layout (tests, ``make-tiny``): config.json, the weights in one
``model.safetensors`` or shards with ``model.safetensors.index.json``, a byte-level tokenizer and
generation_config.json."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .loader import INDEX_FILE, SINGLE_FILE

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOKENIZER_VOCAB = 258  # BOS, EOS and the 256 bytes


def save_checkpoint(tensors: dict[str, torch.Tensor], config, folder: str | Path, shards: int = 1) -> None:
    """Write ``config.json`` (``config.to_dict()``) and the tensors: one ``model.safetensors``, or ``shards`` files
    and their index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    if shards == 1:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / SINGLE_FILE))
        return
    names, weight_map = list(tensors), {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1))


def write_tokenizer(folder: str | Path) -> None:
    """A byte-level BPE ``tokenizer.json`` without merges: ids 0 (BOS) and 1 (EOS), then the 256 bytes; encoding
    prepends BOS; and generation_config.json (BOS 0, EOS 1, greedy)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {BOS: 0, EOS: 1, **{ch: i + 2 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tokenizer.save(str(Path(folder) / "tokenizer.json"))
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (Path(folder) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
