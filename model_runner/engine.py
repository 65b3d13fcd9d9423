"""Offline batch generation: prompts (token id lists) in, generated token ids out, with per-step timings.

Scheduler (one forward per step): a *prefill* step whenever some prompt is not fully in the cache — running
sequences continue their prompts first, then waiting ones are admitted while a sequence id and pages for
``prompt + max_new_tokens`` are free; each gets a chunk of at most the remaining ``max_num_batched_tokens``
(chunked prefill) — otherwise a *decode* step over every running sequence (one token each). A sequence whose
prompt is complete samples a token from its last row; it finishes at ``max_new_tokens`` ("length") or at one of
its ``stop_token_ids`` ("stop") and frees its pages at once.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .cache_manager import CacheManager
from .errors import RunnerError
from .model import Model


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_p < 1`` samples from the smallest set of tokens with that mass;
    ``stop_token_ids``: tokens that end the sequence (kept in its output), e.g. the checkpoint's EOS ids."""
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not (isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
                and self.max_new_tokens >= 1 and number(self.temperature) and self.temperature >= 0
                and number(self.top_p) and 0 < self.top_p <= 1):
            raise RunnerError(f"sampling: need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1; got "
                              f"max_new_tokens={self.max_new_tokens!r}, temperature={self.temperature!r}, "
                              f"top_p={self.top_p!r}")


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    seq_id: int | None = None  # cache row while running
    cached: int = 0  # tokens already in the cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finish_reason(self) -> str | None:
        """"stop" (a stop token), "length" (max_new_tokens) or None (running)."""
        if self.output and self.output[-1] in self.params.stop_token_ids:
            return "stop"
        return "length" if len(self.output) >= self.params.max_new_tokens else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator) -> list[int]:
    """One token per row of ``logits[B, V]`` fp32 (greedy rows by argmax, others by seeded sampling)."""
    tokens = []
    for row, p in zip(logits, params):
        if p.temperature == 0:
            tokens.append(int(row.argmax()))
            continue
        probs, order = torch.softmax(row / p.temperature, dim=-1).sort(descending=True)
        if p.top_p < 1:
            probs[(probs.cumsum(0) - probs) >= p.top_p] = 0  # keep the smallest prefix reaching top_p
        pick = torch.multinomial(probs.cpu(), 1, generator=generator)
        tokens.append(int(order[pick.to(order.device)]))
    return tokens


class Engine:
    def __init__(self, model: Model, cache: CacheManager, max_num_batched_tokens: int = 256, seed: int = 0):
        self.model, self.cache, self.token_budget = model, cache, max_num_batched_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps: list[tuple[str, int, float]] = []  # (kind, tokens, seconds) of every step so far
        self.notes: list[str] = []  # what loading the checkpoint did (set by build_engine)
        self.memory: dict[str, int] = {}  # the memory plan (set by build_engine)

    def add(self, prompt: list[int], params: SamplingParams, name: str = "prompt") -> Sequence:
        """Queue ``prompt`` (token ids in ``[0, vocab_size)``); ``name`` labels it in errors."""
        vocab = self.model.config.vocab_size
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise RunnerError(f"{name}: must hold at least one token id")
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise RunnerError(f"{name}: token {i} is {t!r}, not an id in [0, {vocab}) (the vocabulary)")
        context = self.cache.max_pages * self.cache.page_size
        if len(prompt) + params.max_new_tokens > context:
            raise RunnerError(f"{name}: {len(prompt)} tokens + {params.max_new_tokens} new tokens exceed the "
                              f"{context}-token context (raise --max-seq-len)")
        seq = Sequence(list(prompt), params)
        self.waiting.append(seq)
        return seq

    def _schedule_prefill(self) -> list[tuple[Sequence, int]]:
        budget, chunks = self.token_budget, []
        for seq in self.running:
            if seq.cached < len(seq.prompt) and budget > 0:
                n = min(len(seq.prompt) - seq.cached, budget)
                chunks.append((seq, n))
                budget -= n
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self.cache.can_allocate(len(seq.prompt) + seq.params.max_new_tokens):
                break
            self.waiting.popleft()
            seq.seq_id = self.cache.allocate(len(seq.prompt) + seq.params.max_new_tokens)
            self.running.append(seq)
            n = min(len(seq.prompt), budget)
            chunks.append((seq, n))
            budget -= n
        return chunks

    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that finished in it."""
        start = time.perf_counter()
        chunks = self._schedule_prefill()
        kind = "prefill" if chunks else "decode"
        if not chunks:
            chunks = [(seq, 1) for seq in self.running]
        if not chunks:
            raise RunnerError(f"cache: a prompt and its new tokens need more than the {self.cache.allocator.num_free} "
                              f"free pages (raise --num-pages)")
        input_ids = [t for seq, n in chunks for t in seq.tokens[seq.cached: seq.cached + n]]
        batch = self.cache.prepare([(seq.seq_id, n) for seq, n in chunks])
        logits = self.model.forward(torch.tensor(input_ids, device=self.cache.device), batch, self.cache)
        for seq, n in chunks:
            seq.cached += n
        ready = [i for i, (seq, _) in enumerate(chunks) if seq.cached == len(seq.tokens)]
        new = sample(logits[ready], [chunks[i][0].params for i in ready], self.generator) if ready else []
        finished = []
        for i, token in zip(ready, new):
            seq = chunks[i][0]
            seq.output.append(token)
            if seq.finished:
                self.cache.free(seq.seq_id)
                self.running.remove(seq)
                finished.append(seq)
        self.steps.append((kind, len(input_ids), time.perf_counter() - start))  # sampling read the logits: synced
        return finished

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], progress: bool = True,
            names: list[str] | None = None) -> list[Sequence]:
        """Every prompt to completion; the sequences in prompt order. The progress bar counts generated tokens;
        ``names`` label the prompts in errors (default "prompt {i}")."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        names = names or [f"prompt {i}" for i in range(len(prompts))]
        seqs = [self.add(p, sp, name) for p, sp, name in zip(prompts, params, names)]
        with tqdm(total=sum(sp.max_new_tokens for sp in params), desc="generate", unit="tok",
                  disable=not progress) as bar:
            while self.waiting or self.running:
                before = sum(len(s.output) for s in self.running)
                finished = self.step()
                bar.update(sum(len(s.output) for s in self.running + finished) - before)
        return seqs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: bool = True) -> list[list[int]]:
        """Generated ids for each prompt (the prompt not included), in prompt order."""
        return [seq.output for seq in self.run(prompts, params, progress)]

    def throughput(self) -> dict[str, tuple[int, float]]:
        """``{"prefill": (tokens, seconds), "decode": (tokens, seconds)}`` over the steps so far."""
        return {kind: (sum(n for k, n, _ in self.steps if k == kind), sum(s for k, _, s in self.steps if k == kind))
                for kind in ("prefill", "decode")}
