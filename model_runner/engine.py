"""Offline batch generation: prompts (token id lists) in, generated token ids out.

Scheduler (one forward per step): a *prefill* step whenever some prompt is not fully in the cache — running
sequences continue their prompts first, then waiting ones are admitted while a sequence id and pages for
``prompt + max_new_tokens`` are free; each gets a chunk of at most the remaining ``max_num_batched_tokens``
(chunked prefill) — otherwise a *decode* step over every running sequence (one token each). A sequence whose
prompt is complete samples a token from its last row; it finishes at ``max_new_tokens`` or ``eos_token_id``
and frees its pages at once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .cache_manager import CacheManager
from .model import Model


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_p < 1`` samples from the smallest set of tokens with that mass."""
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1; got {self}")


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
    def finished(self) -> bool:
        p = self.params
        return len(self.output) >= p.max_new_tokens or (bool(self.output) and self.output[-1] == p.eos_token_id)


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
        self.steps: list[tuple[str, int]] = []  # (kind, tokens) of every step so far

    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        if not prompt:
            raise ValueError("prompt: must hold at least one token")
        if len(prompt) + params.max_new_tokens > self.cache.max_pages * self.cache.page_size:
            raise ValueError(f"prompt: {len(prompt)} + {params.max_new_tokens} new tokens exceed the "
                             f"{self.cache.max_pages * self.cache.page_size}-token context")
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
        chunks = self._schedule_prefill()
        kind = "prefill" if chunks else "decode"
        if not chunks:
            chunks = [(seq, 1) for seq in self.running]
        if not chunks:
            raise RuntimeError("step: nothing to run (a waiting prompt needs more pages than the cache holds)")
        input_ids = [t for seq, n in chunks for t in seq.tokens[seq.cached: seq.cached + n]]
        batch = self.cache.prepare([(seq.seq_id, n) for seq, n in chunks])
        logits = self.model.forward(torch.tensor(input_ids, device=self.cache.device), batch, self.cache.layers)
        self.steps.append((kind, len(input_ids)))
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
        return finished

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: bool = True) -> list[list[int]]:
        """Generated ids for each prompt (the prompt not included), in prompt order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, params)]
        with tqdm(total=len(seqs), desc="generate", disable=not progress) as bar:
            while self.waiting or self.running:
                bar.update(len(self.step()))
        return [seq.output for seq in seqs]
