"""Host-side launch plans: what an op's checks found and its launch needs, kept by a key of everything they read.

One pattern for every op: a :class:`PlanCache` per op (or per launch builder, :func:`cached`) holds plans by a key of
what they were worked out from, and starts over when the registry's launch configs may have changed
(:func:`~dsa_triton.registry.generation`) or when full.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import registry


def tensor_key(*tensors: torch.Tensor | None) -> tuple:
    """What the host-side checks look at in each tensor: ``(dtype, shape, strides, device)``, ``None`` for
    ``None``. Raises ``AttributeError`` for other objects."""
    return tuple([None if t is None else (t.dtype, t.shape, t.stride(), t.device) for t in tensors])


def exact_ints(*values) -> bool:
    """True when each value is ``None`` or an ``int`` proper: a plan key may hold only those (``4.0`` and
    ``True`` hash and compare like ``4`` and ``1``, so they would hit a plan without being checked)."""
    return all(v is None or type(v) is int for v in values)


class PlanCache:
    """An op's launch plans (checked metadata, configs, grids) by a key that covers everything its
    host-side checks read: :func:`tensor_key` of its tensors, its integer sizes and its config. A hit
    skips the checks, a miss runs them. Emptied when the registry's config lookup changes and when full."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._plans: dict = {}
        self._generation = -1

    def find(self, tensors: tuple, ints: tuple = (), config: dict | None = None) -> tuple:
        """``(key, plan or None)``; the key is None when the arguments cannot key a plan (an object that
        is not a tensor, a size that is not an ``int``, an unhashable config): the checks then name them."""
        if not exact_ints(*ints):
            return None, None
        try:
            key = (tensor_key(*tensors), ints, None if config is None else tuple((k, type(v), v) for k, v in config.items()))
            return key, self.get(key)
        except (AttributeError, TypeError):
            return None, None

    def get(self, key):
        """The plan kept under ``key``, or None."""
        generation = registry.generation()
        if self._generation != generation:
            self._plans.clear()
            self._generation = generation
        return self._plans.get(key)

    def put(self, key, plan):
        """Keep ``plan`` under ``key`` (unless None) and return it."""
        if key is not None:
            if len(self._plans) >= self.size:
                self._plans.clear()
            self._plans[key] = plan
        return plan


def cached(build: Callable[..., dict]) -> Callable[..., dict]:
    """``build`` (a launch's keyword arguments made from its arguments alone: ints, bools, strings, None or dtypes;
    not floats, which ``0.0 == -0.0`` would confuse) with its results kept in a :class:`PlanCache`: equal arguments
    of equal types (``True`` and ``1`` apart) get the one dict, which no one may modify."""
    plans = PlanCache()

    def plan(*args) -> dict:
        key = tuple((type(a), a) for a in args)
        found = plans.get(key)
        return found if found is not None else plans.put(key, build(*args))

    plan.__doc__ = build.__doc__
    return plan
