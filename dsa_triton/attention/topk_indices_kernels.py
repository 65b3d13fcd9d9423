"""The three Triton kernels of :func:`~dsa_triton.topk_indices` (exact per-row top-k over fp32 scores, radix select).

Scores become int32 *sort keys* (integer order = float order, NaN -> -inf; see ``topk_indices_reference``).
A row of ``n`` selectable positions takes one of three routes, decided inside the kernels (no host sync):

- ``n <= k``: every position is taken.
- ``k < n < min(ROUTE_MIN * k, 2 * k * GROUP)`` (short rows): pass 3 alone, over the row (one program per row).
- longer rows: two passes over the scores, then pass 3 over a few thousand candidates:
  1. *bound* (grid ``T x SPLIT``): each tile is ``GROUP`` x ``TILE / GROUP``; histogram the column
     maxima in ``2^HIST_BITS`` bins. The lower edge ``tau`` of the bin holding the k-th largest maximum
     is a sure bound: at least k columns, hence k scores, are ``>= tau``; for smooth data only ~1.2 k
     are. The histogram sees 1/GROUP of the scores, which keeps this pass at memory speed. Rows with
     fewer than ``2 * k`` groups (``n < 2 * k * GROUP``) histogram every score instead (the same bound,
     counted on scores): a mixed-length batch then keeps its mid-length rows off the one-program route.
     Bins are
     linear in the sort key over a window read off a fixed sample of the row, so they stay fine for any
     shift or scale of the scores (bins on the top key bits, i.e. the float exponent, would put the top
     of N(100, 1) or of U(0, 1) into one bin and overflow the buffer); a window across zero gets bins
     linear in the value (keys spend it on the tiny magnitudes: see :func:`_bin_window`).
  2. *collect* (grid ``T x SPLIT``): append every score ``>= tau`` and its position to the row's candidate
     buffer of ``CAP_K * k`` entries (one atomic per tile), and keep the largest. Correctness never
     rests on the bound: pass 3 uses the buffer only when it holds at least k and at most ``CAP_K * k``
     scores (then it holds the top k) and ``tau`` is above -inf (NaN, skipped here, ties with -inf), and
     otherwise goes over the row (ties, clustered values, NaN).
  3. *select* (grid ``T``): radix select, ``SEL_BITS`` per digit, from the top bit of the candidates'
     span above ``tau`` (32 bits over a whole row). Once the scores left on the threshold's prefix fit
     the buffer they are compacted into it (those above it are written out); once at most ``PAIR``
     are left, the k-th largest among them comes from all-pairs comparisons. Without either (ties),
     a last sweep writes the scores above the k-th largest and enough equal ones to reach k. Among scores
     equal to the k-th largest the lowest positions are taken: the row and its compaction keep position
     order; pass 2's candidates do not, and their ties go through a radix select on the positions. Then the
     optional block-table translation and -1 padding.

Workspace: one int32 allocation, no memset: pass-1 partial histograms ``[T, SPLIT, NB]`` (every bin
written), per-row ``info[T, 8]`` (written by pass 1's first program of the row, see ``INFO_*``), and
the candidates ``[T, cap]`` int64, each ``position << 32 | fp32 bits``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import topk_indices_reference

_INVALID = tl.constexpr(topk_indices_reference.INVALID_KEY)
_NEG_INF_KEY = tl.constexpr(topk_indices_reference.NEG_INF_KEY)
# info[t, :]: the pass-1 bin window (key_lo, shift), the candidate count, the largest candidate's key,
# ``tau``'s key minus one (every candidate's key is above it, -0.0 included when tau is +0.0), and the window
# of value bins (lo, step: fp32 bits; step 0 for key bins)
INFO_KEY_LO, INFO_SHIFT, INFO_COUNT, INFO_MAX, INFO_BASE, INFO_LO, INFO_STEP = (tl.constexpr(i) for i in range(7))
INFO_WORDS = tl.constexpr(8)


@triton.jit
def _sort_key(bits):
    """fp32 bit patterns (int32) -> int32 keys ordered like the floats; NaN gets the key of -inf."""
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, _NEG_INF_KEY, key)


@triton.jit
def _row_length(lengths, t, L, HAS_LENGTHS: tl.constexpr):
    """Selectable positions of row t: ``lengths[t]`` clamped to ``[0, L]`` (or L)."""
    n = tl.full([], 0, tl.int32) + L
    if HAS_LENGTHS:
        n = tl.minimum(tl.maximum(tl.load(lengths + t), 0), n)
    return n


@triton.jit
def _select_bin(hist, need, NB: tl.constexpr):
    """Largest bin d with ``count(bins >= d) >= need`` (-1 if none), and ``count(bins > d)``."""
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    d = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(tl.arange(0, NB) > d, hist, 0), 0)
    return d, above


@triton.jit
def _bit_length(x):
    """Bits needed for ``x >= 0`` (int64 scalar)."""
    return tl.sum(((x >> tl.arange(0, 64).to(tl.int64)) > 0).to(tl.int32), 0)


@triton.jit
def _ascending_at(x, r, N: tl.constexpr, BY_COUNT: tl.constexpr):
    """The value of ascending rank ``r`` (0-based) of ``x[N]`` (no NaN): read off ``tl.sort``, or with ``BY_COUNT``
    (the interpreter, where ``tl.sort`` is slow) the one whose count of smaller values, ties broken
    by index, is ``r``: the same value, from one ``[N, N]`` comparison."""
    i = tl.arange(0, N)
    if BY_COUNT:
        below = (x[None, :] < x[:, None]) | ((x[None, :] == x[:, None]) & (i[None, :] < i[:, None]))
        rank = tl.sum(below.to(tl.int32), axis=1)
    else:
        x = tl.sort(x)
        rank = i
    return tl.sum(tl.where(rank == r, x, 0.0), 0)


@triton.jit
def _bin_window(row, n, k, every, HIST_BITS: tl.constexpr, SCORE_HIST: tl.constexpr, BY_COUNT: tl.constexpr):
    """Pass 1's bins for a row: ``(key_lo, shift, lo, step)`` (see :func:`_bin`), from a fixed sample of the row.

    The sample (32 pieces of 16 scores, evenly spread) is the same in every program of the row, so all
    agree. ``key_lo`` is the third smallest finite piece maximum (one or two outlying pieces, e.g. a
    negative one among positive scores, would stretch the window over the tiny magnitudes); the bins
    cover twice the key span from there to the largest finite sample. Without three finite pieces: the
    top ``HIST_BITS`` key bits. A row whose every score is counted (``every``) starts the window lower, at
    the score of rank ``2 k / n`` from the top of a 128-score sample (the first 4 of each piece): its k-th
    largest score is that low (k/n from 1/64 up to 1/2), below most piece maxima, and a window above it
    would put tau at -inf and collect the whole row.

    A row that histograms group maxima and whose window runs from ``lo <= 0`` to ``hi > 0`` gets bins linear in
    the value instead (``step > 0``): ``NB - 2`` bins of ``step = (hi - lo) / 2^(HIST_BITS - 1)`` from ``lo``. Linear
    in the key, such a window spends nearly all of its bins on the magnitudes near zero (between -0.4 and 0.5 lie
    the keys of every float down to 1e-38, about 250 binades of 2^23 keys), so a bin spans about two binades:
    mostly negative rows of indexer scores (DeepSeek-V3.2's head weights have either sign) put tau binades below
    the k-th largest score, and on long rows their candidates overflow the buffer into the one-program route over
    the whole row. Rows that histogram every score keep key bins: their window starts near their 2k-th largest
    score, so tau >= lo already bounds the count.
    """
    NB: tl.constexpr = 1 << HIST_BITS
    offs = tl.arange(0, 32)[:, None] * (n // 32) + tl.arange(0, 16)[None, :]
    x = tl.load(row + offs, mask=offs < n, other=float("-inf"))
    piece_max = tl.max(tl.where(tl.abs(x) < float("inf"), x, float("-inf")), axis=1)  # NaN, +-inf out
    lo = _ascending_at(tl.where(piece_max > float("-inf"), piece_max, float("inf")), 2, 32, BY_COUNT)
    if SCORE_HIST:
        if every:  # (rows that histogram group maxima skip the sample)
            at = (tl.arange(0, 128) // 4) * (n // 32) + tl.arange(0, 128) % 4
            s = tl.load(row + at, mask=at < n, other=float("-inf"))
            s = tl.where(tl.abs(s) < float("inf"), s, float("-inf"))
            finite_count = tl.sum((s > float("-inf")).to(tl.int32), 0)
            rank = tl.minimum(2 * k * 128 // tl.maximum(n, 1), finite_count - 1)
            lo_of_scores = _ascending_at(s, 127 - rank, 128, BY_COUNT)  # the one of that rank from the top
            lo = tl.where(finite_count >= 3, lo_of_scores, lo)
    hi = tl.max(piece_max, axis=0)
    key_lo = _sort_key(lo.to(tl.int32, bitcast=True))
    span = 2 * (_sort_key(hi.to(tl.int32, bitcast=True)).to(tl.int64) - key_lo)
    shift = tl.sum(((span >> tl.arange(0, 64).to(tl.int64)) >= NB - 2).to(tl.int32), 0)
    found = lo <= hi
    width = hi - lo
    by_value = found & (not every) & (lo <= 0.0) & (hi > 0.0) & (width > 2.0**-100) & (width < 2.0**120)
    step = tl.where(by_value, width / (1 << (HIST_BITS - 1)), 0.0)  # (by a power of two: exact)
    return tl.where(found, key_lo, -(2**31)), tl.where(found, shift, 32 - HIST_BITS), tl.where(by_value, lo, 0.0), step


@triton.jit
def _bin(key, key_lo, shift, NB: tl.constexpr):
    """Bin of sort keys: 0 below ``key_lo``, else ``min((key - key_lo) >> shift, NB - 2) + 1``."""
    d = key.to(tl.int64) - key_lo
    return tl.where(d < 0, 0, tl.minimum(d >> shift, NB - 2) + 1).to(tl.int32)


@triton.jit
def _value_bin(x, lo, step, NB: tl.constexpr):
    """Value bin of scores (``step > 0``): 0 below ``lo`` (and NaN), else ``min(floor((x - lo) / step), NB - 2) + 1``,
    from the clamped score times ``1 / step``: no inf or NaN arises, and the bin is monotone in ``x``, which is all
    that :func:`_bound` needs."""
    top = lo + (NB - 1) * step
    clamped = tl.where(x >= lo, tl.where(x < top, x, top), lo)
    inv = 1.0 / tl.where(step > 0.0, step, 1.0)
    return tl.where(x >= lo, tl.minimum(((clamped - lo) * inv).to(tl.int32), NB - 2) + 1, 0)


@triton.jit
def _hist_of_group_max(x, key_lo, shift, lo, step, NB: tl.constexpr, mask):
    """Histogram of the column maxima of an ``x[GROUP, COLS]`` tile (NaN-ignoring; all-NaN is -inf), in key bins
    or (``step > 0``) value bins."""
    m = tl.max(x, axis=0)
    bins = _bin(_sort_key(m.to(tl.int32, bitcast=True)), key_lo, shift, NB)
    bins = tl.where(step > 0.0, _value_bin(m, lo, step, NB), bins)
    return tl.histogram(bins, NB, mask=mask)


@triton.jit
def _hist_of_scores(x, key_lo, shift, NB: tl.constexpr, mask):
    """Histogram of every score of an ``x[GROUP, COLS]`` tile (NaN as -inf); ``mask``: the scores to count."""
    size: tl.constexpr = x.shape[0] * x.shape[1]
    bins = tl.reshape(_bin(_sort_key(x.to(tl.int32, bitcast=True)), key_lo, shift, NB), [size])
    if mask is None:
        hist = tl.histogram(bins, NB)
    else:
        hist = tl.histogram(bins, NB, mask=tl.reshape(mask, [size]))
    return hist


@triton.jit
def _tile_hist(x, every, key_lo, shift, lo, step, NB: tl.constexpr, col_mask, score_mask, SCORE_HIST: tl.constexpr):
    """Pass 1's histogram of a tile: of every score when ``every`` (only compiled in with ``SCORE_HIST``),
    else of the column maxima; ``col_mask`` / ``score_mask``: the columns / scores to count (None: all)."""
    if SCORE_HIST:
        if every:
            hist = _hist_of_scores(x, key_lo, shift, NB, score_mask)
        else:
            hist = _hist_of_group_max(x, key_lo, shift, lo, step, NB, col_mask)
    else:
        hist = _hist_of_group_max(x, key_lo, shift, lo, step, NB, col_mask)
    return hist


@triton.jit(do_not_specialize=["L", "route_min", "group_min", "k", "info_off"])
def topk_bound_kernel(scores, stride_t, L, lengths, work, info_off, chunk, route_min, group_min, k,
                       HAS_LENGTHS: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr,
                       HIST_BITS: tl.constexpr, SCORE_HIST: tl.constexpr, BY_COUNT: tl.constexpr):
    """Pass 1, grid (T, SPLIT): the histogram of the group maxima (rows of at least ``group_min``
    scores) or of the scores (rows of ``route_min`` to ``group_min``) of the chunk into its slot of the
    row's partial histograms; the row's first program also writes its ``info`` (window, zero count).

    Group g of a tile is column g of ``GROUP`` x ``COLS`` scores: its max is a reduction inside one
    thread. Full tiles load without a mask (16-byte loads); the chunk's last, partial tile with one.
    """
    t = tl.program_id(0)
    split = tl.program_id(1)
    n = _row_length(lengths, t, L, HAS_LENGTHS)
    if n >= route_min:
        every = n < group_min
        NB: tl.constexpr = 1 << HIST_BITS
        STEP: tl.constexpr = GROUP * COLS
        row = scores + t.to(tl.int64) * stride_t
        key_lo, shift, v_lo, step = _bin_window(row, n, k, every, HIST_BITS, SCORE_HIST, BY_COUNT)
        if split == 0:
            info = work + info_off + t * INFO_WORDS
            tl.store(info + INFO_KEY_LO, key_lo)
            tl.store(info + INFO_SHIFT, shift)
            tl.store(info + INFO_LO, v_lo.to(tl.int32, bitcast=True))
            tl.store(info + INFO_STEP, step.to(tl.int32, bitcast=True))
            tl.store(info + INFO_COUNT, 0)
            tl.store(info + INFO_MAX, _INVALID)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n)
        full_end = lo + tl.maximum(hi - lo, 0) // STEP * STEP
        cols = tl.arange(0, COLS)
        tile = tl.arange(0, GROUP)[:, None] * COLS + cols[None, :]
        acc = tl.zeros([NB], tl.int32)
        for start in range(lo, full_end, STEP):
            acc += _tile_hist(tl.load(row + start + tile), every, key_lo, shift, v_lo, step, NB, None, None,
                              SCORE_HIST)
        if full_end < hi:
            x = tl.load(row + full_end + tile, mask=full_end + tile < hi, other=float("-inf"))
            acc += _tile_hist(x, every, key_lo, shift, v_lo, step, NB, full_end + cols < hi, full_end + tile < hi,
                              SCORE_HIST)
        slot = t.to(tl.int64) * tl.num_programs(1) + split
        tl.store(work + slot * NB + tl.arange(0, NB), acc)


@triton.jit
def _bound(work, info, t, k, SPLIT: tl.constexpr, HIST_BITS: tl.constexpr):
    """Lower edge ``tau`` of the bin holding the k-th largest counted value (group maximum or score) of row t,
    as a float. ``-inf`` for the bin below the window; NaN (collects nothing) when fewer than k were counted.
    Value bins: the edge less 1/16 of a bin (below every value of the bin, whatever the rounding of ``x - lo``).
    """
    NB: tl.constexpr = 1 << HIST_BITS
    parts = t.to(tl.int64) * SPLIT * NB + tl.arange(0, SPLIT)[:, None] * NB + tl.arange(0, NB)[None, :]
    d, _ = _select_bin(tl.sum(tl.load(work + parts), axis=0), k, NB)
    key_lo = tl.load(info + INFO_KEY_LO).to(tl.int64)
    shift = tl.load(info + INFO_SHIFT)
    key = tl.where(d > 0, key_lo + ((d - 1).to(tl.int64) << shift), _NEG_INF_KEY).to(tl.int32)
    tau = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)  # the key map is its own inverse
    step = tl.load(info + INFO_STEP).to(tl.float32, bitcast=True)
    tau_value = tl.load(info + INFO_LO).to(tl.float32, bitcast=True) + ((d - 1).to(tl.float32) - 0.0625) * step
    tau = tl.where((d > 0) & (step > 0.0), tau_value, tau)
    return tl.where(d >= 0, tau, float("nan"))


@triton.jit
def _append(x, offs, tau, counter, cand, cap, col_max):
    """Append the scores ``x >= tau`` of a ``[COLS, ROWS]`` tile, packed with their positions, to a row's
    candidates; returns ``col_max`` updated with the largest taken score per column.

    A column belongs to one thread: ranks come from an in-thread scan down the columns and one scan across
    them; one atomic per tile.
    """
    take = x >= tau
    counts = take.to(tl.int32)
    col_total = tl.sum(counts, axis=1)
    base = tl.atomic_add(counter, tl.sum(col_total, axis=0), sem="relaxed")
    pos = base + (tl.cumsum(col_total, axis=0) - col_total)[:, None] + tl.cumsum(counts, axis=1) - 1
    packed = (offs.to(tl.int64) << 32) | (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.store(cand + pos, packed, mask=take & (pos < cap))
    return tl.maximum(col_max, tl.max(tl.where(take, x, float("-inf")), axis=1))


@triton.jit(do_not_specialize=["L", "k", "route_min", "cap", "info_off", "cand_off"])
def topk_collect_kernel(scores, stride_t, L, lengths, work, info_off, cand_off, k, chunk, route_min, cap,
                         HAS_LENGTHS: tl.constexpr, TILE: tl.constexpr, WARPS: tl.constexpr,
                         SPLIT: tl.constexpr, HIST_BITS: tl.constexpr):
    """Pass 2, grid (T, SPLIT): append scores ``>= tau`` to row t's candidates; the largest one's key.

    NaN scores are skipped: they rank as -inf, and a row whose top k needs them overflows to pass 3's
    route over the whole row (as does every row whose ``tau`` is -inf: NaN ties with -inf there). A tile is
    ``COLS = 32 * WARPS`` columns by ``TILE / COLS`` rows (score ``r * COLS + c`` at ``[c, r]``), a column per
    thread; scalar loads (declared non-contiguous) keep loads, ranks and scattered stores in one layout. Full tiles
    load without a mask, the next one before this one's atomic returns.
    """
    t = tl.program_id(0)
    n = _row_length(lengths, t, L, HAS_LENGTHS)
    if n >= route_min:
        COLS: tl.constexpr = 32 * WARPS
        info = work + info_off + t * INFO_WORDS
        tau = _bound(work, info, t, k, SPLIT, HIST_BITS)
        if tl.program_id(1) == 0:
            tl.store(info + INFO_BASE, _sort_key(tau.to(tl.int32, bitcast=True)) - 1)
        row = scores + t.to(tl.int64) * stride_t
        cand = (work + cand_off).to(tl.pointer_type(tl.int64)) + t.to(tl.int64) * cap
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, n)
        full_end = lo + tl.maximum(hi - lo, 0) // TILE * TILE
        tile = tl.max_contiguous(tl.arange(0, COLS)[:, None] + tl.arange(0, TILE // COLS)[None, :] * COLS, [1, 1])
        col_max = tl.full([COLS], float("-inf"), tl.float32)
        x = tl.load(row + lo + tile, mask=lo < full_end)
        for start in range(lo, full_end, TILE):
            x_next = tl.load(row + start + TILE + tile, mask=start + TILE < full_end)
            col_max = _append(x, start + tile, tau, info + INFO_COUNT, cand, cap, col_max)
            x = x_next
        if full_end < hi:
            x = tl.load(row + full_end + tile, mask=full_end + tile < hi, other=float("nan"))
            col_max = _append(x, full_end + tile, tau, info + INFO_COUNT, cand, cap, col_max)
        top = tl.max(col_max, axis=0)
        if top >= tau:
            tl.atomic_max(info + INFO_MAX, _sort_key(top.to(tl.int32, bitcast=True)), sem="relaxed")


@triton.jit
def _load_source(row, buf, from_buf, start, n_src, base, TILE: tl.constexpr):
    """Entries ``start .. start + TILE`` (< n_src) of the buffer or the row: packed candidates, their
    keys relative to ``base`` (uint32 ``key - base``), the mask and the row positions."""
    offs = start + tl.arange(0, TILE)
    ok = offs < n_src
    packed = tl.load(buf + offs, mask=ok & from_buf, other=0)
    bits = tl.load(row + offs, mask=ok & (not from_buf), other=0.0).to(tl.int32, bitcast=True)
    bits = tl.where(from_buf, packed.to(tl.int32), bits)
    idx = tl.where(from_buf, (packed >> 32).to(tl.int32), offs)
    packed = (idx.to(tl.int64) << 32) | (bits.to(tl.int64) & 0xFFFFFFFF)
    return packed, _sort_key(bits).to(tl.uint32, bitcast=True) - base, ok, idx


@triton.jit
def _position_hist(idx, on, n, v_thr, v_hi, shift, NB: tl.constexpr):
    """Histogram of the digit ``[shift, v_hi)`` of ``v = n - 1 - idx`` (larger for lower positions ``idx < n``) over
    the entries ``on`` whose ``v`` has ``v_thr``'s bits at and above ``v_hi`` (at most 31)."""
    v = n - 1 - idx
    on = on & ((v >> v_hi) == (v_thr >> v_hi))
    return tl.histogram((v >> shift) & ((1 << (v_hi - shift)) - 1), NB, mask=on)


@triton.jit
def _lowest_positions(idx, on, count, n, SEL_BITS: tl.constexpr):
    """The ``count``-th lowest (``count >= 1``) of the distinct positions ``idx < n`` where ``on``, a vector in
    registers: a radix select of ``v = n - 1 - idx``, ``SEL_BITS`` a digit from the top."""
    NB: tl.constexpr = 1 << SEL_BITS
    v_thr = tl.full([], 0, tl.int32)
    v_hi = _bit_length((n - 1).to(tl.int64))
    while v_hi > 0:
        shift = tl.maximum(v_hi - SEL_BITS, 0)
        d, above = _select_bin(_position_hist(idx, on, n, v_thr, v_hi, shift, NB), count, NB)
        count -= above
        v_thr = v_thr | (d << shift)
        v_hi = shift
    return n - 1 - v_thr


@triton.jit
def _write_indices(out_row, pos, idx, mask, table_row, page_size, HAS_TABLE: tl.constexpr):
    """``out_row[pos] = idx`` where mask, translated to physical slots through the block table."""
    if HAS_TABLE:
        page = tl.load(table_row + idx // page_size, mask=mask, other=0)
        idx = page * page_size + idx % page_size
    tl.store(out_row + pos, idx, mask=mask)


@triton.jit(do_not_specialize=["L", "k", "route_min", "cap", "page_size", "info_off", "cand_off"])
def topk_select_kernel(scores, stride_t, L, lengths, work, info_off, cand_off, out, k, route_min, cap,
                        block_table, stride_bt, row_to_seq, page_size,
                        HAS_LENGTHS: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_ROW_TO_SEQ: tl.constexpr,
                        SEL_BITS: tl.constexpr, TILE: tl.constexpr, PAIR: tl.constexpr):
    """Pass 3, grid (T,): the k largest of row t's candidates or, on the other routes, of the row; among entries
    equal to the k-th largest, those of the lowest positions.

    Keys are taken relative to ``base`` (``u = key - base`` as uint32: every source key is above it);
    ``thr`` collects the digits of the k-th largest ``u`` from bit ``hi`` down. After a digit, when the entries left on
    ``thr``'s prefix fit the buffer and are at most half the source (or at most ``PAIR``), one sweep
    writes out those above the prefix and moves those on it to the buffer's front (in place when the
    source is the buffer: every entry moves to a lower slot of the tile already read). Ties by position: a sweep
    over the row, and a compaction of it, keep position order, so the first ties in source order are the lowest;
    pass 2's candidates are in no position order, so when more than ``PAIR`` of them tie with the k-th largest a
    radix select over their positions (``SEL_BITS`` a digit, lowest first, one sweep a digit) finds the last one
    taken; at most ``PAIR`` entries left find it in registers (no positions in the all-pairs comparisons).
    """
    t = tl.program_id(0)
    n = _row_length(lengths, t, L, HAS_LENGTHS)
    info = work + info_off + t * INFO_WORDS
    c = tl.load(info + INFO_COUNT)  # not written (garbage) when the row skipped passes 1-2: unused then
    # (tau = -inf: the candidates lack the NaN, which tie with -inf; pass 3 goes over the row)
    from_buf = (n >= route_min) & (c >= k) & (c <= cap) & (tl.load(info + INFO_BASE) != _NEG_INF_KEY - 1)
    by_position = not from_buf  # the source is in position order (the row, or the row compacted into the buffer)
    buf = (work + cand_off).to(tl.pointer_type(tl.int64)) + t.to(tl.int64) * cap
    row = scores + t.to(tl.int64) * stride_t
    n_src = tl.where(from_buf, c, n)
    base = tl.full([], -(2**31), tl.int32)
    hi = tl.full([], 32, tl.int32)  # bits of u at and above hi are fixed in thr
    if from_buf:
        base = tl.load(info + INFO_BASE)
        hi = _bit_length(tl.load(info + INFO_MAX).to(tl.int64) + 1 - base)  # +1: float max may pick -0.0
    base = base.to(tl.uint32, bitcast=True)
    seq = t
    if HAS_ROW_TO_SEQ:
        seq = tl.load(row_to_seq + t)
    table_row = block_table + seq.to(tl.int64) * stride_bt
    out_row = out + t.to(tl.int64) * k

    # n_above: entries whose u > thr on the fixed bits; need: how many on the prefix to take;
    # written: entries above the prefix already written by a compaction sweep.
    NB: tl.constexpr = 1 << SEL_BITS
    thr = tl.full([], 0, tl.uint32)
    n_above = tl.full([], 0, tl.int32)
    need = tl.full([], 0, tl.int32) + k
    written = tl.full([], 0, tl.int32)
    tied = n_src  # entries on thr's prefix (after the last digit: equal to the k-th largest)
    if n > k:
        while (hi > 0) & (n_src > PAIR):
            shift = tl.maximum(hi - SEL_BITS, 0)
            hist = tl.zeros([NB], tl.int32)
            for start in range(0, n_src, TILE):
                _, u, ok, _ = _load_source(row, buf, from_buf, start, n_src, base, TILE)
                ok = ok & ((u >> (hi - 1) >> 1) == (thr >> (hi - 1) >> 1))  # two steps: hi may be 32
                hist += tl.histogram(((u >> shift) & ((1 << (hi - shift)) - 1)).to(tl.int32), NB, mask=ok)
            d, above = _select_bin(hist, need, NB)
            on_prefix = tl.sum(tl.where(tl.arange(0, NB) == d, hist, 0), 0)
            tied = on_prefix
            n_above += above
            need -= above
            thr = thr | (d.to(tl.uint32) << shift)
            hi = shift
            if (on_prefix <= cap) & ((2 * on_prefix <= n_src) | (on_prefix <= PAIR)):
                kept = tl.full([], 0, tl.int32)
                for start in range(0, n_src, TILE):
                    packed, u, ok, idx = _load_source(row, buf, from_buf, start, n_src, base, TILE)
                    up = ok & ((u >> hi) > (thr >> hi))
                    keep = ok & ((u >> hi) == (thr >> hi))
                    ranks = tl.cumsum(up.to(tl.int32) + keep.to(tl.int32) * 65536, 0)
                    _write_indices(out_row, written + (ranks & 0xFFFF) - 1, idx, up, table_row, page_size,
                                   HAS_TABLE)
                    tl.store(buf + kept + (ranks >> 16) - 1, packed, mask=keep)
                    total = tl.sum(up.to(tl.int32) + keep.to(tl.int32) * 65536, 0)
                    written += total & 0xFFFF
                    kept += total >> 16
                tl.debug_barrier()  # the moved entries are read back by other threads
                from_buf = tl.full([], 1, tl.int1)
                n_src = kept
    if (n > k) & (n_src <= PAIR):
        # the entries left are those on thr's prefix: the need-th largest key among them (each one's count of keys at
        # or above it, from all-pairs comparisons), every entry above it, and the lowest positions of those equal
        _, u, ok, idx = _load_source(row, buf, from_buf, 0, n_src, base, PAIR)
        key = tl.where(ok, (u ^ 0x80000000).to(tl.int32, bitcast=True), -(2**31))  # same order, signed
        at_least = tl.sum((key[None, :] >= key[:, None]).to(tl.int32), axis=1)
        kth = tl.max(tl.where(ok & (at_least >= need), key, -(2**31)), 0)
        above = ok & (key > kth)
        tie = ok & (key == kth)
        wanted = need - tl.sum(above.to(tl.int32), 0)
        last = tl.full([], 2**31 - 1, tl.int32)
        if tl.sum(tie.to(tl.int32), 0) > wanted:  # more equal keys than places: the lowest positions
            last = _lowest_positions(idx, tie, wanted, n, SEL_BITS)
        take = above | (tie & (idx <= last))
        _write_indices(out_row, n_above + tl.cumsum(take.to(tl.int32), 0) - 1, idx, take, table_row, page_size,
                       HAS_TABLE)
    else:  # also rows with n <= k: every entry counts as above
        last = tl.full([], 2**31 - 1, tl.int32)  # ties at positions up to last are taken (the first need of them)
        if (n > k) & (not by_position) & (tied > need):
            # more than PAIR exact ties (all of u is fixed) in pass 2's order: the need-th lowest of their positions,
            # by a radix select of v = n - 1 - position over the source (the largest v first, as above)
            v_thr = tl.full([], 0, tl.int32)
            v_need = need
            v_hi = _bit_length((n - 1).to(tl.int64))  # at most 31
            while v_hi > 0:
                shift = tl.maximum(v_hi - SEL_BITS, 0)
                hist = tl.zeros([NB], tl.int32)
                for start in range(0, n_src, TILE):
                    _, u, ok, idx = _load_source(row, buf, from_buf, start, n_src, base, TILE)
                    hist += _position_hist(idx, ok & (u == thr), n, v_thr, v_hi, shift, NB)
                d, above = _select_bin(hist, v_need, NB)
                v_need -= above
                v_thr = v_thr | (d << shift)
                v_hi = shift
            last = n - 1 - v_thr
        done_ties = tl.full([], 0, tl.int32)
        for start in range(0, n_src, TILE):
            _, u, ok, idx = _load_source(row, buf, from_buf, start, n_src, base, TILE)
            above = ok & ((u > thr) | (n <= k))
            tie = ok & (u == thr) & (idx <= last)
            packed = above.to(tl.int32) + tie.to(tl.int32) * 65536  # two running ranks in one scan
            ranks = tl.cumsum(packed, 0)
            tie_rank = done_ties + (ranks >> 16) - 1
            take = above | (tie & (tie_rank < need))
            pos = tl.where(above, written + (ranks & 0xFFFF) - 1, n_above + tie_rank)
            _write_indices(out_row, pos, idx, take, table_row, page_size, HAS_TABLE)
            total = tl.sum(packed, 0)
            written += total & 0xFFFF
            done_ties += total >> 16
    for start in range(tl.minimum(n, k), k, TILE):
        offs = start + tl.arange(0, TILE)
        tl.store(out_row + offs, tl.full([TILE], -1, tl.int32), mask=offs < k)
