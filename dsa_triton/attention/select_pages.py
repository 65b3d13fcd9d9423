"""Page selection of the block-level indexer path: the ``n_select`` best pages of each row of bounds.

:func:`select_pages` is one Triton launch, one program per row (the torch form, ``topk`` + ``sort`` +
padding, is six launches). A row's sort keys (``uint32`` order = float order) are searched bit by bit
for the ``kk``-th largest, ``kk = min(n_select, finite bounds)``; then one pass in ascending page
order writes every page above it and the first pages equal to it, at slots from a running prefix sum,
and ``-1`` after. So the pages come out ascending, exactly ``kk`` of them, ties to the lower page.
Launch configs come from the tuning database through the registry (:data:`LAUNCH`) unless ``config`` is given.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_int32, check_kernel_device, check_out, check_tensor
from ..hostmath import next_pow2
from ..launch import launch_with
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..registry import LaunchSpace


_NEG_INF_KEY = tl.constexpr(0x7FFFFF)  # key of -inf (and of NaN)

LAUNCH = LaunchSpace(
    name="select_pages",
    phases=("decode",),
    space={"TILE": (128, 256, 512, 1024, 2048, 4096), "num_warps": (1, 2, 4, 8)},  # bounds per step of a row's passes
    default=lambda phase, shape: {"TILE": min(2048, max(128, next_pow2(shape["pages"]))), "num_warps": 4},
    fixed_dims=(),
    bucketed_dims=("T", "pages", "SEL"),  # rows, bounds per row, pages selected
)


@triton.jit
def _keys(x):
    """fp32 -> int64 keys in ``[0, 2^32)`` ordered like the floats; NaN gets the key of -inf."""
    bits = x.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + (1 << 31)
    return tl.where(x != x, _NEG_INF_KEY, key)


@triton.jit
def _count_at_least(row_ptr, n, tau, TILE: tl.constexpr):
    count = 0
    for t0 in range(0, n, TILE):
        offs = t0 + tl.arange(0, TILE)
        ok = offs < n
        key = _keys(tl.load(row_ptr + offs, mask=ok, other=float("-inf")))
        count += tl.sum((ok & (key >= tau)).to(tl.int32), 0)
    return count


@triton.jit
def _select_pages_kernel(bounds_ptr, out_ptr, n, n_select, stride_b, stride_o, TILE: tl.constexpr):
    """Program t: ``out[t, :]`` = the ``n_select`` best of the ``n`` bounds of row t, ascending, -1 after."""
    t = tl.program_id(0).to(tl.int64)
    row_ptr = bounds_ptr + t * stride_b
    out_row = out_ptr + t * stride_o
    kk = tl.minimum(_count_at_least(row_ptr, n, _NEG_INF_KEY + 1, TILE), n_select)
    tau = tl.full([], 0, tl.int64)  # the kk-th largest key: the largest tau with count(key >= tau) >= kk
    for i in range(32):
        candidate = tau | (tl.full([], 1, tl.int64) << (31 - i))
        tau = tl.where(_count_at_least(row_ptr, n, candidate, TILE) >= kk, candidate, tau)
    ties = kk - _count_at_least(row_ptr, n, tau + 1, TILE)  # pages equal to tau that are taken
    taken = 0
    seen_ties = 0
    for t0 in range(0, n, TILE):
        offs = t0 + tl.arange(0, TILE)
        ok = offs < n
        key = _keys(tl.load(row_ptr + offs, mask=ok, other=float("-inf")))
        tie = (ok & (key == tau)).to(tl.int32)
        take = (ok & (key > tau)) | ((tie != 0) & (seen_ties + tl.cumsum(tie, 0) - tie < ties))
        take = take & (kk > 0)
        take_i = take.to(tl.int32)
        tl.store(out_row + taken + tl.cumsum(take_i, 0) - take_i, offs, mask=take)
        taken += tl.sum(take_i, 0)
        seen_ties += tl.sum(tie, 0)
    for s0 in range(0, n_select, TILE):
        slots = s0 + tl.arange(0, TILE)
        tl.store(out_row + slots, tl.full([TILE], -1, tl.int32), mask=(slots >= kk) & (slots < n_select))


class SelectLaunch:
    """One :func:`_select_pages_kernel` launch but its tensors (``pages`` is a fresh ``[T, n_select]``). The kernel
    writes the first ``min(n_select, n_pages)`` slots of a row (no more pages exist); one fill the -1 after them."""

    def __init__(self, T: int, n_pages: int, n_select: int, bounds_stride: int, device: torch.device,
                 config: dict | None = None) -> None:
        shape = {"T": T, "pages": n_pages, "SEL": n_select}
        config = LAUNCH.launch_config("decode", shape, device) if config is None else LAUNCH.validate(config, shape)
        self.shape = (T, n_select)
        self.written = min(n_select, n_pages)
        self.grid = (T,) if T and self.written else None
        self.args = (n_pages, self.written, bounds_stride, n_select)
        self.meta = dict(TILE=config["TILE"], num_warps=config["num_warps"])

    def __call__(self, bounds: torch.Tensor, pages: torch.Tensor | None = None) -> torch.Tensor:
        if pages is None:
            pages = torch.empty(self.shape, dtype=torch.int32, device=bounds.device)
        if self.grid is not None:
            launch_with(_select_pages_kernel, self.grid, self.meta, bounds, pages, *self.args)
        if self.written < self.shape[1]:
            pages[:, self.written:].fill_(-1)
        return pages


_PLANS = PlanCache()


def select_pages(bounds: torch.Tensor, n_select: int, *, config: dict | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n_select`` logical pages with the highest bounds per row: ``[T, n_select]`` int32 in
    ascending order, -1 after the last valid page (bounds of ``-inf`` or NaN are never taken: NaN ranks as
    ``-inf``, never first; among equal bounds the lower page is taken first). Any bound values are safe: the
    kernel reads only ``bounds``.

    ``bounds``: ``[T, n_pages]`` fp32 (e.g. from :func:`~dsa_triton.block_scores`), last dim contiguous.
    ``n_select``: 1 to 2^31 - 1.
    ``config``: ``{"TILE", "num_warps"}`` (default: the tuning database / the registry default).
    ``out``: optional ``[T, n_select]`` int32 contiguous tensor to write (and return).
    """
    check_int32("n_select", n_select)
    key, launch = _PLANS.find((bounds, out), (n_select,), config)
    if launch is None:
        check_tensor("bounds", bounds, dtype=torch.float32, ndim=2)
        device = check_kernel_device("bounds", bounds)
        launch = SelectLaunch(*bounds.shape, n_select, bounds.stride(0), device, config)
        if out is not None:
            check_out(out, launch.shape, torch.int32, device)
        launch = _PLANS.put(key, launch)
    return launch(bounds, out)


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("select_pages")
def select_pages_op(bounds: torch.Tensor, n_select: int, check_values: bool = True,
                    config: str | None = None) -> torch.Tensor:
    """:func:`dt.select_pages`: ``[T, n_select]`` int32 logical pages, ascending, -1 padded."""
    return select_pages(bounds, n_select, config=op_config(config))


@select_pages_op.register_fake
def _(bounds, n_select, check_values=True, config=None):
    return bounds.new_empty((bounds.shape[0], n_select), dtype=torch.int32)


@dsa_op("select_pages_out", mutates_args=("out",))
def select_pages_out(bounds: torch.Tensor, n_select: int, out: torch.Tensor, check_values: bool = True,
                     config: str | None = None) -> None:
    """:func:`dt.select_pages` into ``out[T, n_select]`` int32 (contiguous)."""
    select_pages(bounds, n_select, config=op_config(config), out=out)


@select_pages_out.register_fake
def _(bounds, n_select, out, check_values=True, config=None):
    return None
