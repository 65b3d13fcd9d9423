"""DSA indexer logits at token level: ``dt.indexer_logits``.

``score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) * k_scale[s]`` for logical key positions
``s < limits[t]`` of row ``t``'s sequence, ``-inf`` elsewhere, over the paged FP8 K cache (through a block table)
or contiguous FP8 keys. The kernel (:mod:`.indexer_logits_kernels`) also serves the block-level path
(:mod:`.block_indexer_logits`), which builds its launches with :class:`LogitsLaunch` and :func:`logits_shape`.
Launch configs come from the tuning database through the registry (:data:`LAUNCH`: ``BLOCK_M`` query rows per
program, ``BLOCK_N`` keys per tile, ``CHUNK`` keys per program, long sequences being split over programs,
``num_warps``, ``num_stages``) unless ``config`` is given.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..checks import check_out
from ..library import dsa_op, op_config, out_cols
from ..plans import PlanCache
from ..hostmath import cdiv, next_pow2
from ..launch import launch_with
from ..registry import LaunchSpace
from ..runtime import interpreting
from .indexer_checks import QueryRows, check_contiguous_keys, check_paged_keys, check_queries, check_size
from .indexer_logits_kernels import BOUND, DENSE, logits_kernel

MAX_DECODE_ROWS = 4  # a sequence with at most this many query rows is the decode phase


def _default(phase: str, shape) -> dict:
    """Decode: one query row per sequence 256-key tiles x 8 warps, two rows 64-key tiles x 4 warps, more rows
    64-key tiles x 8 warps; prefill: 2 rows x 64 keys x 4 warps (an H200 sweep's fastest at DeepSeek-V3.2 shapes,
    results/journal/attention.md)."""
    if phase == "decode":
        block_m = next_pow2(shape["Q"])
        block_n, warps = {1: (256, 8), 2: (64, 4)}.get(block_m, (64, 8))
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "CHUNK": 4096, "num_warps": warps, "num_stages": 3}
    return {"BLOCK_M": 2, "BLOCK_N": 64, "CHUNK": 16384, "num_warps": 4, "num_stages": 3}


SHARED_LIMIT = 220 * 1024  # bytes of shared memory a block may take on sm_90 (227 KB), less a margin


def tile_error(block_n: int, block_m: int, heads: int, dk: int, warps: int, stages: int, key_bytes: int = 1,
               key_operands: int = 1) -> str | None:
    """Why a tile does not fit an H200 SM (None if it does): the ``[BLOCK_N, BLOCK_M * heads]`` fp32
    accumulator over 128 registers a thread (spills), or ``stages`` buffers of ``key_operands`` key
    tiles plus as many stationary q^T tiles over the shared memory."""
    hp, dkp = next_pow2(max(heads, 16)), next_pow2(max(dk, 16))
    if block_n * block_m * hp / (32 * warps) > 128:
        return "the accumulator takes over 128 registers per thread (spills)"
    shared = key_operands * key_bytes * dkp * (max(stages, 1) * block_n + block_m * hp)
    if shared > SHARED_LIMIT:
        return f"{shared // 1024} KB of pipelined tiles exceed the shared memory"
    return None


def _constraint(config: dict, shape) -> str | None:
    if config["CHUNK"] % config["BLOCK_N"]:
        return "CHUNK must be a multiple of BLOCK_N"
    return tile_error(config["BLOCK_N"], config["BLOCK_M"], shape["H"], shape["DK"], config["num_warps"],
                      config["num_stages"])


LAUNCH = LaunchSpace(
    name="indexer_logits",
    phases=("prefill", "decode"),
    space={"BLOCK_M": (1, 2, 4), "BLOCK_N": (32, 64, 128, 256),
           "CHUNK": (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536), "num_warps": (4, 8),
           "num_stages": (1, 2, 3, 4)},
    default=_default,
    fixed_dims=("P", "H", "DK"),
    bucketed_dims=("B", "Q", "L"),
    constraint=_constraint,
)


class LogitsLaunch:
    """One :func:`logits_kernel` launch but its tensors: grid, sizes, strides and constexprs, worked out
    once (ops keep it in their launch plans). ``strides``: q's rows and heads, weights' rows, k's rows,
    the block table's rows, out's rows, pages' rows (0 for an absent tensor)."""

    def __init__(self, mode: int, T: int, H: int, DK: int, G: int, max_rows: int, n_cols: int,
                 strides: tuple[int, ...], config: dict, page_size: int = 1, paged: bool = False) -> None:
        block_m, chunk = config["BLOCK_M"], config["CHUNK"]
        self.shape = (T, n_cols)  # of out (and positions)
        self.grid = None if G == 0 or T * n_cols == 0 else (G, cdiv(max_rows, block_m), cdiv(n_cols, chunk))
        if self.grid is not None and (self.grid[1] > 65535 or self.grid[2] > 65535):
            raise ValueError(f"max_q, num_cols: {max_rows} rows of a sequence / {n_cols} columns exceed one launch "
                             f"(65535 row blocks of {block_m}, chunks of {chunk}); split the call")
        self.args = (H, n_cols, *strides)
        self.meta = dict(
            MODE=mode, PAGED=paged, P=page_size, DK=DK, HP=next_pow2(max(H, 16)), DKP=next_pow2(max(DK, 16)),
            BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], CHUNK=chunk,
            NPG=chunk if mode == BOUND else max(chunk // page_size, 1) if paged else 1,
            BOUND_DTYPE=tl.float32 if interpreting() else tl.bfloat16,
            num_warps=config["num_warps"], num_stages=config["num_stages"])

    def __call__(self, q, w, k, k2, k_scale, out, positions, limits, cu, block_table, key_starts,
                 pages) -> torch.Tensor:
        """Launch on checked tensors; absent ones are passed as any tensor (``cu``), never read."""
        if self.grid is not None:
            launch_with(logits_kernel, self.grid, self.meta, q, w, k, k2, k_scale, out, positions, limits, cu,
                        block_table, key_starts, pages, *self.args)
        return out


def logits_shape(rows: QueryRows, L: int, P: int) -> tuple[str, dict[str, int]]:
    """Phase and registry shape of a call: decode when every sequence has at most 4 query rows."""
    phase = "decode" if rows.max_q <= MAX_DECODE_ROWS else "prefill"
    return phase, {"B": rows.B, "Q": rows.max_q, "L": L, "P": P, "H": rows.H, "DK": rows.DK}


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    limits: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    key_starts: torch.Tensor | None = None,
    num_cols: int | None = None,
    max_q: int | None = None,
    check_values: bool = True,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-level DSA indexer logits ``[T, num_cols]`` fp32, ``-inf`` outside ``[0, limits[t])``.

    Args:
        q: ``[T, H, DK]`` float8_e4m3fn query rows (64 x 128 in DeepSeek-V3.2), rows packed by sequence.
        weights: ``[T, H]`` fp32 head weights with the q scales (and ``H^-0.5 * DK^-0.5``) folded in.
        k, k_scale: paged ``[num_pages, P, DK]`` e4m3 + ``[num_pages, P]`` fp32 (with ``block_table``),
            or contiguous ``[S, DK]`` + ``[S]`` (without).
        limits: ``[T]`` int32; row ``t`` scores logical positions ``0 .. limits[t] - 1`` of its sequence.
        cu_seqlens_q: ``[B + 1]`` int32, rows of sequence ``b`` are ``cu[b] .. cu[b + 1]`` (default: one).
        block_table: ``[>= B, max_pages]`` int32 (paged mode); position ``i`` is at slot
            ``block_table[b, i // P] * P + i % P``.
        seq_lens: ``[>= B]`` int32, required in paged mode; no limit may exceed its sequence's length.
        key_starts: ``[B]`` int32 (contiguous mode): first key row of each sequence (default 0).
        num_cols: output width ``L`` (default ``max(limits)``).
        max_q: the most query rows of one sequence (default: read off ``cu_seqlens_q``).
        check_values: check the values below on the device (one transfer) and raise a ValueError naming the
            argument before any launch; ``False`` skips them, and with ``num_cols`` and ``max_q`` given the call
            never waits on the device (CUDA-graph safe). Shapes, dtypes and devices are always checked.
        config: launch parameters (default: the tuning database / the registry default).
        out: optional ``[T, num_cols]`` fp32 contiguous tensor to write (and return).

    The value checks, which a caller with ``check_values=False`` promises instead: ``cu_seqlens_q`` rises from 0
    to ``T``; no sequence has more than ``max_q`` rows; ``limits >= 0``; no NaN byte in ``q``. Paged: ``seq_lens[b]`` in
    ``[0, max_pages * P]``, every row's limit at most its sequence's ``seq_lens``, and every block-table entry of a
    page below ``seq_lens[b]`` in ``[0, num_pages)``. Contiguous: ``key_starts`` in ``[0, S]`` and
    ``key_starts[b] + limits[t] <= S``. A broken promise makes the kernel read outside ``q``, ``weights``,
    ``limits``, the keys, the block table or ``key_starts``, write outside the output (``cu_seqlens_q``), or leave
    rows unwritten (a sequence longer than ``max_q``). Limits past ``num_cols`` are cut at ``num_cols``.

    Non-finite values: the value checks reject a NaN in ``q`` (an e4m3 byte with ``byte & 0x7F == 0x7F``; the
    Triton interpreter would read it as +-480), nothing else (the append op rejects non-finite keys when its checks
    are on). Unchecked, a NaN in ``q``, a weight, a key or a key scale makes every logit it enters NaN, never a
    finite number (a key appended with a NaN or an inf has a NaN scale); an infinite weight gives an infinite or
    NaN logit.
    """
    key = plan = None
    if not check_values and num_cols is not None and (cu_seqlens_q is None or max_q is not None):  # no device value
        key, plan = _PLANS.find((q, weights, k, k_scale, limits, cu_seqlens_q, block_table, seq_lens, key_starts,
                                 out), (num_cols, max_q), config)
    if plan is None:
        plan = _checked_plan(q, weights, k, k_scale, limits, cu_seqlens_q, block_table, seq_lens, key_starts,
                             num_cols, max_q, check_values, config)
        if out is not None:
            check_out(out, plan[0].shape, torch.float32, q.device)
        plan = _PLANS.put(key, plan)
    launch, cu, starts = plan
    cu = call_cu(cu, cu_seqlens_q)
    starts = starts if key_starts is None else key_starts.contiguous()
    if out is None:
        out = torch.empty(launch.shape, dtype=torch.float32, device=q.device)
    return launch(q, weights, k, k, k_scale, out, cu, limits, cu, cu if block_table is None else block_table,
                  cu if starts is None else starts, cu)


_PLANS = PlanCache()


def _checked_plan(q, weights, k, k_scale, limits, cu_seqlens_q, block_table, seq_lens, key_starts, num_cols, max_q,
                  check_values, config) -> tuple:
    """Every check of :func:`indexer_logits` (the value checks in one transfer); returns its launch and the
    ``cu`` / ``key_starts`` it made for absent ones."""
    key_starts_given = key_starts
    rows = check_queries(q, weights, limits, cu_seqlens_q, max_q, check_values)
    if block_table is not None:
        if key_starts is not None:
            raise ValueError("key_starts: only for contiguous keys (no block_table)")
        if seq_lens is None:
            raise ValueError("seq_lens: required with block_table")
        P = check_paged_keys(rows, k, k_scale, block_table, seq_lens, limits)
    else:
        key_starts = check_contiguous_keys(rows, k, k_scale, key_starts, limits)
        P = 0
    rows.finish(limits, need_max_limit=num_cols is None)
    L = check_size("num_cols", num_cols, rows.max_limit)
    phase, shape = logits_shape(rows, L, P)
    if config is None:
        config = LAUNCH.launch_config(phase, shape, rows.device)
    else:
        LAUNCH.validate(config, shape)
    strides = (q.stride(0), q.stride(1), weights.stride(0), k.stride(-2),
               block_table.stride(0) if block_table is not None else 0, L, 0)
    launch = LogitsLaunch(DENSE, rows.T, rows.H, rows.DK, rows.B, rows.max_q, L, strides, config, max(P, 1),
                          paged=block_table is not None)
    made_starts = block_table is None and key_starts_given is None
    return launch, made_cu(rows, cu_seqlens_q), key_starts if made_starts else None  # no caller's tensor


def made_cu(rows: QueryRows, cu_seqlens_q) -> torch.Tensor | None:
    """The ``cu`` a plan keeps: the one the checks made for ``cu_seqlens_q=None`` (never a caller's tensor)."""
    return rows.cu if cu_seqlens_q is None else None


def call_cu(made: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None) -> torch.Tensor:
    """The ``cu`` a call launches with: the plan's, or the caller's ``cu_seqlens_q``."""
    return made if cu_seqlens_q is None else cu_seqlens_q.contiguous()


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("indexer_logits")
def indexer_logits_op(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                      limits: torch.Tensor, num_cols: int, cu_seqlens_q: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                      key_starts: torch.Tensor | None = None, max_q: int | None = None, check_values: bool = True,
                      config: str | None = None) -> torch.Tensor:
    """:func:`dt.indexer_logits`: ``[T, num_cols]`` fp32. ``num_cols`` is required (``dt``'s default reads
    ``max(limits)``); with ``check_values=False`` give ``max_q`` too when ``cu_seqlens_q`` is given."""
    return indexer_logits(q, weights, k, k_scale, limits, cu_seqlens_q=cu_seqlens_q, block_table=block_table,
                          seq_lens=seq_lens, key_starts=key_starts, num_cols=num_cols, max_q=max_q,
                          check_values=check_values, config=op_config(config))


@indexer_logits_op.register_fake
def _(q, weights, k, k_scale, limits, num_cols, *args, **kwargs):
    return q.new_empty((q.shape[0], num_cols), dtype=torch.float32)


@dsa_op("indexer_logits_out", mutates_args=("out",))
def indexer_logits_out(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                       limits: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
                       block_table: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                       key_starts: torch.Tensor | None = None, max_q: int | None = None, check_values: bool = True,
                       config: str | None = None) -> None:
    """:func:`dt.indexer_logits` into ``out[T, num_cols]`` fp32 (contiguous; ``num_cols`` is its width)."""
    indexer_logits(q, weights, k, k_scale, limits, cu_seqlens_q=cu_seqlens_q, block_table=block_table,
                   seq_lens=seq_lens, key_starts=key_starts, num_cols=out_cols(out), max_q=max_q,
                   check_values=check_values, config=op_config(config), out=out)


@indexer_logits_out.register_fake
def _(q, weights, k, k_scale, limits, out, *args, **kwargs):
    return None
