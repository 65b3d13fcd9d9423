"""Token permutation for the grouped expert GEMMs: routed rows sorted by expert, and their block-aligned layout.

Token ``t``'s ``j``-th choice is the routed *slot* ``t * top_k + j``; there are ``M = T * top_k`` slots.
:func:`sort_by_expert` orders the slots by expert (stable: by token within an expert), giving the CSR
layout every grouped GEMM reads (rows of expert ``e`` are ``expert_offsets[e] : expert_offsets[e + 1]``).
:meth:`ExpertSort.aligned` pads each expert's rows to a multiple of ``BLOCK_M`` so a kernel block never
mixes experts (the idea of vLLM's ``moe_align_block_size``). Everything is torch ops on the device with
sizes known on the host (upper bounds where the true size depends on the routing): no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import check_positive, check_tensor


@dataclass(frozen=True)
class BlockAlignment:
    """Each expert's sorted rows padded to a multiple of ``block_m``; ``P`` is a host-side upper bound.

    - ``padded_rows [P]`` int32: the sorted row at each padded position, -1 for padding;
    - ``block_expert [P / block_m]`` int32: the expert of each block of ``block_m`` padded rows, -1 for the
      blocks past the last used one (a kernel launched over all blocks returns at once there).
    """

    block_m: int
    padded_rows: torch.Tensor
    block_expert: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


@dataclass(frozen=True)
class ExpertSort:
    """Routed slots sorted by expert (see the module docstring). ``M = T * top_k``.

    - ``expert_offsets [E + 1]`` int32: CSR offsets into the sorted rows;
    - ``sorted_slot [M]`` int32: the slot of each sorted row; ``sorted_token [M]``: its token (slot // top_k);
    - ``sorted_expert [M]`` int32: its expert; ``sorted_weight [M]`` fp32: its combine weight;
    - ``slot_row [M]`` int32: the inverse permutation, the sorted row of each slot.
    """

    num_experts: int
    top_k: int
    expert_offsets: torch.Tensor
    sorted_slot: torch.Tensor
    sorted_token: torch.Tensor
    sorted_expert: torch.Tensor
    sorted_weight: torch.Tensor
    slot_row: torch.Tensor
    _aligned: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return self.sorted_slot.numel()

    def aligned(self, block_m: int) -> BlockAlignment:
        """The block-aligned layout for ``block_m`` (computed once per ``block_m``, then cached)."""
        if block_m not in self._aligned:
            self._aligned[block_m] = align_blocks(self, block_m)
        return self._aligned[block_m]


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int,
                   check_ids: bool = True) -> ExpertSort:
    """``topk_ids[T, top_k]`` (int32/int64 in ``[0, E)``), ``topk_weights[T, top_k]`` (float, or None for ones)
    -> :class:`ExpertSort`.

    ``check_ids`` reads the ids' range on the host (one sync); callers passing ids straight from a
    router (valid by construction) turn it off on the decode path.
    """
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2, contiguous_last=False)
    check_positive("num_experts", num_experts)
    tokens, top_k = topk_ids.shape
    if top_k == 0 or top_k > num_experts:
        raise ValueError(f"topk_ids: top_k (dimension 1) must be in [1, num_experts = {num_experts}], got {top_k}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=(torch.float32, torch.float16, torch.bfloat16),
                     shape=tuple(topk_ids.shape), device=topk_ids.device, contiguous_last=False)
    if check_ids and topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"topk_ids: expert ids must be in [0, {num_experts}), got values in [{low}, {high}]")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    sorted_expert, sorted_slot = torch.sort(flat, stable=True)
    offsets = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=device))
    slot_row = torch.empty_like(sorted_slot).scatter_(0, sorted_slot, torch.arange(flat.numel(), device=device))
    weights = (torch.ones(flat.numel(), device=device) if topk_weights is None
               else topk_weights.reshape(-1).float()[sorted_slot])
    return ExpertSort(num_experts, top_k, offsets.to(torch.int32), sorted_slot.to(torch.int32),
                      (sorted_slot // top_k).to(torch.int32), sorted_expert.to(torch.int32), weights,
                      slot_row.to(torch.int32))


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Host-side bound on the padded rows: at most ``min(E, M)`` experts get rows, each wastes < ``block_m``."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_blocks(sort: ExpertSort, block_m: int) -> BlockAlignment:
    """Pad every expert's rows of ``sort`` to a multiple of ``block_m``: see :class:`BlockAlignment`."""
    check_positive("block_m", block_m)
    device = sort.expert_offsets.device
    offsets = sort.expert_offsets.long()
    padded_counts = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m * block_m
    padded_offsets = torch.cat([offsets.new_zeros(1), padded_counts.cumsum(0)])
    size = max_padded_rows(sort.num_rows, sort.num_experts, block_m)
    rows = torch.arange(sort.num_rows, device=device)
    expert = sort.sorted_expert.long()
    position = padded_offsets[expert] + rows - offsets[expert]
    padded_rows = torch.full((size,), -1, dtype=torch.int64, device=device).scatter_(0, position, rows)
    starts = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_offsets, starts, right=True) - 1
    block_expert = torch.where(starts < padded_offsets[-1], block_expert, -1)
    return BlockAlignment(block_m, padded_rows.to(torch.int32), block_expert.to(torch.int32))


def combine_rows(y_sorted: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
    """Weighted sum of each token's expert rows: ``y_sorted[M, N]`` (sorted order) -> ``[T, N]`` fp32."""
    slot_row = sort.slot_row.long()
    tokens = sort.num_rows // sort.top_k
    per_slot = y_sorted[slot_row].float().view(tokens, sort.top_k, y_sorted.shape[1])
    return (per_slot * sort.sorted_weight[slot_row].view(tokens, sort.top_k, 1)).sum(dim=1)
