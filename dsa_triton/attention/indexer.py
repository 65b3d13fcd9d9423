"""DSA indexer logits: ``score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) * k_scale[s]``.

One Triton kernel, :func:`_logits_kernel`, serves three jobs (a constexpr ``MODE``):

- ``DENSE``: token-level logits ``[T, L]`` over the paged FP8 K cache or contiguous FP8 keys. Rows are
  grouped by sequence; a program holds ``BLOCK_M`` rows x ``H`` heads of q (the stationary operand)
  and streams ``CHUNK`` keys of its sequence in tiles of ``BLOCK_N``: per tile one fp8 ``tl.dot``
  ``k[BLOCK_N, DK] x q^T[DK, BLOCK_M * H]``, relu, a weighted sum over the heads (within a thread's
  registers: heads are the dot's N axis), times the key scale. Decode (1-4 rows per sequence) puts all
  rows of a sequence in one program, so the K cache is read once for all of them; long sequences are
  split into chunks across programs (no combine step: output elements are independent).
- ``SELECTED``: the same logits, but only inside chosen pages: column ``c`` of row ``t`` is position
  ``pages[t, c // P] * P + c % P`` (used by :mod:`.block_scores`).
- ``BOUND``: an upper bound of each page's best score from the page summaries (``pmax``, ``pmin``):
  ``ub_h = q+ . pmax + q- . pmin >= max_k q_h . k``, ``lb_h = q+ . pmin + q- . pmax <= min_k q_h . k``,
  bound = ``sum_h max(w_h, 0) relu(ub_h) + min(w_h, 0) relu(lb_h)`` (used by :mod:`.block_scores`).
  One accumulator per head: ``w_h >= 0`` needs only ``ub_h``, ``w_h < 0`` only ``lb_h``, so q's sign parts
  are swapped per head and the tile is two chained dots (``pmax``, ``pmin``), then the same relu head-sum.

The chunk's pages are loaded before the tile loop and gathered per tile, so no key load depends on
another load in the loop and Triton pipelines them ``num_stages`` deep. Everything outside ``[0, limit[t])`` is ``-inf``. Every size (heads, head dim, page size) is a parameter.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .. import registry
from ..registry import Cost, KernelSpec
from ..checks import PlanCache
from ..runtime import interpreting
from . import indexer_reference
from ..hostmath import cdiv, next_pow2
from .cache_reference import fp8_quantize_rows
from .indexer_checks import QueryRows, check_contiguous_keys, check_paged_keys, check_queries, check_size
from .indexer_reference import indexer_logits_torch

DENSE, SELECTED, BOUND = 0, 1, 2
MAX_DECODE_ROWS = 4  # a sequence with at most this many query rows is the decode phase


@triton.jit
def _tile_keys(n0, c0, c_active, phys, lpages, key_start, max_limit,
               MODE: tl.constexpr, PAGED: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns ``n0 .. n0 + BLOCK_N`` of the chunk starting at ``c0``: ``(cols, col_ok, logical
    positions, physical key rows)``; ``phys`` / ``lpages`` hold the chunk's physical / logical pages."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < c_active
    if MODE == 2:  # BOUND: a column is a page
        pos = cols * P
        krow = tl.gather(phys, tl.minimum(cols - c0, phys.shape[0] - 1), 0).to(tl.int64)
    elif PAGED:
        slot = tl.minimum(cols // P - c0 // P, phys.shape[0] - 1)
        if MODE == 1:  # SELECTED
            lpage = tl.gather(lpages, slot, 0)
            pos = lpage * P + cols % P
            col_ok = col_ok & (lpage >= 0) & (pos < max_limit)
        else:
            pos = cols
        krow = tl.gather(phys, slot, 0).to(tl.int64) * P + cols % P
    else:
        pos = cols
        krow = key_start + pos
    return cols, col_ok, pos, krow


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, k_ptr, k2_ptr, ks_ptr, out_ptr, pos_ptr,
    limit_ptr, cu_ptr, table_ptr, kstart_ptr, pages_ptr,
    H, n_cols,
    stride_qt, stride_qh, stride_wt, stride_k, stride_table, stride_out, stride_pages,
    MODE: tl.constexpr, PAGED: tl.constexpr, P: tl.constexpr,
    DK: tl.constexpr, HP: tl.constexpr, DKP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, NPG: tl.constexpr,
    BOUND_DTYPE: tl.constexpr,
):
    """Program (sequence, row block, column chunk). Sequence g owns query rows cu[g]..cu[g+1]."""
    g = tl.program_id(0)
    row0 = tl.load(cu_ptr + g)
    row1 = tl.load(cu_ptr + g + 1)
    m_start = row0 + tl.program_id(1) * BLOCK_M
    if m_start < row1:
        seq = g.to(tl.int64)
        rows = m_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row1
        limits = tl.load(limit_ptr + rows, mask=row_ok, other=0)

        # q rows r = m * HP + h (heads padded to HP with zero q and zero weight)
        offs_r = tl.arange(0, BLOCK_M * HP)
        q_row = m_start + offs_r // HP
        head = offs_r % HP
        r_ok = (q_row < row1) & (head < H)
        offs_d = tl.arange(0, DKP)
        d_ok = offs_d < DK
        q = tl.load(q_ptr + q_row[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + q_row.to(tl.int64) * stride_wt + head, mask=r_ok, other=0.0)
        if MODE == 2:  # BOUND: q split by sign (exact in bf16), the parts swapped where the weight is < 0
            qf = q.to(tl.float32)
            q_pos, q_neg = tl.maximum(qf, 0.0), tl.minimum(qf, 0.0)
            up = (w >= 0.0)[:, None]
            q_max = tl.trans(tl.where(up, q_pos, q_neg).to(BOUND_DTYPE))  # multiplies pmax
            q_min = tl.trans(tl.where(up, q_neg, q_pos).to(BOUND_DTYPE))  # multiplies pmin
        else:
            q_t = tl.trans(q)

        # columns this program computes; past the rows' largest limit (DENSE, BOUND) only -inf is stored
        c0 = tl.program_id(2) * CHUNK
        c_end = tl.minimum(c0 + CHUNK, n_cols)
        if MODE == 0:
            c_active = tl.minimum(c_end, tl.max(limits))
        elif MODE == 2:
            c_active = tl.minimum(c_end, tl.cdiv(tl.max(limits), P))
        else:
            c_active = c_end
        out_rows = out_ptr + rows.to(tl.int64) * stride_out
        # the chunk's NPG physical pages (BOUND: one per column), loaded before the loop: the loop's key
        # loads then depend on no load inside the loop, and Triton pipelines them num_stages deep
        slots = tl.arange(0, NPG)
        lpages = slots  # logical pages (SELECTED)
        key_start = 0  # first key row (contiguous keys)
        if MODE == 2:
            phys = tl.load(table_ptr + seq * stride_table + c0 + slots, mask=c0 + slots < c_active, other=0)
        elif MODE == 1:
            lpages = tl.load(pages_ptr + m_start.to(tl.int64) * stride_pages + c0 // P + slots,
                             mask=(c0 // P + slots) * P < c_end, other=-1)
            phys = tl.load(table_ptr + seq * stride_table + lpages, mask=lpages >= 0, other=0)
        elif PAGED:
            phys = tl.load(table_ptr + seq * stride_table + c0 // P + slots, mask=(c0 // P + slots) * P < c_active,
                           other=0)
        else:
            phys = slots
            key_start = tl.load(kstart_ptr + seq).to(tl.int64)
        max_limit = tl.max(limits)
        if MODE != 2:  # key scales, one tile ahead (the pipeliner only prefetches the dot's operands)
            _, next_ok, _, next_krow = _tile_keys(c0, c0, c_active, phys, lpages, key_start, max_limit,
                                                  MODE, PAGED, P, BLOCK_N)
            next_scale = tl.load(ks_ptr + next_krow, mask=next_ok, other=0.0)
        for n0 in range(c0, c_active, BLOCK_N):
            cols, col_ok, pos, krow = _tile_keys(n0, c0, c_active, phys, lpages, key_start, max_limit,
                                                 MODE, PAGED, P, BLOCK_N)
            k_mask = col_ok[:, None] & d_ok[None, :]
            k_off = krow[:, None] * stride_k + offs_d[None, :]
            if MODE == 2:
                k_max = tl.load(k_ptr + k_off, mask=k_mask, other=0.0).to(BOUND_DTYPE)
                k_min = tl.load(k2_ptr + k_off, mask=k_mask, other=0.0).to(BOUND_DTYPE)
                # w >= 0: ub = q+ . pmax + q- . pmin; w < 0: lb = q- . pmax + q+ . pmin (exact products)
                s = tl.maximum(tl.dot(k_min, q_min, tl.dot(k_max, q_max)), 0.0) * w[None, :]
            else:
                k = tl.load(k_ptr + k_off, mask=k_mask, other=0.0)
                k_scale = next_scale
                _, next_ok, _, next_krow = _tile_keys(n0 + BLOCK_N, c0, c_active, phys, lpages, key_start,
                                                      max_limit, MODE, PAGED, P, BLOCK_N)
                next_scale = tl.load(ks_ptr + next_krow, mask=next_ok, other=0.0)
                s = tl.maximum(tl.dot(k, q_t), 0.0) * w[None, :]  # [BLOCK_N, BLOCK_M * HP]
            if BLOCK_M == 1:  # heads are the dot's N axis: the sum stays within a thread and its quad
                s = tl.sum(s, axis=1)[:, None]
            else:
                s = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, HP)), axis=2)  # [BLOCK_N, BLOCK_M]
            if MODE != 2:
                s = s * k_scale[:, None]
            valid = col_ok[:, None] & (pos[:, None] < limits[None, :])
            s = tl.where(valid, s, float("-inf"))
            tl.store(out_rows[None, :] + cols[:, None], s, mask=row_ok[None, :] & (cols < c_end)[:, None])
            if MODE == 1:
                tl.store(pos_ptr + m_start.to(tl.int64) * stride_out + cols, tl.where(col_ok, pos, -1), mask=cols < c_end)
        fill_start = c0 + tl.cdiv(tl.maximum(c_active - c0, 0), BLOCK_N) * BLOCK_N
        for n0 in range(fill_start, c_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_rows[None, :] + cols[:, None], tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32),
                     mask=row_ok[None, :] & (cols < c_end)[:, None])


class LogitsLaunch:
    """One :func:`_logits_kernel` launch but its tensors: grid, sizes, strides and constexprs, worked out
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
            _logits_kernel[self.grid](q, w, k, k2, k_scale, out, positions, limits, cu, block_table, key_starts, pages,
                                      *self.args, **self.meta)
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
        check_values: check limits, lengths and block-table entries on the device (one transfer);
            ``False`` skips them, and with ``num_cols`` and ``max_q`` given the call never waits on
            the device (CUDA-graph safe). Shapes, dtypes and devices are always checked.
        config: launch parameters (default: the tuning database / the registry default).
    """
    key = plan = None
    if not check_values and num_cols is not None and (cu_seqlens_q is None or max_q is not None):  # no device value
        key, plan = _PLANS.find((q, weights, k, k_scale, limits, cu_seqlens_q, block_table, seq_lens, key_starts),
                                (num_cols, max_q), config)
    if plan is None:
        plan = _PLANS.put(key, _checked_plan(q, weights, k, k_scale, limits, cu_seqlens_q, block_table, seq_lens,
                                             key_starts, num_cols, max_q, check_values, config))
    launch, cu, starts = plan
    cu = call_cu(cu, cu_seqlens_q)
    starts = starts if key_starts is None else key_starts.contiguous()
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
        config = SPEC.launch_config(phase, shape, rows.device)
    else:
        SPEC.validate(config, shape)
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


# -- registry entry -------------------------------------------------------------------------------

def random_queries(T: int, H: int, DK: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 queries ``[T, H, DK]`` and weights ``[T, H]`` with the q scales folded in, as DeepSeek-V3.2
    does; on the generator's device."""
    q8, q_scale = fp8_quantize_rows(torch.randn(T, H, DK, generator=g, device=g.device))
    w = torch.randn(T, H, generator=g, device=g.device) * q_scale * (H * DK) ** -0.5
    return q8, w


def random_fp8_rows(n: int, DK: int, g: torch.Generator, chunk: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random FP8 key rows ``[n, DK]`` and their scales ``[n]`` on the generator's device, made
    ``chunk`` rows at a time (bounded temporaries at 8M keys)."""
    k8 = torch.empty(n, DK, dtype=torch.float8_e4m3fn, device=g.device)
    scale = torch.empty(n, dtype=torch.float32, device=g.device)
    for r in range(0, n, chunk):
        k8[r:r + chunk], scale[r:r + chunk] = fp8_quantize_rows(
            torch.randn(min(chunk, n - r), DK, generator=g, device=g.device, dtype=torch.bfloat16))
    return k8, scale


def random_paged_keys(B: int, L: int, P: int, DK: int, g: torch.Generator, spare_pages: int = 1):
    """A poisoned FP8 K cache ``(k, k_scale, block_table, seq_lens)`` holding ``L`` random keys for each
    of ``B`` sequences on shuffled pages (every slot no sequence owns is NaN)."""
    device = g.device
    pages_per_seq = cdiv(L, P)
    num_pages = B * pages_per_seq + spare_pages
    k8, scale = random_fp8_rows(num_pages * P, DK, g)
    k, k_scale = k8.view(num_pages, P, DK), scale.view(num_pages, P)
    table = torch.randperm(num_pages, generator=g, device=device)[: B * pages_per_seq].view(B, pages_per_seq).int()
    unused = torch.ones(num_pages * P, dtype=torch.bool, device=device)
    pos = torch.arange(L, device=device)
    unused[(table.long()[:, pos // P] * P + pos % P).reshape(-1)] = False
    k.view(-1, DK).view(torch.uint8)[unused] = 0x7F  # e4m3 NaN
    k_scale.view(-1)[unused] = float("nan")
    return k, k_scale, table, torch.full((B,), L, dtype=torch.int32, device=device)


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    B, Q, L, P, H, DK = (shape[n] for n in ("B", "Q", "L", "P", "H", "DK"))
    q, w = random_queries(B * Q, H, DK, g)
    # row j of a sequence's Q rows sees the first L - Q + 1 + j keys (causal, the last chunk of a prefill)
    limits = (L - Q + 1 + torch.arange(Q, device=device)).clamp_min(0).repeat(B).int()
    cu = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=device)
    inputs = {"q": q, "weights": w, "limits": limits, "cu_seqlens_q": cu, "num_cols": L, "max_q": Q}
    if P:
        inputs["k"], inputs["k_scale"], inputs["block_table"], inputs["seq_lens"] = random_paged_keys(B, L, P, DK, g)
    else:
        inputs["k"], inputs["k_scale"] = random_fp8_rows(B * L, DK, g)
        inputs["key_starts"] = torch.arange(0, B * L, L, dtype=torch.int32, device=device)
    return inputs


def _call_args(inputs: dict) -> tuple[tuple, dict]:
    kw = {n: inputs[n] for n in ("cu_seqlens_q", "block_table", "seq_lens", "key_starts", "num_cols") if n in inputs}
    return (inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"], inputs["limits"]), kw


def _run(inputs: dict, config: dict) -> torch.Tensor:
    """The kernel as a decode loop calls it: sizes given, value checks off (the inputs are valid)."""
    args, kw = _call_args(inputs)
    return indexer_logits(*args, **kw, max_q=inputs["max_q"], check_values=False, config=config)


def _reference(inputs: dict, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    args, kw = _call_args(inputs)
    kw.pop("seq_lens", None)
    return indexer_logits_torch(*args, kw.pop("num_cols"), **kw, compute_dtype=compute_dtype)


def compare_logits(out: torch.Tensor, ref: torch.Tensor, rtol: float = 2e-3) -> str | None:
    """Same shape, ``-inf`` at the same places, no NaN, finite values within ``rtol`` of the row's scale."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if bool(out.isnan().any()):
        return f"{int(out.isnan().sum())} NaN in the output"
    if not torch.equal(out.isneginf(), ref.isneginf()):
        return f"-inf at {int((out.isneginf() != ref.isneginf()).sum())} places that differ from the reference"
    finite = ref.isfinite()
    scale = ref.where(finite, 0.0).abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    err = ((out - ref).where(finite, 0.0).abs() / scale).max().item() if out.numel() else 0.0
    return None if err <= rtol else f"max error {err:.2e} of the row scale (tolerance {rtol:.0e})"


def _cost(phase: str, shape) -> Cost:
    B, Q, L, H, DK = (shape[n] for n in ("B", "Q", "L", "H", "DK"))
    T = B * Q
    pairs = B * sum(max(0, L - Q + 1 + j) for j in range(Q))  # valid (row, key) pairs
    key_bytes = B * L * (DK + 4)
    return Cost(bytes=key_bytes + T * H * (DK + 4) + T * L * 4, flops=2.0 * pairs * H * DK, flop_dtype="fp8")


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    if gpu:
        if phase == "decode":
            return [{"B": 64, "Q": 1, "L": 131072, "P": 64, "H": 64, "DK": 128},
                    {"B": 64, "Q": 2, "L": 131072, "P": 64, "H": 64, "DK": 128}]
        return [{"B": 1, "Q": 4096, "L": 16384, "P": 0, "H": 64, "DK": 128}]
    if phase == "decode":
        return [{"B": 3, "Q": 2, "L": 70, "P": 16, "H": 8, "DK": 32}]
    return [{"B": 2, "Q": 9, "L": 40, "P": 0, "H": 8, "DK": 32}]


def _default(phase: str, shape) -> dict:
    """H200 sweep, 2026-11-30: decode Q=1 256-key tiles x 8 warps 294 us (0.91 of the byte floor; 128 x 4
    warps within 3%), Q=2 2 rows x 64 keys 405 us; prefill 2 rows x 64 keys 1111 us (0.67 of fp8)."""
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
    tiles plus as many stationary q^T tiles over the shared memory (sm_90 compiles: 56 KB for decode
    tiles of 128 keys x 3 stages, 130 KB for bound tiles of 64 pages x 3 stages)."""
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


SPEC = registry.register(KernelSpec(
    name="indexer_logits",
    phases=("prefill", "decode"),
    space={"BLOCK_M": (1, 2, 4), "BLOCK_N": (32, 64, 128, 256), "CHUNK": (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536),
           "num_warps": (4, 8), "num_stages": (1, 2, 3, 4)},
    default=_default,
    fixed_dims=("P", "H", "DK"),
    bucketed_dims=("B", "Q", "L"),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_logits,
    cost=_cost,
    bench_shapes=_bench_shapes,
    constraint=_constraint,
    baseline=lambda inputs: _reference(inputs, torch.bfloat16),
    baseline_name="torch dequantize + bf16 einsum",
    source_modules=(indexer_reference, sys.modules[__name__]),
))
