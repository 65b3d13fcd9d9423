"""Sampling settings and batched sampling on the logits' device (one pass over ``[B, V]``, no per-row loop).

Per row: greedy (``temperature`` 0: argmax), or softmax of ``logits / temperature`` cut to the ``top_k`` most likely
tokens and then to the smallest set reaching ``top_p`` of the mass, drawn by the exponential race
``argmax(p / E)`` with ``E ~ Exp(1)`` (the same distribution as a multinomial draw, and no host round trip).

Random numbers are counter-based: the ``E`` of row ``b`` and vocabulary entry ``v`` is a hash of the row's
``seed``, its ``counter`` (the engine passes the request's output position) and ``v``. So a request draws the same
tokens whatever else is in the batch, however its steps are padded, and after a preemption recomputes it: its
n-th token depends only on its seed, n and its logits. The hash is integer arithmetic (exact on every device).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import RunnerError

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` > 0 keeps the ``top_k`` most likely tokens (0: all); ``top_p < 1``
    samples from the smallest set of tokens with that mass; ``stop_token_ids``: tokens that end the sequence (kept
    in its output), e.g. the checkpoint's EOS ids; ``seed``: the request's random stream (None: derived from the
    engine's seed and the request's arrival index)."""
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not (integer(self.max_new_tokens) and self.max_new_tokens >= 1 and number(self.temperature)
                and self.temperature >= 0 and number(self.top_p) and 0 < self.top_p <= 1
                and integer(self.top_k) and self.top_k >= 0
                and (self.seed is None or integer(self.seed) and 0 <= self.seed < 2 ** 63)):
            raise RunnerError(f"sampling: need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1, top_k >= 0 "
                              f"and a seed in [0, 2^63) or none; got max_new_tokens={self.max_new_tokens!r}, "
                              f"temperature={self.temperature!r}, top_p={self.top_p!r}, top_k={self.top_k!r}, "
                              f"seed={self.seed!r}")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)``, in two 16-bit halves of ``c`` (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of int64 ``x`` in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """``E[b, v] ~ Exp(1)`` fp32 ``[B, vocab]``, a function of ``(seeds[b], counters[b], v)`` only (int64 inputs)."""
    row = mix32(mix32(seeds & MASK32) ^ ((seeds >> 32) & MASK32))
    row = mix32(row ^ (counters & MASK32))
    column = mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64))
    bits = mix32(row[:, None] ^ column[None, :]) >> 8  # 24 random bits
    uniform = (bits.float() + 0.5) * 2.0 ** -24  # in (0, 1), exact in fp32
    return -torch.log(uniform)


def sample_tensors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   seeds: torch.Tensor, counters: torch.Tensor, *, any_random: bool = True,
                   any_cut: bool = True) -> torch.Tensor:
    """One token id per row of ``logits[B, V]`` (float), int64 ``[B]``, all on the logits' device.

    ``temperature[B]`` fp32 (0: greedy), ``top_k[B]`` int64 (0: no cut), ``top_p[B]`` fp32, ``seeds[B]`` and
    ``counters[B]`` int64. ``any_random`` / ``any_cut``: whether some row samples / uses top-k or top-p (the caller
    knows; False skips that work)."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if not any_random:
        return greedy_tokens
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    noise = exponential_noise(seeds, counters, logits.shape[1])
    if any_cut:
        values, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=logits.device)
        k = torch.where(top_k > 0, top_k, logits.shape[1])
        values = values.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        probs = values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above
        probs = probs.masked_fill((before >= top_p[:, None]) & (rank[None, :] > 0), 0.0)
        pick = (probs / noise.gather(1, order)).argmax(dim=-1, keepdim=True)
        drawn = order.gather(1, pick)[:, 0]
    else:
        drawn = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, drawn)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int]) -> list[int]:
    """One token per row of ``logits[B, V]`` for the rows' ``params``, random streams ``seeds`` and draw
    ``counters``: the settings go to the device in one copy, the tokens come back in one."""
    device = logits.device
    settings = torch.tensor([[p.temperature, p.top_p] for p in params], dtype=torch.float32).to(device)
    ints = torch.tensor([[p.top_k, s, c] for p, s, c in zip(params, seeds, counters)], dtype=torch.int64).to(device)
    random = [p.temperature > 0 for p in params]
    cut = any(r and (p.top_k > 0 or p.top_p < 1) for r, p in zip(random, params))
    return sample_tensors(logits, settings[:, 0], ints[:, 0], settings[:, 1], ints[:, 1], ints[:, 2],
                          any_random=any(random), any_cut=cut).tolist()
