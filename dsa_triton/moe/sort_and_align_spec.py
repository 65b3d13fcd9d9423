"""Registry entry ``sort_and_align``: :func:`.sort_and_align.sort_and_align` (one launch) against the torch functions
:func:`.permute.sort_by_expert` + :func:`.permute.align_blocks` (its reference and its baseline), bit for bit.

Config space: ``num_warps``. Shape: ``T`` (bucketed), ``E``, ``top_k``, ``block_m`` (0: no alignment).
"""
from __future__ import annotations

import sys
from importlib import import_module

import torch

from .. import registry
from ..checks import exact_mismatch
from ..registry import Cost, KernelSpec
from . import sort_and_align_kernels
from .permute import ExpertSort, max_padded_rows, sort_by_expert

op = import_module(".sort_and_align", __package__)  # the module: the package exports its function by that name


def random_routing(tokens: int, experts: int, top_k: int, device: torch.device, gen: torch.Generator):
    """``(weights [T, top_k] fp32, ids [T, top_k] int32)``: top_k distinct experts per token, uniformly."""
    ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=1).indices.to(torch.int32)
    return torch.rand(tokens, top_k, generator=gen, device=device).softmax(dim=1), ids


def permutation_tensors(sort: ExpertSort, block_m: int) -> dict[str, torch.Tensor]:
    """Every output tensor of a sort and, for ``block_m`` > 0, of its alignment, by name."""
    tensors = {name: getattr(sort, name) for name in ("expert_offsets", "sorted_slot", "sorted_token",
                                                       "sorted_expert", "slot_row", "slot_weight")}
    if block_m:
        alignment = sort.aligned(block_m)
        tensors.update(padded_rows=alignment.padded_rows, block_expert=alignment.block_expert)
    return tensors


def compare_permutations(out: dict, ref: dict) -> str | None:
    """None when every tensor equals the reference's exactly (dtype, shape and values)."""
    return exact_mismatch((name, out[name], expected) for name, expected in ref.items())


def _make_inputs(phase, shape, device, seed) -> dict:
    """Routing of T tokens to top_k distinct experts each (uniform), fp32 weights: the router's outputs."""
    gen = torch.Generator(device).manual_seed(seed)
    weights, ids = random_routing(shape["T"], shape["E"], shape["top_k"], torch.device(device), gen)
    return {"ids": ids, "weights": weights, "E": shape["E"], "block_m": shape["block_m"]}


def _run(inputs, config):
    sort = op.sort_and_align(inputs["ids"], inputs["weights"], inputs["E"], inputs["block_m"] or None,
                             check_ids=False, config=config)
    return permutation_tensors(sort, inputs["block_m"])


def _torch_permute(inputs):
    sort = sort_by_expert(inputs["ids"], inputs["weights"], inputs["E"], check_ids=False)
    return permutation_tensors(sort, inputs["block_m"])  # (its sort.aligned runs align_blocks)


def _cost(phase, shape) -> Cost:
    """int32 ids read once; offsets, four int32 rows per slot and the padded rows and experts written once."""
    t, e, k, bm = shape["T"], shape["E"], shape["top_k"], shape["block_m"]
    rows = t * k
    padded = max_padded_rows(rows, e, bm) if bm else 0
    return Cost(bytes=rows * 4 + (e + 1) * 4 + 4 * rows * 4 + 2 * padded * 4)


def _bench_shapes(phase, gpu) -> list[dict]:
    if gpu:  # DeepSeek-V3.2 decode, the fused GEMM's default 8-row blocks
        return [{"T": t, "E": 256, "top_k": 8, "block_m": 8} for t in (1, 64, 256)]
    return [{"T": 5, "E": 10, "top_k": 3, "block_m": 4}, {"T": 3, "E": 7, "top_k": 2, "block_m": 0}]


SPEC = registry.register(KernelSpec(
    launch=op.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_torch_permute,
    compare=compare_permutations,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_torch_permute,
    baseline_name="permute.sort_by_expert + align_blocks (torch, 15 kernel-launching ops)",
    model_dims=lambda m: [{"E": m.experts, "top_k": m.top_k}],
    count_roles={"T": "tokens"},
    source_modules=(op, sort_and_align_kernels, sys.modules[__name__]),
))
