"""Token permutation and block alignment in one Triton launch: :func:`sort_and_align`.

The torch form (:mod:`.permute`, the reference) is 5 kernel-launching aten ops for
:func:`.permute.sort_by_expert` (int32 ids, fp32 weights; 8 with the views) and 10 for
:func:`.permute.align_blocks` (17); at decode the host time of those launches is most of the permutation's
time. Here one program (:mod:`.sort_and_align_kernels`) does both for ``M = T * top_k`` routed slots:

1. the slots' keys ``expert * M + slot`` (unique, so the order is the stable one) sorted in registers
   (``tl.sort``, a power-of-two block, lanes past ``M`` keyed above all), giving the sorted slot, token and
   expert of each row; the inverse permutation ``slot_row`` is a scattered store;
2. after a barrier, each expert's first and last sorted row by binary search over the sorted experts just
   stored (the CSR offsets), its padding to a multiple of ``block_m`` and the padding shift of the experts
   before it (an exclusive cumsum), kept in a scratch row;
3. after a second barrier, each row's padded position (its row plus its expert's shift, read from the scratch)
   takes the row and the expert; the padding inside each expert and the tail past the last used block take -1.
   Every padded position is written exactly once, so nothing needs a fill first.

Outputs, bit-identical to :func:`.permute.sort_by_expert` + :func:`.permute.align_blocks`, live in one int32
buffer (one allocation). Over :data:`MAX_ROWS` slots or :data:`MAX_EXPERTS` experts (or no slot) the op falls
back to the torch functions; an expert's padding tile over :data:`MAX_PAD_TILE` leaves the alignment to
:meth:`.permute.ExpertSort.aligned`. No host sync and no data-dependent shape: capturable in a CUDA graph.
Launch parameter (:data:`LAUNCH`): ``num_warps``.
"""
from __future__ import annotations

import torch


from ..checks import check_int32, check_kernel_device
from ..plans import PlanCache
from ..hostmath import next_pow2
from ..launch import launch_with
from ..registry import LaunchSpace
from .permute import (BlockAlignment, ExpertSort, check_id_range, check_routing, max_padded_rows,
                      sort_by_expert)
from .sort_and_align_kernels import _permute_kernel

MAX_ROWS = 4096  # routed slots (T * top_k) the one program sorts in registers; above: torch
MAX_EXPERTS = 4096  # experts; above: torch (keys expert * M + slot stay below 2^31 within both bounds)
MAX_PAD_TILE = 1 << 15  # experts x padding rows per expert (both padded to powers of two) written as one tile


def _default(phase, shape) -> dict:
    """About 256 sort keys or experts per warp: one warp at T = 1, E = 256; 8 warps at 2048 slots."""
    lanes = max(shape["T"] * shape["top_k"], shape["E"])
    return {"num_warps": min(16, max(1, next_pow2(lanes) // 256))}


LAUNCH = LaunchSpace(name="sort_and_align", phases=("decode",), space={"num_warps": (1, 2, 4, 8, 16)},
                     default=_default, fixed_dims=("E", "top_k", "block_m"), bucketed_dims=("T",))


class PermuteLaunch:
    """One :func:`_permute_kernel` launch for fixed metadata (checked once), or the torch fallback.

    Every output is a piece of one int32 buffer (``sizes``): ``offsets [E + 1] | sorted_slot [M] |
    sorted_token [M] | sorted_expert [M] | slot_row [M]``, then ``slot_weight [M]`` (fp32 bits) unless it is a
    view of the weights, then, when aligning, ``padded [2, P]`` (rows | experts) and the shift scratch ``[E]``.
    """

    def __init__(self, topk_ids, topk_weights, num_experts: int, block_m: int | None, config: dict | None):
        tokens, top_k = topk_ids.shape
        rows = tokens * top_k
        self.num_experts, self.top_k = num_experts, top_k
        self.fallback = rows == 0 or rows > MAX_ROWS or num_experts > MAX_EXPERTS
        self.block_m = block_m
        if self.fallback:
            return
        e_block = max(16, next_pow2(num_experts))
        pad_block = max(2, next_pow2(block_m - 1)) if block_m else 0
        align = block_m is not None and e_block * pad_block <= MAX_PAD_TILE
        self.block_m = block_m if align else None  # alignment beyond the tile: ExpertSort.aligned, on demand
        self.weights_view = (topk_weights is not None and topk_weights.dtype == torch.float32
                             and topk_weights.is_contiguous())
        weights_mode = 0 if self.weights_view else 1 if topk_weights is None else 2
        padded = max_padded_rows(rows, num_experts, block_m) if align else 0
        self.sizes = [num_experts + 1, rows, rows, rows, rows] + ([rows] if weights_mode else [])
        self.sizes += [2 * padded, num_experts] if align else []  # padded rows | padded experts, shift scratch
        shape = permute_shape(tokens, num_experts, top_k, block_m or 0)
        config = LAUNCH.launch_config("decode", shape, topk_ids.device) if config is None else LAUNCH.validate(config, shape)
        m_block = max(16, next_pow2(rows))
        self.args = (rows, top_k, num_experts, block_m or 1, padded) + tuple(topk_ids.stride())
        self.args += (1, 1) if topk_weights is None else tuple(topk_weights.stride())
        tail = min(m_block, e_block) * (block_m or 1)  # bounds P - M; constexprs depend on the T bucket only
        self.meta = dict(WEIGHTS=weights_mode, ALIGN=align, M_BLOCK=m_block, E_BLOCK=e_block, PAD_BLOCK=pad_block,
                         TAIL_BLOCK=min(1024, next_pow2(tail)), STEPS=m_block.bit_length(),
                         num_warps=config["num_warps"])

    def __call__(self, topk_ids, topk_weights) -> ExpertSort:
        if self.fallback:
            sort = sort_by_expert(topk_ids, topk_weights, self.num_experts, check_ids=False)
            if self.block_m is not None:
                sort.aligned(self.block_m)
            return sort
        out = torch.empty(sum(self.sizes), dtype=torch.int32, device=topk_ids.device)
        offsets, slot, token, expert, slot_row, *rest = out.split(self.sizes)
        slot_weight = topk_weights.view(-1) if self.weights_view else rest.pop(0).view(torch.float32)
        padded, shift = rest if rest else (out, out)  # not aligning: never touched
        launch_with(_permute_kernel, (1,), self.meta, topk_ids, topk_ids if topk_weights is None else topk_weights,
                    offsets, slot, token, expert, slot_row, slot_weight, padded, shift, *self.args)
        aligned = {}
        if self.block_m is not None:
            padded = padded.view(2, -1)
            aligned[self.block_m] = BlockAlignment(self.block_m, padded[0], padded[1, ::self.block_m])
        return ExpertSort(self.num_experts, self.top_k, offsets, slot, token, expert, slot_row, slot_weight,
                          _aligned=aligned)


_PLANS = PlanCache()


def permute_shape(tokens: int, experts: int, top_k: int, block_m: int) -> dict[str, int]:
    """The registry shape of a call (``block_m`` 0: no alignment)."""
    return {"T": tokens, "E": experts, "top_k": top_k, "block_m": block_m}


def sort_and_align(topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int,
                   block_m: int | None = None, *, check_ids: bool = True, config: dict | None = None) -> ExpertSort:
    """:func:`.permute.sort_by_expert` and, for ``block_m``, :func:`.permute.align_blocks` in one launch.

    - ``topk_ids [T, top_k]``: int32/int64 expert ids in ``[0, E)`` (any strides);
    - ``topk_weights [T, top_k]``: fp32/fp16/bf16 routing weights (any strides), or None for ones;
    - ``num_experts``: ``E``; ``block_m``: the row block of the grouped GEMM that reads the alignment, or None;
    - ``check_ids``: read the ids' range on the host (one sync); off for ids straight from a router
      (unchecked out-of-range ids give unspecified outputs, never an access out of bounds);
    - ``config``: ``{"num_warps"}`` (default: the tuning database / the registry default).

    Returns the :class:`.permute.ExpertSort` of the torch functions, bit for bit, its ``aligned(block_m)``
    already computed (on first use instead when ``E x block_m``, padded, exceeds :data:`MAX_PAD_TILE`).
    No slot, over :data:`MAX_ROWS` slots or over :data:`MAX_EXPERTS` experts: the torch functions.
    Non-finite weights are copied as they are (NaN in, NaN out); the permutation reads only the ids.
    """
    key, launch = _PLANS.find((topk_ids, topk_weights), (num_experts, block_m), config)
    if launch is None:
        launch = _PLANS.put(key, _plan(topk_ids, topk_weights, num_experts, block_m, config))
    if check_ids:
        check_id_range(topk_ids, num_experts)
    return launch(topk_ids, topk_weights)


def _plan(topk_ids, topk_weights, num_experts, block_m, config) -> PermuteLaunch:
    """The checks of :func:`.permute.sort_by_expert` plus the device and ``block_m``, then the launch."""
    check_routing(topk_ids, topk_weights, num_experts)
    check_kernel_device("topk_ids", topk_ids)
    if block_m is not None:
        check_int32("block_m", block_m)
    return PermuteLaunch(topk_ids, topk_weights, num_experts, block_m, config)
