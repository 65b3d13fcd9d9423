"""Which tokens run in the next step: decode tokens and prefill chunks together under one token budget.

Every step (at most ``token_budget`` tokens):

1. one token for each decoding sequence, oldest first; a sequence that needs a page while none is free gets one by
   *preemption*: the newest running sequence not yet in the step (possibly itself) frees its pages and goes back to
   the waiting queue, to be recomputed from its tokens (prompt and output so far) when it is admitted again;
2. a chunk for each running sequence still in its prompt (or recomputing), oldest first, as long as the budget and
   its pages allow (a chunk shrinks to the free pages; with none free it waits, or preempts as in 1 when the step
   would otherwise be empty);
3. when nothing was preempted in this step: new sequences from the waiting queue, first come first served (the head
   blocks the rest), each with the chunk that fits the budget and the free pages, less one page for each running
   sequence whose tokens will fill its pages exactly (its next token needs a new page: admitting does not
   preempt at the next step).

So decoding never waits for a long prompt, and pages are taken as sequences grow. No step is empty while a request
is pending: the oldest decoding sequence, or else the oldest running one, can always go on by preempting newer ones
(the engine rejects a request the whole cache cannot hold), and a decoding sequence finishes within its
``max_new_tokens``, so every request completes. A preempted sequence loses no token: its output is kept and its
next sample uses the same random stream position (:mod:`.sampling`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache_manager import CacheManager
from .sequence import Sequence


@dataclass
class Step:
    """One step's work: ``chunks`` ``(sequence, tokens)``, decode tokens first; ``preempted`` in this step."""
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    decode_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def kind(self) -> str:
        """"decode" (only decode tokens), "prefill" (only prompt or recompute chunks) or "mixed"."""
        if self.decode_tokens == self.tokens:
            return "decode"
        return "prefill" if self.decode_tokens == 0 else "mixed"


class Scheduler:
    def __init__(self, cache: CacheManager, token_budget: int):
        if token_budget < 1:
            raise ValueError(f"token_budget: must be at least 1, got {token_budget}")
        self.cache, self.token_budget = cache, token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cached(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose rows are in the cache: its row's length in the cache manager, which advances it
        as a forward places tokens (0 while it has no row: waiting, preempted or finished)."""
        return 0 if seq.seq_id is None else self.cache.length(seq.seq_id)

    def pending(self, seq: Sequence) -> int:
        """Tokens to run before its next sample: the prompt (or, after a preemption, everything) not yet cached."""
        return len(seq.prompt) + len(seq.output) - self.cached(seq)

    def decoding(self, seq: Sequence) -> bool:
        """A running sequence whose only uncached token is its last sample: its next step is a decode token."""
        return seq.seq_id is not None and bool(seq.output) and self.pending(seq) == 1

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        step, scheduled = Step(), {}
        budget = self.token_budget
        for seq in list(self.running):  # 1. decode tokens
            if budget == 0:
                break
            if self.decoding(seq) and self._make_room(seq, self.cached(seq) + 1, scheduled, step):
                self._take(step, scheduled, seq, 1)
                budget -= 1
        step.decode_tokens = len(step.chunks)
        for seq in list(self.running):  # 2. prompt and recompute chunks of running sequences
            if budget == 0:
                break
            if seq in scheduled or seq.seq_id is None:
                continue
            cached = self.cached(seq)
            if self.cache.room(seq.seq_id) <= cached:
                if step.chunks:  # others go on: wait for their pages rather than preempt
                    continue
                if not self._make_room(seq, cached + 1, scheduled, step):
                    continue
            n = min(self.pending(seq), budget, self.cache.room(seq.seq_id) - cached)
            self._take(step, scheduled, seq, n)
            budget -= n
        while self.waiting and budget > 0 and not step.preempted:  # 3. admissions, first come first served
            seq = self.waiting[0]
            growing = [(s.seq_id, self.cached(s) + scheduled.get(s, 0)) for s in self.running]
            n = min(self.pending(seq), budget, self.cache.room(reserve=growing))
            if n <= 0:
                break
            self.waiting.popleft()
            seq.seq_id = self.cache.allocate(0)
            self.running.append(seq)
            self._take(step, scheduled, seq, n)
            budget -= n
        return step

    def _take(self, step: Step, scheduled: dict, seq: Sequence, n: int) -> None:
        self.cache.grow(seq.seq_id, self.cached(seq) + n)
        step.chunks.append((seq, n))
        scheduled[seq] = n

    def _make_room(self, seq: Sequence, n_tokens: int, scheduled: dict, step: Step) -> bool:
        """Preempt the newest running sequences not in this step until ``seq`` can hold ``n_tokens``; False when
        ``seq`` itself had to go."""
        while self.cache.room(seq.seq_id) < n_tokens:
            victim = next(s for s in reversed(self.running) if s not in scheduled)  # seq itself at the latest
            self.preempt(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and queue it again, in arrival order, to be recomputed (its output is kept)."""
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.seq_id = None
        seq.preemptions += 1
        self.preemptions += 1
        position = next((i for i, s in enumerate(self.waiting) if s.index > seq.index), len(self.waiting))
        self.waiting.insert(position, seq)

    def update(self, step: Step, tokens: list[int | None]) -> list[Sequence]:
        """After the step's forward (which placed each chunk's tokens in the cache): ``tokens[i]`` is the token
        sampled for chunk ``i`` (None where the sequence is still in its prompt). Returns the sequences that
        finished; their pages are free."""
        finished = []
        for (seq, _), token in zip(step.chunks, tokens):
            if token is None:
                continue
            seq.output.append(token)
            if seq.finished:
                self.cache.free(seq.seq_id)
                seq.seq_id = None
                self.running.remove(seq)
                finished.append(seq)
        return finished
