"""Poisoned allocations for tests of ops that allocate their own outputs.

Inside ``with poisoned_allocations():`` every ``torch.empty`` / ``torch.empty_like`` comes back filled
with NaN (floating dtypes, float8 included) or -2 (integer dtypes; 0xFE for uint8), so an element a
kernel forgot to write shows up in the comparison with the reference.
"""
from __future__ import annotations

import contextlib

import torch


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with NaN (floating) or -2 (integer, wrapping for unsigned) and return it."""
    if t.dtype.is_floating_point:
        if t.element_size() == 1:  # float8: fill the bytes (0x7F is NaN in e4m3fn and in e5m2)
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.view(torch.uint8).fill_(0xFE) if t.dtype == torch.uint8 else t.fill_(-2)
    return t


@contextlib.contextmanager
def poisoned_allocations():
    """Patch ``torch.empty`` and ``torch.empty_like`` to return poisoned tensors until the block exits."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: poison_(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison_(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def check_registry_entry(name: str, phase: str, seed: int, scale: float = 1.01) -> None:
    """The registered kernel ``name`` at each of its CPU bench shapes of ``phase``: its default config on poisoned
    allocations equals the reference by the spec's own comparison, which fails for the output times ``scale``."""
    from dsa_triton import registry

    spec = registry.get(name)
    for shape in spec.bench_shapes(phase, False):
        inputs = spec.make_inputs(phase, shape, torch.device("cpu"), seed)
        with poisoned_allocations():
            out = spec.run(inputs, spec.default(phase, shape))
        ref = spec.reference(inputs)
        assert spec.compare(out, ref) is None
        assert spec.compare(out * scale, ref) is not None
