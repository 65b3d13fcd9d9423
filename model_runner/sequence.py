"""One request's state: its tokens, its cache row and its sampling stream. How many of its tokens are in the cache is
the cache manager's count of that row (:meth:`.scheduler.Scheduler.cached` asks it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass(eq=False)  # compared and hashed by identity: the scheduler keeps sets and lists of them
class Sequence:
    prompt: list[int]
    params: SamplingParams
    index: int = 0  # arrival order (FIFO)
    seed: int = 0  # its random stream (:mod:`.sampling`)
    output: list[int] = field(default_factory=list)
    seq_id: int | None = None  # cache row while running
    preemptions: int = 0  # times its pages were freed to be recomputed

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
