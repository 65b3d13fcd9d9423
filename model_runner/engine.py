"""Offline batch generation: prompts (token id lists) in, generated token ids out, with per-step timings.

One step: the :class:`.scheduler.Scheduler` picks decode tokens and prefill chunks under the token budget (growing
pages, preempting when the cache is full); the model runs them in one forward, replayed from a CUDA graph when the
step is all decode tokens and :mod:`.cuda_graphs` is on; every sequence whose tokens are all cached samples its next
token (:mod:`.sampling`, batched on the device); a sequence finishes at ``max_new_tokens`` ("length") or at one of
its ``stop_token_ids`` ("stop") and frees its pages at once.

One loop (:meth:`Engine.run`) serves one process and an expert-parallel group (the model's ``parallel``,
:mod:`.distributed`): in a group each rank runs its share of the prompts, and the ranks step together until none has
work left (a rank with nothing to run takes an empty step, :meth:`.model.Model.idle`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .cache_manager import CacheManager
from .distributed import Solo, share
from .errors import RunnerError
from .model import Model
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Step
from .sequence import Sequence

STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class StepRecord:
    kind: str  # one of STEP_KINDS
    prefill_tokens: int  # prompt and recompute tokens
    decode_tokens: int
    seconds: float
    graph: bool = False  # replayed from a CUDA graph

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


class Engine:
    """``graphs``: a :class:`.cuda_graphs.DecodeGraphs` for all-decode steps (None: every step eager);
    ``profiler``: a :class:`.profiling.StepProfiler` (None: no profiling)."""

    def __init__(self, model: Model, cache: CacheManager, max_num_batched_tokens: int = 256, seed: int = 0,
                 graphs=None, profiler=None):
        self.model, self.cache = model, cache
        self.scheduler = Scheduler(cache, max_num_batched_tokens)
        self.seed, self.graphs, self.profiler = seed, graphs, profiler
        self.arrivals = 0
        self.steps: list[StepRecord] = []
        self.notes: list[str] = []  # what loading the checkpoint did (set by build_engine)
        self.graphs_note = "off"  # whether decode steps replay from CUDA graphs, and why not (set by build_engine)
        self.memory: dict[str, int] = {}  # the memory plan (set by build_engine)

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

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
        whole = self.cache.capacity([s.seq_id for s in self.running])
        if len(prompt) + params.max_new_tokens > whole:
            raise RunnerError(f"{name}: {len(prompt)} tokens + {params.max_new_tokens} new tokens exceed the "
                              f"{whole} tokens of the whole cache (raise --num-pages)")
        seed = params.seed if params.seed is not None else (self.seed * 2 ** 32 + self.arrivals) % 2 ** 63
        seq = Sequence(list(prompt), params, index=self.arrivals, seed=seed)
        self.arrivals += 1
        self.scheduler.add(seq)
        return seq

    def _forward(self, step: Step) -> tuple[torch.Tensor, bool]:
        """Logits ``[chunks, vocab]`` fp32 of each chunk's last token, and whether a CUDA graph ran them."""
        chunks = [(seq.seq_id, n) for seq, n in step.chunks]
        input_ids = [t for seq, n in step.chunks for t in seq.tokens[self.scheduler.cached(seq):][:n]]
        if self.graphs is not None and self.graphs.takes(step):
            return self.graphs.forward(input_ids, [s for s, _ in chunks]), self.graphs.replays
        batch = self.cache.prepare(chunks)
        return self.model.forward(torch.tensor(input_ids, device=self.cache.device), batch, self.cache), False

    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that finished in it."""
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.chunks:
            raise RunnerError("scheduler: no token could be scheduled (cache too small for any request)")
        if self.profiler is not None and self.profiler.wants(step):
            logits, graph = self.profiler.run(step, lambda: self._forward(step), self.cache.device)
        else:
            logits, graph = self._forward(step)
        ready = [i for i, (seq, _) in enumerate(step.chunks) if self.scheduler.pending(seq) == 0]  # all cached now
        seqs = [step.chunks[i][0] for i in ready]
        new = sample(logits[ready], [s.params for s in seqs], [s.seed for s in seqs],
                     [len(s.output) for s in seqs]) if ready else []
        tokens: list[int | None] = [None] * len(step.chunks)
        for i, token in zip(ready, new):
            tokens[i] = token
        finished = self.scheduler.update(step, tokens)
        self.steps.append(StepRecord(step.kind, step.tokens - step.decode_tokens, step.decode_tokens,
                                     time.perf_counter() - start, graph))  # sampling read the tokens: synced
        return finished

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], progress: bool = True,
            names: list[str] | None = None) -> list[Sequence]:
        """Every prompt to completion; the sequences in prompt order. ``names`` label the prompts in errors (default
        "prompt {i}"). In the model's group this rank runs its :func:`.distributed.share` of the prompts and every
        rank returns all sequences; a prompt that one rank refuses is an error on every rank (agreed before the
        first step). The progress bar (rank 0) counts this rank's generated tokens."""
        group = self.model.parallel or Solo()
        params = params if isinstance(params, list) else [params] * len(prompts)
        names = names or [f"prompt {i}" for i in range(len(prompts))]
        mine = share(len(prompts), group)
        error, seqs = None, []
        try:
            seqs = [self.add(prompts[i], params[i], names[i]) for i in mine]
        except RunnerError as exc:
            error = str(exc)
        errors = [e for e in group.all_gather(error) if e]
        if errors:
            raise RunnerError(errors[0])
        desc = "generate" if group.world_size == 1 else f"generate (rank 0 of {group.world_size})"
        with tqdm(total=sum(params[i].max_new_tokens for i in mine), desc=desc, unit="tok",
                  disable=not progress or group.rank != 0) as bar:
            while group.any(self.scheduler.busy):  # a group steps together until no rank has work left
                if not self.scheduler.busy:
                    self.model.idle()
                    continue
                before = sum(len(s.output) for s in seqs)
                self.step()
                bar.update(sum(len(s.output) for s in seqs) - before)
        everything = [pair for part in group.all_gather(list(zip(mine, seqs))) for pair in part]
        return [seq for _, seq in sorted(everything, key=lambda pair: pair[0])]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: bool = True) -> list[list[int]]:
        """Generated ids for each prompt (the prompt not included), in prompt order."""
        return [seq.output for seq in self.run(prompts, params, progress)]

    def throughput(self) -> dict[str, tuple[int, float]]:
        """``{kind: (tokens, seconds)}`` over the steps so far, by step kind ("prefill" and "decode" always,
        "mixed" when such steps ran)."""
        return {kind: (sum(r.tokens for r in self.steps if r.kind == kind),
                       sum(r.seconds for r in self.steps if r.kind == kind))
                for kind in STEP_KINDS if kind != "mixed" or any(r.kind == kind for r in self.steps)}
