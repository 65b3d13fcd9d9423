"""dt.topk_indices in the interpreter against topk_indices_torch: every route of a row, ties, -inf, NaN,
block-table translation, bad input. Outputs start as -2 so an unwritten slot fails the check."""
import pytest
import torch

import dsa_triton as dt
from tuning_db import Database
from dsa_triton.attention import topk_indices as tk
from dsa_triton.attention.topk_indices_kernels import INFO_COUNT, INFO_KEY_LO, INFO_LO, INFO_SHIFT, INFO_STEP
from dsa_triton.attention.topk_indices_reference import check_topk, emulate_bound, topk_indices_torch
from dsa_triton.attention.topk_indices import SPACE
from dsa_triton.bench.reports import REPORTS

# Small tiles so that short rows still reach the two-pass route (group_min = 2 * k * GROUP); rows shorter
# than group_min take pass 3 alone (ROUTE_MIN 64), except in the tests of the score-histogram route.
SMALL = {"SPLIT": 1, "TILE": 2048, "WARPS": 2, "GROUP": 8, "ROUTE_MIN": 64, "HIST_BITS": 10, "COLLECT_TILE": 1024,
         "COLLECT_WARPS": 4, "CAP_K": 4, "SEL_BITS": 5, "SEL_TILE": 512, "SEL_WARPS": 4}


def cfg(**changes):
    return {**SMALL, **changes}


@pytest.fixture
def candidate_counts():
    """After a call, ``read()`` gives each row's pass-2 candidate count (meaningful on two-pass rows only)."""
    with tk.recorded_candidate_counts() as read:
        yield read


def run_and_check(scores, k, lengths=None, config=SMALL, num_pages=None, check_values=True, **table):
    T = scores.shape[0]
    poisoned = torch.full((T + 2, k), -2, dtype=torch.int32)  # a guard row on each side of the output
    out = poisoned[1:-1]
    got = dt.topk_indices(scores, k, lengths, config=config, out=out, num_pages=num_pages,
                          check_values=check_values, **table)
    assert got is out and (poisoned[[0, -1]] == -2).all(), "wrote outside the output"
    if lengths is not None:
        lengths = lengths.clamp(0, scores.shape[1])
    ref = topk_indices_torch(scores, k, lengths, **table)
    error = check_topk(got, ref, scores, k, lengths, **table)
    assert error is None, error
    return got


def nan_past_lengths(scores, lengths):
    """Poison every position a row must not read or select."""
    pos = torch.arange(scores.shape[1])
    return scores.masked_fill(pos[None, :] >= lengths[:, None].long(), float("nan"))


def test_every_route_of_a_row():
    """One batch: zero length, k >= length, short rows (direct), long rows (candidates), all with NaN past the end."""
    g = torch.Generator().manual_seed(0)
    k, L = 24, 3000  # group_min = 2 * 24 * 8 = 384
    lengths = torch.tensor([0, 1, 24, 23, 100, 383, 384, 1500, 2999, 3000], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(len(lengths), L, generator=g), lengths)
    out = run_and_check(scores, k, lengths)
    assert (out[0] == -1).all() and (out[1, 1:] == -1).all() and int(out[1, 0]) == 0


@pytest.mark.parametrize("route_min", [2, 4])
def test_mid_length_rows_histogram_every_score(route_min, candidate_counts):
    """Rows from ROUTE_MIN * k to 2 k GROUP long take passes 1-2 with a histogram of every score: their
    candidates hold the top k and little more; shorter rows still take pass 3 alone. Ties overflow the
    buffer and go over the row."""
    g = torch.Generator().manual_seed(route_min)
    k, L = 24, 3000  # route_min = 48 or 96, group_min = 384
    lengths = torch.tensor([0, 24, 47, 48, 96, 200, 383, 384, 1500, 3000, 300, 383], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(len(lengths), L, generator=g), lengths)
    scores[-2, :300] = 1.0  # all tied: overflows the candidate buffer
    scores[-1, :383:3] = float("nan")  # NaN scores count as -inf
    run_and_check(scores, k, lengths, config=cfg(ROUTE_MIN=route_min, HIST_BITS=8))
    counts = candidate_counts()
    mid = [i for i, n in enumerate(lengths.tolist()[:-2]) if route_min * k <= n]
    assert all(k <= int(counts[i]) <= 4 * k for i in mid), counts[mid]
    assert int(counts[-2]) > 4 * k  # the tied row overflowed, yet its answer above is exact


def test_pass_one_ranks_by_count_as_by_sort(monkeypatch, candidate_counts):
    """The interpreter reads pass 1's sample ranks off counted ranks (its ``tl.sort`` costs about 0.3 s a call); the
    GPU reads them off ``tl.sort``: both give the same windows, so the same candidates and answers. Rows on both
    pass-1 histograms (group maxima; every score), with ties, signed zeros and infinities in the samples."""
    from dsa_triton.plans import PlanCache

    g = torch.Generator().manual_seed(23)
    k, L = 8, 4096  # group_min 128, route_min 32: rows of 32-127 scores histogram every score
    lengths = torch.tensor([4096, 100, 64, 2000], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(4, L, generator=g), lengths)
    scores[0, ::128] = 0.5  # tied piece maxima
    scores[1, :100:7] = -0.0
    scores[2, :64:5] = float("inf")
    scores[3] = scores[3].relu()  # most pieces peak at +0.0
    config = cfg(ROUTE_MIN=4)
    words = [w.value for w in (INFO_KEY_LO, INFO_SHIFT, INFO_LO, INFO_STEP, INFO_COUNT)]  # the window, the count
    by_count = run_and_check(scores, k, lengths, config=config).clone()
    windows = torch.stack([candidate_counts(w) for w in words])
    monkeypatch.setattr(tk, "interpreting", lambda: False)
    monkeypatch.setattr(tk, "_PLANS", PlanCache())  # a plan made with tl.sort's ranks
    assert torch.equal(run_and_check(scores, k, lengths, config=config), by_count)
    assert torch.equal(torch.stack([candidate_counts(w) for w in words]), windows)


@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_score_histogram_bins_start_below_the_kth_score(ratio, candidate_counts):
    """Rows of n = 2k, 4k, 8k scores on the score-histogram route: the window starts low enough that tau lands
    near the k-th largest score (a window at the piece maxima put tau at -inf there: every score became a
    candidate, and at n = 8 k the buffer overflowed into a whole-row pass 3; on the H200, rows of 16384 with
    k = 2048 took 108 us on that route against 47 us on the one-program route)."""
    g = torch.Generator().manual_seed(ratio)
    k = 64
    lengths = torch.full((4,), k * ratio, dtype=torch.int32)
    run_and_check(torch.randn(4, k * ratio, generator=g), k, lengths, config=cfg(ROUTE_MIN=2, HIST_BITS=8))
    assert all(k <= int(c) < 2 * k for c in candidate_counts()), candidate_counts()


@pytest.mark.parametrize("sel_bits", [4, 5, 6, 8])
def test_radix_digit_widths(sel_bits):
    g = torch.Generator().manual_seed(sel_bits)
    scores = torch.randn(3, 2500, generator=g) * torch.tensor([[1e-30], [1.0], [1e30]])  # tiny, plain, huge
    scores[:, ::7] *= -1
    run_and_check(scores, 50, config=cfg(SEL_BITS=sel_bits))


@pytest.mark.parametrize("split", [2, 4])
def test_split_rows_over_programs(split):
    """Partial histograms of several programs per row; chunks ending inside a tile, or past the row."""
    g = torch.Generator().manual_seed(split)
    lengths = torch.tensor([9000, 5000, 4097, 2048], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(4, 9000, generator=g), lengths)
    run_and_check(scores, 40, lengths, config=cfg(SPLIT=split, TILE=2048, COLLECT_TILE=1024))


@pytest.mark.parametrize("k", [1, 7, 300])
def test_ties_and_all_equal_rows(k):
    """All-equal rows overflow the candidate buffer (the whole row is >= tau) and take the row route."""
    g = torch.Generator().manual_seed(k)
    L = 2600
    scores = torch.stack([
        torch.full((L,), 0.25),  # all equal
        torch.randint(0, 3, (L,), generator=g).float(),  # three values, ties at the threshold
        torch.randint(0, 40, (L,), generator=g).float() - 20,
        torch.where(torch.arange(L) % 2 == 0, 0.0, -0.0),  # +0 ranks above -0
    ])
    run_and_check(scores, k, config=cfg(CAP_K=2))
    for row in scores:  # alone, each row is also the last: a stray write lands in the guard row
        run_and_check(row[None], k, config=cfg(CAP_K=2))


def test_inf_and_nan_inside_the_valid_range():
    """-inf is a valid lowest score; NaN inside the range ranks as -inf."""
    g = torch.Generator().manual_seed(2)
    L, k = 3000, 40
    scores = torch.randn(6, L, generator=g)
    scores[0, 30:] = float("-inf")  # 30 finite: 10 -inf picks
    scores[1] = float("nan")  # every score NaN: no group counts, the row route takes k of them
    scores[2, ::3] = float("nan")
    scores[3, 100:] = float("-inf")
    scores[3, 5:20] = float("inf")
    scores[4, ::2] = float("-inf")
    scores[4, 1::4] = float("nan")
    scores[5, 2::5] = float("nan")  # a short row (radix select straight over it)
    out = run_and_check(scores, k, torch.tensor([L] * 5 + [300], dtype=torch.int32))
    assert set(range(30)) <= set(out[0].tolist())  # every finite score is taken


def test_candidate_buffer_exactly_full_then_one_over(candidate_counts):
    """k = 8, CAP_K = 2: 16 equal top scores fill the buffer exactly (select picks 8 of the ties there);
    17 overflow it and the row route runs."""
    g = torch.Generator().manual_seed(9)
    L, k = 600, 8  # group_min = 2 * 8 * 8 = 128
    scores = torch.randn(2, L, generator=g).clamp(max=7.0)
    for row, high in ((0, 16), (1, 17)):
        scores[row, torch.randperm(L, generator=g)[:high]] = 8.0
    run_and_check(scores, k, config=cfg(CAP_K=2))
    assert candidate_counts().tolist() == [16, 17]


def test_bins_follow_the_scores_shift_and_scale(candidate_counts):
    """Every row stays on the buffer route: shifted, tiny and uniform scores, and two outlying sample
    pieces (negative among positive scores) that must not stretch the bins over the tiny magnitudes."""
    g = torch.Generator().manual_seed(11)
    L, k = 3000, 24  # cap = 96
    positive = torch.randn(L, generator=g).abs() + 0.5
    positive[0:16] -= 10  # sample pieces start at multiples of L // 32 = 93
    positive[465:481] -= 10
    scores = torch.stack([
        torch.randn(L, generator=g) + 100,
        torch.randn(L, generator=g) * 1e-3 - 50,
        torch.randn(L, generator=g) * 1e-30,
        torch.rand(L, generator=g),
        positive,
    ])
    run_and_check(scores, k)
    counts = candidate_counts()
    assert ((counts >= k) & (counts <= 4 * k)).all(), counts.tolist()
    assert [emulate_bound(row, k, SMALL)["count"] for row in scores] == counts.tolist()  # key bins, emulated


@pytest.mark.parametrize("hist_bits", [8, 10])
def test_windows_across_zero_keep_the_candidates_in_the_buffer(hist_bits, candidate_counts):
    """Mostly negative rows whose top is positive: the bin window runs from the third smallest sample piece
    maximum (<= 0) to the largest (> 0). Bins linear in the sort key spent nearly all of themselves on the
    magnitudes near zero, so tau fell binades below the k-th score and the buffer overflowed into the whole-row
    route (here 36-121 candidates for a buffer of 32; DeepSeek-V3.2-like indexer scores at 1M columns: 1e4-5e4
    for 8192, issue 17). Value bins keep about k. Also +-inf and NaN in such a row, and a window from exactly
    +0.0 (relu scores). The counts are those of the PyTorch emulation of passes 1-2."""
    g = torch.Generator().manual_seed(17)
    n, k = 4096, 8  # cap 32
    scores = torch.randn(6, n, generator=g) - 1.5
    scores[4] = scores[4].relu()  # most pieces peak at +0.0: lo = +0.0
    scores[5, 40:4000:300] = float("inf")  # 14 of the top 8, out of the sample
    scores[5, 41:4000:300] = float("-inf")
    scores[5, 42:4000:300] = float("nan")
    config = cfg(HIST_BITS=hist_bits)
    run_and_check(scores, k, config=config)
    counts = candidate_counts()
    assert ((counts >= k) & (counts <= 4 * k)).all(), counts.tolist()
    for t in range(5):  # (NaN-free rows: a group maximum over a NaN is NaN in the interpreter, not on the GPU)
        e = emulate_bound(scores[t], k, config)
        assert e["lo"] <= 0.0 < e["hi"] and e["route"] == "buffer" and e["count"] == int(counts[t]), (t, e)


def test_route_script_counts_equal_the_kernels(tmp_path):
    """scripts/topk_route.py (issue 17's study of indexer-like rows): its emulated candidate counts are the
    kernels'."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "topk_route.py"
    spec = importlib.util.spec_from_file_location("topk_route", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "rows.json"
    script.main(["--n", "8192", "--k", "64", "--queries", "2", "--kernel", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["route"] == "buffer" and r["kernel_count"] == r["count"] for r in rows), rows


@pytest.mark.parametrize("k", [10, 60])
def test_all_pairs_finish_with_ties(k, candidate_counts):
    """Scores on a 1/64 grid (many ties). With 4 warps pass 3 ranks up to PAIR = 64 entries at once:
    k = 10 leaves fewer candidates than that, k = 60 more (a digit and a compaction come first)."""
    g = torch.Generator().manual_seed(k)
    scores = (torch.randn(4, 2400, generator=g) * 64).round() / 64
    run_and_check(scores, k)
    counts = candidate_counts()
    assert ((counts >= k) & (counts <= 64)).all() if k == 10 else ((counts > 64) & (counts <= 4 * k)).all(), counts


def test_zero_signs_at_the_bound(candidate_counts):
    """tau = +0.0 exactly (every sample piece peaks at +0.0: one-key bins) collects -0.0 too (float >=),
    whose key lies below tau's; with 52 candidates all are ranked at once (PAIR = 64)."""
    g = torch.Generator().manual_seed(12)
    L, k = 3000, 24
    scores = -torch.rand(2, L, generator=g) - 1
    scores[:, torch.arange(32) * (L // 32)] = 0.0  # one +0.0 per sample piece, in distinct groups
    outside = torch.tensor([p for p in range(L) if p % (L // 32) >= 16])
    scores[:, outside[torch.randperm(len(outside), generator=g)[:20]]] = -0.0
    out = run_and_check(scores, k, config=cfg(SEL_WARPS=8, SEL_TILE=1024))
    assert candidate_counts().tolist() == [52, 52]
    assert (scores.gather(1, out.long()).view(torch.int32) == 0).all()  # only +0.0 taken


def relu_like(g, L, positives, zeros):
    """A row of indexer-like scores: ``positives`` positive ones and ``zeros`` exact 0.0 (a ReLU's), at random
    positions, the rest negative."""
    row = -torch.rand(L, generator=g) - 0.5
    at = torch.randperm(L, generator=g)
    row[at[:zeros]] = 0.0
    row[at[zeros:zeros + positives]] = torch.rand(positives, generator=g) + 1.0
    return row


def lowest_positions_rule(scores, k, lengths):
    """The top k of each row by (score descending, position ascending), NaN as -inf, in plain Python (no zero
    signs among the scores): ``[T, k]`` ascending, -1 last."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for t, n in enumerate(lengths.tolist()):
        ranked = sorted((-(float("-inf") if v != v else v), p) for p, v in enumerate(scores[t, :n].tolist()))
        chosen = sorted(p for _, p in ranked[:k])
        out[t, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


@pytest.mark.parametrize("config", [SMALL, cfg(SPLIT=2), cfg(ROUTE_MIN=2, HIST_BITS=8),
                                    cfg(SEL_WARPS=8, SEL_TILE=1024)])
def test_ties_go_to_the_lowest_positions(config, candidate_counts):
    """Among scores equal to the k-th largest, the lowest positions are taken on every route: ties inside the
    candidate buffer (pass 2 appends them in no position order) past PAIR and within it, ties over the whole row
    (a buffer overflow, a short row), and NaN tied with -inf (NaN ranks as -inf). The reference follows the same
    rule, and run_and_check compares the index sets exactly."""
    g = torch.Generator().manual_seed(len(str(config)))
    k, L = 64, 4500
    rows = [relu_like(g, L, 20, zeros) for zeros in (150, 60, 2000, 0)]  # ties past PAIR, within it, overflow
    short = relu_like(g, L, 10, 100)
    short[300:] = float("nan")  # a short row (with ROUTE_MIN 64): pass 3 alone over 300 scores
    mixed = []
    for n in (L, 200):  # 30 finite, then NaN and -inf tie (over 200 with ROUTE_MIN 2: 100 candidates, tau -inf)
        row = torch.full((L,), float("nan"))
        row[torch.randperm(n, generator=g)[:70]] = float("-inf")
        row[torch.randperm(n, generator=g)[:30]] = torch.rand(30, generator=g)
        mixed.append(row)
    scores = torch.stack(rows + [short] + mixed)
    lengths = torch.tensor([L] * 4 + [300, L, 200], dtype=torch.int32)
    out = run_and_check(scores, k, lengths, config=config)
    counts = candidate_counts().tolist()
    assert counts[:3] == [170, 80, 2020]  # the ties in the buffer (past PAIR = 64, then within it), an overflow
    if config["ROUTE_MIN"] == 2:  # tau -inf: every number a candidate, NaN skipped, so pass 3 takes the row
        assert counts[6] == int(scores[6, :200].isnan().logical_not().sum()) >= k
    assert torch.equal(out.sort(dim=1).values, lowest_positions_rule(scores, k, lengths))
    assert torch.equal(topk_indices_torch(scores, k, lengths).sort(dim=1).values,
                       lowest_positions_rule(scores, k, lengths))


def test_a_rows_selection_does_not_depend_on_its_batch():
    """Many indexer scores are exactly 0.0 (the ReLU), so a row's top k holds ties: it is the same computed alone
    and in batches of other rows (other lengths, another T, hence other launch configs and routes), with the
    default configs (the greedy tokens of a prompt changed with its batch mates)."""
    g = torch.Generator().manual_seed(31)
    k = 64
    target = relu_like(g, 3000, 30, 200)
    alone = dt.topk_indices(target[None], k)
    expected = lowest_positions_rule(target[None], k, torch.tensor([3000]))
    assert torch.equal(alone.sort(dim=1).values, expected)
    for T, L, lengths in ((3, 3000, [1000, 3000, 2500]), (5, 20000, [20000, 7, 3000, 12000, 400]),
                          (40, 6000, [6000, 3000] * 20)):
        batch = torch.stack([relu_like(g, L, 30, 500) for _ in range(T)])
        lengths = torch.tensor(lengths, dtype=torch.int32)
        at = lengths.tolist().index(3000)
        batch[at] = float("nan")
        batch[at, :3000] = target
        out = dt.topk_indices(batch, k, lengths)
        assert torch.equal(out[at].sort().values, expected[0]), (T, L)


def nan_ranked_above_a_number(scores, idx, lengths):
    """Rows whose selection holds a NaN while a score it leaves out is neither NaN nor -inf."""
    bad = []
    for t, n in enumerate(lengths.tolist()):
        row, sel = scores[t, :n], idx[t][idx[t] >= 0].long()
        left = torch.ones(n, dtype=torch.bool)
        left[sel] = False
        if bool(row[sel].isnan().any()) and bool((row[left] > float("-inf")).any()):
            bad.append(t)
    return bad


@pytest.mark.parametrize("config", [SMALL, cfg(ROUTE_MIN=2, HIST_BITS=8)])
def test_nan_never_ranks_above_a_number(config):
    """NaN of either sign and any payload ranks as -inf on every route (value checks look at lengths and tables
    only, so the same with them off). Checked directly on the kernel and on the oracle, which could share a
    wrong NaN order."""
    g = torch.Generator().manual_seed(13)
    L, k = 3000, 24
    scores = torch.randn(6, L, generator=g)
    bits = scores.view(torch.int32)
    for t, pattern in enumerate((0x7FC00000, -4194304, 0x7F800001, -1, 0x7FFFFFFF, 0x7FC00000)):
        bits[t, torch.rand(L, generator=g) < (0.2, 0.5, 0.9, 0.99, 0.1, 0.5)[t]] = pattern
    scores[0, :100] = float("nan")  # the head of a row, and every sample piece's first score
    scores[4, :: L // 32] = float("nan")
    scores[5, 1::2] = float("-inf")
    lengths = torch.tensor([L, L, 2000, L, 300, 1500], dtype=torch.int32)
    out = run_and_check(scores, k, lengths, config=config)
    assert nan_ranked_above_a_number(scores, out, lengths) == []
    assert nan_ranked_above_a_number(scores, topk_indices_torch(scores, k, lengths), lengths) == []


def test_unchecked_lengths_are_clamped():
    """With check_values=False a negative or too long length must still not read or write out of bounds."""
    g = torch.Generator().manual_seed(10)
    scores = torch.randn(3, 500, generator=g)
    out = run_and_check(scores, 20, torch.tensor([-5, 900, 7], dtype=torch.int32), check_values=False)
    assert (out[0] == -1).all()


def test_k_larger_than_every_row():
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([0, 5, 9, 9], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(4, 9, generator=g), lengths)
    out = run_and_check(scores, 16, lengths)
    assert sorted(out[2, :9].tolist()) == list(range(9)) and (out[:, 9:] == -1).all()


def test_default_config_and_no_lengths():
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(2, 700, generator=g)
    out = dt.topk_indices(scores, 33)
    assert check_topk(out, topk_indices_torch(scores, 33), scores, 33) is None


@pytest.mark.parametrize("page_size", [16, 64])
def test_block_table_translation(page_size):
    """Decode rows (row t -> sequence t) and prefill rows (row_to_seq), pages in random physical order."""
    g = torch.Generator().manual_seed(page_size)
    B, max_pages, k = 3, 3000 // page_size + 1, 37
    L = 3000
    table = torch.randperm(B * max_pages + 5, generator=g)[: B * max_pages].view(B, max_pages).int()
    lengths = torch.tensor([L, 1000, 0, 2900, 60], dtype=torch.int32)
    row_to_seq = torch.tensor([0, 2, 1, 0, 2], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(5, L, generator=g), lengths)
    out = run_and_check(scores, k, lengths, block_table=table, page_size=page_size, row_to_seq=row_to_seq,
                        num_pages=B * max_pages + 5)
    assert (out[2] == -1).all()
    # decode form: row t is sequence t
    run_and_check(scores[:3], k, lengths[:3], block_table=table, page_size=page_size)


def test_row_stride_larger_than_row():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3, 2700, generator=g)
    run_and_check(big[:, :2500], 60)


def test_checker_catches_wrong_answers():
    """The oracle comparison is not vacuous: each corruption of a right answer is reported."""
    g = torch.Generator().manual_seed(6)
    scores = torch.randn(2, 50, generator=g)
    lengths = torch.tensor([50, 3], dtype=torch.int32)
    ref = topk_indices_torch(scores, 5, lengths)
    shuffled = ref.clone()
    shuffled[0] = ref[0].flip(0)
    assert check_topk(shuffled, ref, scores, 5, lengths) is None  # the order within a row is free
    lowest = int(scores[0].argmin())
    for bad in (
        lambda o: o.__setitem__((0, 0), lowest),  # not in the top 5
        lambda o: o.__setitem__((0, 1), int(o[0, 0])),  # repeated
        lambda o: o.__setitem__((1, 1), 10),  # beyond the row's length
        lambda o: o.__setitem__((1, 3), 0),  # a slot past min(k, length) not -1
        lambda o: o.__setitem__((0, 4), -1),  # missing index
        lambda o: o.__setitem__((0, 2), -2),  # unwritten
    ):
        out = ref.clone()
        bad(out)
        assert check_topk(out, ref, scores, 5, lengths) is not None


def test_registered_spec_runs_its_cpu_shapes():
    spec = dt.registry.get("topk_indices")
    for shape in spec.bench_shapes("any", False):
        inputs = spec.make_inputs("any", shape, torch.device("cpu"), 7)
        assert spec.compare(spec.run(inputs, spec.launch_config("any", shape, "cpu")), spec.reference(inputs)) is None
    assert spec.cost("any", {"T": 2, "L": 10, "k": 4}).bytes == 4 * (9 + 10) + 4 * 2 * 4


def test_empty_batch_and_empty_rows():
    assert dt.topk_indices(torch.randn(0, 100), 8).shape == (0, 8)
    assert (run_and_check(torch.randn(3, 0), 4) == -1).all()


def _bad_calls():
    s = torch.randn(4, 100)
    table = torch.arange(4 * 7, dtype=torch.int32).view(4, 7)
    ok = dict(block_table=table, page_size=16)
    return [
        ("scores", lambda: dt.topk_indices(s.double(), 4)),
        ("scores", lambda: dt.topk_indices(s[0], 4)),
        ("scores", lambda: dt.topk_indices(s.t(), 4)),
        ("k", lambda: dt.topk_indices(s, 0)),
        ("k", lambda: dt.topk_indices(s, 4097)),
        ("k", lambda: dt.topk_indices(s, 2.0)),
        ("lengths", lambda: dt.topk_indices(s, 4, torch.full((4,), 5))),
        ("lengths", lambda: dt.topk_indices(s, 4, torch.full((3,), 5, dtype=torch.int32))),
        ("lengths", lambda: dt.topk_indices(s, 4, torch.tensor([5, 101, 0, 0], dtype=torch.int32))),
        ("lengths", lambda: dt.topk_indices(s, 4, torch.tensor([5, -1, 0, 0], dtype=torch.int32))),
        ("page_size", lambda: dt.topk_indices(s, 4, page_size=16)),
        ("page_size", lambda: dt.topk_indices(s, 4, block_table=table)),
        ("block_table", lambda: dt.topk_indices(s, 4, block_table=table.long(), page_size=16)),
        ("block_table", lambda: dt.topk_indices(s, 4, block_table=table[:, :6], page_size=16)),  # 96 < 100
        ("block_table", lambda: dt.topk_indices(s, 4, block_table=table[:3], page_size=16)),
        ("block_table", lambda: dt.topk_indices(s, 4, block_table=table - 1, page_size=16)),
        ("block_table", lambda: dt.topk_indices(s, 4, **ok, num_pages=20)),
        ("row_to_seq", lambda: dt.topk_indices(s, 4, **ok, row_to_seq=torch.tensor([0, 1, 2, 4], dtype=torch.int32))),
        ("row_to_seq", lambda: dt.topk_indices(s, 4, row_to_seq=torch.zeros(4, dtype=torch.int32))),
        ("out", lambda: dt.topk_indices(s, 4, out=torch.empty(4, 5, dtype=torch.int32))),
        ("page_size", lambda: dt.topk_indices(s, 4, block_table=table, page_size=2**40)),  # was named block_table
        ("num_pages", lambda: dt.topk_indices(s, 4, **ok, num_pages=2**31)),
        ("SPLIT", lambda: dt.topk_indices(s, 4, config=cfg(SPLIT=3))),
    ]


@pytest.mark.parametrize("name, call", _bad_calls(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(_bad_calls())])
def test_bad_input_raises_value_error_naming_the_argument(name, call, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched despite bad input")

    monkeypatch.setattr(tk, "_launch", no_launch)
    with pytest.raises(ValueError, match=name):
        call()


def test_unused_table_entries_are_not_checked():
    """Entries past a sequence's pages in use may hold anything (-1 here)."""
    g = torch.Generator().manual_seed(8)
    table = torch.randperm(8, generator=g).int().view(2, 4)
    table[1, 2:] = -1  # sequence 1 only uses 2 pages of 16
    lengths = torch.tensor([64, 30], dtype=torch.int32)
    scores = nan_past_lengths(torch.randn(2, 64, generator=g), lengths)
    run_and_check(scores, 8, lengths, block_table=table, page_size=16)


def test_cached_plan_still_checks_scalars_and_follows_the_config_lookup(monkeypatch):
    """A call whose tensors match an earlier, valid call's still rejects bad scalars (``4.0`` and ``True``
    hash like ``4`` and ``1``), and a new database reaches the next call."""
    s = torch.randn(3, 100)
    table = torch.arange(3 * 7, dtype=torch.int32).view(3, 7)
    run_and_check(s, 4, config=None, block_table=table, page_size=16)
    for name, call in (("k", lambda: dt.topk_indices(s, 4.0, block_table=table, page_size=16)),
                       ("page_size", lambda: dt.topk_indices(s, 4, block_table=table, page_size=16.0)),
                       ("k", lambda: dt.topk_indices(s, True))):
        with pytest.raises(ValueError, match=name):
            call()
    seen = []
    previous = dt.registry.database()
    lookup = Database()
    lookup.lookup = lambda spec, phase, shape, dev: seen.append(spec.name)
    try:
        dt.registry.use_database(lookup)
        run_and_check(s, 4, config=None, block_table=table, page_size=16)
    finally:
        dt.registry.use_database(previous)
    assert "topk_indices" in seen


def test_routes_report_checks_every_route_min():
    """The topk_routes report runs each ROUTE_MIN of the space on mixed and fixed lengths and checks its indices."""
    rows = REPORTS["topk_routes"](torch.device("cpu"), None)
    assert {r["ROUTE_MIN"] for r in rows} == set(SPACE["ROUTE_MIN"])
    assert all(r["check"] == "ok" and r["us"] > 0 for r in rows), rows
