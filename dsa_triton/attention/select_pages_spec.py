"""Registry entry of :func:`~dsa_triton.select_pages`, the page selection of the block-level indexer path.

Shapes: ``T`` rows, ``pages`` bounds per row, ``SEL`` pages selected.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..registry import Cost, KernelSpec
from . import select_pages, select_pages_reference
from .select_pages_reference import select_pages_torch


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    """Random bounds with a ``-inf`` tail of random length per row (pages past the row's limit); one
    row without any valid page."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, N = shape["T"], shape["pages"]
    bounds = torch.randn(T, N, generator=g, device=device)
    valid = torch.randint(0, N + 1, (T, 1), generator=g, device=device)
    valid[0] = N
    valid[-1] = 0
    bounds.masked_fill_(torch.arange(N, device=device) >= valid, float("-inf"))
    return {"bounds": bounds, "n_select": shape["SEL"]}


def _compare(out, ref) -> str | None:
    """Same -1 places, ascending pages, the same bound values taken, and the same pages (ties: the lower pages)."""
    pages, bounds = out
    ref_pages, _ = ref
    if pages.shape != ref_pages.shape:
        return f"shape {tuple(pages.shape)} != reference {tuple(ref_pages.shape)}"
    if bool((pages < -1).any()):
        return f"{int((pages < -1).sum())} entries below -1 (never written)"
    if not torch.equal(pages < 0, ref_pages < 0):
        return f"{int(((pages < 0) != (ref_pages < 0)).sum())} places differ in being -1"
    later = pages[:, 1:]
    if bool(((later <= pages[:, :-1]) & (later >= 0)).any()):
        return "pages not strictly ascending"
    if bounds.shape[1] == 0:  # nothing to take (and every entry is -1, as the reference's)
        return None
    values = lambda p: bounds.gather(1, p.clamp_min(0).long()).where(p >= 0, 0.0).sort(1).values  # noqa: E731
    if not torch.equal(values(pages), values(ref_pages)):
        return "the pages taken have other bounds"
    return None if torch.equal(pages, ref_pages) else "other pages of equal bounds taken (ties: the lower pages)"


SPEC = registry.register(KernelSpec(
    launch=select_pages.LAUNCH,
    make_inputs=_make_inputs,
    run=lambda inputs, config: (select_pages.select_pages(inputs["bounds"], inputs["n_select"], config=config),
                                inputs["bounds"]),
    reference=lambda inputs: (select_pages_torch(inputs["bounds"], inputs["n_select"]), inputs["bounds"]),
    compare=_compare,
    cost=lambda phase, shape: Cost(bytes=shape["T"] * (shape["pages"] + shape["SEL"]) * 4),
    bench_shapes=lambda phase, gpu: ([{"T": 64, "pages": 2048, "SEL": 64}, {"T": 128, "pages": 2048, "SEL": 256}] if gpu
                                     else [{"T": 5, "pages": 300, "SEL": 7}]),
    baseline=lambda inputs: select_pages_torch(inputs["bounds"], inputs["n_select"]),
    baseline_name="torch.topk + sort + -1 padding",
    model_dims=lambda m: [{}],
    count_roles={"T": "tokens", "pages": "pages"},
    source_modules=(select_pages_reference, select_pages, sys.modules[__name__]),
))
