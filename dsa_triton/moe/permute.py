"""Token permutation for the grouped expert GEMMs: routed rows sorted by expert, and their block-aligned layout.

Token ``t``'s ``j``-th choice is the routed *slot* ``t * top_k + j``; there are ``M = T * top_k`` slots.
:func:`sort_by_expert` orders the slots by expert (stable: by token within an expert), giving the CSR
layout every grouped GEMM reads (rows of expert ``e`` are ``expert_offsets[e] : expert_offsets[e + 1]``).
:meth:`ExpertSort.aligned` pads each expert's rows to a multiple of ``BLOCK_M`` so a kernel block never
mixes experts (the idea of vLLM's ``moe_align_block_size``). Everything is torch ops on the device with
sizes known on the host (upper bounds where the true size depends on the routing): no host sync, so the decode
path can be captured in a CUDA graph. The index ranges they use are cached per (length, dtype, device) (never
while a capture is running: a capture does not execute the kernel that fills them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


from ..checks import check_int32, check_tensor
from ..hostmath import cdiv


@dataclass(frozen=True)
class BlockAlignment:
    """Each expert's sorted rows padded to a multiple of ``block_m``; ``P`` is a host-side upper bound.

    - ``padded_rows [P]`` int32: the sorted row at each padded position, -1 for padding;
    - ``block_expert [P / block_m]`` int32: the expert of each block of ``block_m`` padded rows, -1 for the
      blocks past the last used one (a kernel launched over all blocks returns at once there); a view with
      stride ``block_m`` into the expert of every padded position (kernels read element ``b * block_m``).
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
    - ``sorted_expert [M]`` int32: its expert;
    - ``slot_row [M]`` int32: the inverse permutation, the sorted row of each slot;
    - ``slot_weight [M]`` fp32: the combine weight of each slot (the routing weights, flattened: a view of
      ``topk_weights`` when those are contiguous fp32).
    """

    num_experts: int
    top_k: int
    expert_offsets: torch.Tensor
    sorted_slot: torch.Tensor
    sorted_token: torch.Tensor
    sorted_expert: torch.Tensor
    slot_row: torch.Tensor
    slot_weight: torch.Tensor
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
    router (valid by construction) turn it off on the decode path. Non-finite weights are copied as they are
    (NaN in, NaN out); the permutation reads only the ids.
    """
    check_routing(topk_ids, topk_weights, num_experts)
    if check_ids:
        check_id_range(topk_ids, num_experts)
    device, rows, top_k = topk_ids.device, topk_ids.numel(), topk_ids.shape[1]
    sorted_expert, sorted_slot = torch.sort(topk_ids.reshape(-1), stable=True)
    sorted_expert = sorted_expert.to(torch.int32)
    offsets = torch.searchsorted(sorted_expert, index_range(num_experts + 1, torch.int32, device), out_int32=True)
    slot = sorted_slot.to(torch.int32)
    slot_row = torch.empty_like(slot).scatter_(0, sorted_slot, index_range(rows, torch.int32, device))
    slot_weight = (torch.ones(rows, device=device) if topk_weights is None
                   else topk_weights.reshape(-1).to(torch.float32))
    return ExpertSort(num_experts, top_k, offsets, slot, slot // top_k, sorted_expert, slot_row, slot_weight)


def check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int) -> None:
    """The metadata checks of :func:`sort_by_expert` (dtypes, shapes, devices, top_k in ``[1, E]``)."""
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2, contiguous_last=False)
    check_int32("num_experts", num_experts)  # ids and offsets are int32
    top_k = topk_ids.shape[1]
    if top_k == 0 or top_k > num_experts:
        raise ValueError(f"topk_ids: top_k (dimension 1) must be in [1, num_experts = {num_experts}], got {top_k}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=(torch.float32, torch.float16, torch.bfloat16),
                     shape=tuple(topk_ids.shape), device=topk_ids.device, contiguous_last=False)


def check_id_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ``ValueError`` naming ``topk_ids`` unless every id is in ``[0, E)`` (reads them: one sync)."""
    if topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"topk_ids: expert ids must be in [0, {num_experts}), got values in [{low}, {high}]")


_ranges: dict[tuple, torch.Tensor] = {}
CACHED_RANGE_MAX = 4096  # decode sizes: larger ranges are made per call (their op is amortized, their memory is not)


def index_range(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``arange(n)`` in ``dtype`` on ``device``; up to :data:`CACHED_RANGE_MAX` made once and shared (read-only:
    never write to it)."""
    key = (n, dtype, device)
    found = _ranges.get(key)
    if found is None:
        found = torch.arange(n, dtype=dtype, device=device)
        if n <= CACHED_RANGE_MAX and not (found.is_cuda and torch.cuda.is_current_stream_capturing()):
            if len(_ranges) > 256:
                _ranges.clear()
            _ranges[key] = found
    return found


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Host-side bound on the padded rows: at most ``min(E, M)`` experts get rows, each wastes < ``block_m``."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


def align_blocks(sort: ExpertSort, block_m: int) -> BlockAlignment:
    """Pad every expert's rows of ``sort`` to a multiple of ``block_m``: see :class:`BlockAlignment`.

    Sorted row ``r`` of expert ``e`` moves to ``r + shift[e]``, ``shift`` being the padding of the experts
    before ``e``; the experts are scattered beside the rows, so a block's expert is that of its first row."""
    check_int32("block_m", block_m)  # padded rows are int32
    device = sort.expert_offsets.device
    padding = torch.diff(sort.expert_offsets).neg_().remainder_(block_m)  # [E]: rows to add after each expert
    shift = padding.cumsum(0).sub_(padding)  # int64
    position = shift[sort.sorted_expert].add_(index_range(sort.num_rows, torch.int64, device))
    size = max_padded_rows(sort.num_rows, sort.num_experts, block_m)
    padded = torch.full((2, size), -1, dtype=torch.int32, device=device)  # [sorted row | expert] per position
    padded[0].scatter_(0, position, index_range(sort.num_rows, torch.int32, device))
    padded[1].scatter_(0, position, sort.sorted_expert)
    return BlockAlignment(block_m, padded[0], padded[1, ::block_m])


def combine_rows(y_sorted: torch.Tensor, sort: ExpertSort, add: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of each token's expert rows: ``y_sorted[M, N]`` (sorted order) -> ``[T, N]`` fp32, plus
    ``add [T, N]`` (e.g. the shared expert's output) when given. One batched matmul over the top_k rows."""
    tokens, n = sort.num_rows // sort.top_k, y_sorted.shape[1]
    per_slot = y_sorted[sort.slot_row].to(torch.float32).view(tokens, sort.top_k, n)
    weights = sort.slot_weight.view(tokens, 1, sort.top_k)
    if add is None:
        return torch.bmm(weights, per_slot).view(tokens, n)
    return torch.baddbmm(add.to(torch.float32).view(tokens, 1, n), weights, per_slot).view(tokens, n)
