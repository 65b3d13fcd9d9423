"""Token permutation and block alignment in one Triton launch: :func:`sort_and_align`.

The torch form (:mod:`.permute`, the reference) is 5 kernel-launching aten ops for
:func:`.permute.sort_by_expert` (int32 ids, fp32 weights; 8 with the views) and 10 for
:func:`.permute.align_blocks` (17); on a host where a launch costs ~20 us that is most of the permutation's
time at decode. Here one program does both for ``M = T * top_k`` routed slots:

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
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .. import registry
from ..checks import PlanCache, check_kernel_device, check_positive, exact_mismatch
from ..hostmath import next_pow2
from ..registry import Cost, KernelSpec
from .fused_moe import random_routing
from .permute import (BlockAlignment, ExpertSort, check_id_range, check_routing, max_padded_rows,
                      sort_by_expert)

MAX_ROWS = 4096  # routed slots (T * top_k) the one program sorts in registers; above: torch
MAX_EXPERTS = 4096  # experts; above: torch (keys expert * M + slot stay below 2^31 within both bounds)
MAX_PAD_TILE = 1 << 15  # experts x padding rows per expert (both padded to powers of two) written as one tile
_ABOVE_ALL = tl.constexpr(2 ** 31 - 1)  # sort key of the lanes past M


@triton.jit
def _lower_bound(sorted_ptr, n, value, STEPS: tl.constexpr):
    """Per element of ``value``: the first index ``i < n`` with ``sorted[i] >= value`` (``n`` if none) in the
    ascending int32 array at ``sorted_ptr``. ``STEPS`` >= bit length of ``n``."""
    lo = tl.zeros_like(value)
    hi = lo + n
    for _ in tl.static_range(STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = open_ & (tl.load(sorted_ptr + mid, mask=open_, other=0) < value)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    return lo


@triton.jit
def _permute_kernel(ids_ptr, weights_ptr, offsets_ptr, slot_ptr, token_ptr, expert_ptr, slot_row_ptr, weight_ptr,
                    padded_ptr, shift_ptr, M, top_k, E, block_m, P, stride_it, stride_ik, stride_wt, stride_wk,
                    WEIGHTS: tl.constexpr, ALIGN: tl.constexpr, M_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                    PAD_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """The :class:`.permute.ExpertSort` rows of ``M`` slots (``ids[t, j]`` is slot ``t * top_k + j``) and,
    when ``ALIGN``, ``padded [2, P]`` (rows | experts) with ``shift [E]`` as scratch. ``WEIGHTS``: 0 none
    written (a view of the weights), 1 ones, 2 the routing weights as fp32 (slot order)."""
    s = tl.arange(0, M_BLOCK)
    real = s < M
    token = s // top_k
    expert = tl.load(ids_ptr + token * stride_it + (s - token * top_k) * stride_ik, mask=real, other=0)
    expert = tl.where((expert >= 0) & (expert < E), expert, E).to(tl.int32)  # bad ids (unchecked) sort last
    key = tl.sort(tl.where(real, expert * M + s, _ABOVE_ALL))
    row_slot = key % M
    row_expert = key // M
    tl.store(slot_ptr + s, row_slot, mask=real)
    tl.store(token_ptr + s, row_slot // top_k, mask=real)
    tl.store(expert_ptr + s, row_expert, mask=real)
    tl.store(slot_row_ptr + row_slot, s, mask=real)
    if WEIGHTS == 1:
        tl.store(weight_ptr + s, tl.full([M_BLOCK], 1.0, tl.float32), mask=real)
    if WEIGHTS == 2:
        w = tl.load(weights_ptr + token * stride_wt + (s - token * top_k) * stride_wk, mask=real, other=0.0)
        tl.store(weight_ptr + s, w.to(tl.float32), mask=real)
    tl.debug_barrier()  # the sorted experts are in memory for the binary searches

    e = tl.arange(0, E_BLOCK)
    first = _lower_bound(expert_ptr, M, e, STEPS)
    end = _lower_bound(expert_ptr, M, e + 1, STEPS)
    tl.store(offsets_ptr + e, first, mask=e < E)
    tl.store(offsets_ptr + e + 1, end, mask=e == E - 1)
    if ALIGN:
        padded_expert_ptr = padded_ptr + P
        count = tl.where(e < E, end - first, 0)
        padding = (block_m - count % block_m) % block_m
        shift = tl.cumsum(padding, 0) - padding
        tl.store(shift_ptr + e, shift, mask=e < E)  # scratch
        tl.debug_barrier()  # the shifts are in memory for the gather by expert
        position = s + tl.load(shift_ptr + tl.minimum(row_expert, E - 1), mask=real, other=0)
        row_ok = real & (position < P)
        tl.store(padded_ptr + position, s, mask=row_ok)
        tl.store(padded_expert_ptr + position, row_expert, mask=row_ok)
        j = tl.arange(0, PAD_BLOCK)[None, :]
        pad_position = (first + shift + count)[:, None] + j
        pad_ok = (j < padding[:, None]) & (pad_position < P)
        tl.store(padded_ptr + pad_position, -1, mask=pad_ok)
        tl.store(padded_expert_ptr + pad_position, -1, mask=pad_ok)
        used = M + tl.sum(padding, 0)  # padded positions of the used blocks; the tail past them is -1
        for start in range(M // TAIL_BLOCK * TAIL_BLOCK, P, TAIL_BLOCK):
            p = start + tl.arange(0, TAIL_BLOCK)
            tail = (p >= used) & (p < P)
            tl.store(padded_ptr + p, -1, mask=tail)
            tl.store(padded_expert_ptr + p, -1, mask=tail)


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
        config = SPEC.launch_config("decode", shape, topk_ids.device) if config is None else SPEC.validate(config, shape)
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
        _permute_kernel[(1,)](topk_ids, topk_ids if topk_weights is None else topk_weights, offsets, slot, token,
                              expert, slot_row, slot_weight, padded, shift, *self.args, **self.meta)
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
        check_positive("block_m", block_m)
    return PermuteLaunch(topk_ids, topk_weights, num_experts, block_m, config)


# -- registry entry -------------------------------------------------------------------------------

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
    sort = sort_and_align(inputs["ids"], inputs["weights"], inputs["E"], inputs["block_m"] or None,
                          check_ids=False, config=config)
    return permutation_tensors(sort, inputs["block_m"])


def _torch_permute(inputs):
    sort = sort_by_expert(inputs["ids"], inputs["weights"], inputs["E"], check_ids=False)
    return permutation_tensors(sort, inputs["block_m"])  # (its sort.aligned runs align_blocks)


def _default(phase, shape) -> dict:
    """About 256 sort keys or experts per warp: one warp at T = 1, E = 256; 8 warps at 2048 slots."""
    lanes = max(shape["T"] * shape["top_k"], shape["E"])
    return {"num_warps": min(16, max(1, next_pow2(lanes) // 256))}


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
    name="moe_permute",
    phases=("decode",),
    space={"num_warps": (1, 2, 4, 8, 16)},
    default=_default,
    fixed_dims=("E", "top_k", "block_m"),
    bucketed_dims=("T",),
    make_inputs=_make_inputs,
    run=_run,
    reference=_torch_permute,
    compare=compare_permutations,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_torch_permute,
    baseline_name="permute.sort_by_expert + align_blocks (torch, 15 kernel-launching ops)",
    source_modules=(sys.modules[__name__],),
))
