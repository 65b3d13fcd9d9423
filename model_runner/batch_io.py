"""The CLI's files: prompts in (JSON lines), results out (JSON lines).

A prompt line is a JSON list of token ids, a JSON string (text), or an object with ``prompt`` (text) or
``prompt_token_ids`` (ids) and optional sampling settings ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop_token_ids`` (default: the command line's, and the checkpoint's EOS ids). Text needs the checkpoint's
tokenizer. A result line: ``index``, ``prompt_tokens``, ``generated_tokens``, ``finish_reason`` ("stop" or
"length"), ``token_ids`` (generated) and, with a tokenizer, ``text`` (generated, special tokens left out).
:func:`fit_requests` checks the prompts against the model's config before the model loads.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .errors import RunnerError
from .sampling import SamplingParams
from .sequence import Sequence

SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids")
TRUNCATE = ("left",)  # what --truncate drops from a prompt too long for the model: its first tokens


@dataclasses.dataclass
class Request:
    name: str  # "FILE line N", for errors
    token_ids: list[int]
    params: SamplingParams


def read_requests(path: str | Path, defaults: SamplingParams, tokenizer) -> list[Request]:
    """Parse every non-blank line of ``path``; the first bad one is an error naming its line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise RunnerError(f"prompts: cannot read {path} ({exc.strerror})") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_request(f"{path} line {number}", line, defaults, tokenizer))
    if not requests:
        raise RunnerError(f"prompts: {path} holds no prompt")
    return requests


def _request(name: str, line: str, defaults: SamplingParams, tokenizer) -> Request:
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise RunnerError(f"{name}: not JSON ({exc})") from None
    if not isinstance(item, dict):
        item = {"prompt_token_ids" if isinstance(item, list) else "prompt": item}
    unknown = sorted(set(item) - {"prompt", "prompt_token_ids", *SETTINGS})
    if unknown:
        raise RunnerError(f"{name}: unknown key {unknown[0]!r} (prompt, prompt_token_ids, {', '.join(SETTINGS)})")
    if ("prompt" in item) == ("prompt_token_ids" in item):
        raise RunnerError(f"{name}: give exactly one of prompt (text) and prompt_token_ids")
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise RunnerError(f"{name}: prompt must be a string (text), got {type(item['prompt']).__name__}")
        if tokenizer is None:
            raise RunnerError(f"{name}: a text prompt needs the checkpoint's tokenizer.json (or give token ids)")
        ids = tokenizer.encode(item["prompt"]).ids
    else:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list):
            raise RunnerError(f"{name}: prompt_token_ids must be a list of token ids")
    settings = {k: item[k] for k in SETTINGS if k in item}
    if "stop_token_ids" in settings:
        stop = settings["stop_token_ids"]
        if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
            raise RunnerError(f"{name}: stop_token_ids must be a list of token ids")
        settings["stop_token_ids"] = tuple(stop)
    try:
        params = dataclasses.replace(defaults, **settings)
    except RunnerError as exc:
        raise RunnerError(f"{name}: {exc}") from None
    return Request(name, ids, params)


def fit_requests(requests: list[Request], vocab_size: int, max_positions: int | None,
                 truncate: str | None = None) -> int:
    """Check each request against the model's ``vocab_size`` and ``max_positions`` (max_position_embeddings; None:
    no limit): every token id in the vocabulary, the prompt and its new tokens within the positions, else an error
    naming the request. ``truncate="left"``: a prompt too long keeps its last tokens instead (the request changes in
    place); returns how many prompts were truncated."""
    if truncate not in (None, *TRUNCATE):
        raise RunnerError(f"truncate: must be one of {TRUNCATE} or none, got {truncate!r}")
    truncated = 0
    for r in requests:
        if not r.token_ids:
            raise RunnerError(f"{r.name}: must hold at least one token id")
        for i, t in enumerate(r.token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise RunnerError(f"{r.name}: token {i} is {t!r}, not an id in [0, {vocab_size}) (the vocabulary)")
        new = r.params.max_new_tokens
        if max_positions is None or len(r.token_ids) + new <= max_positions:
            continue
        room = max_positions - new
        if room < 1:
            raise RunnerError(f"{r.name}: {new} new tokens leave no room for the prompt within "
                              f"max_position_embeddings {max_positions} of the model")
        if truncate is None:
            raise RunnerError(f"{r.name}: {len(r.token_ids)} tokens + {new} new tokens exceed max_position_embeddings "
                              f"{max_positions} of the model (--truncate left keeps the last {room})")
        r.token_ids = r.token_ids[-room:]
        truncated += 1
    return truncated


def write_results(path: str | Path, seqs: list[Sequence], tokenizer) -> None:
    with open(path, "w") as f:
        for i, seq in enumerate(seqs):
            record = {"index": i, "prompt_tokens": len(seq.prompt), "generated_tokens": len(seq.output),
                      "finish_reason": seq.finish_reason, "token_ids": seq.output}
            if tokenizer is not None:
                record["text"] = tokenizer.decode(seq.output, skip_special_tokens=True)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
