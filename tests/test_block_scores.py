"""Block-level indexer scoring (Triton interpreter): page bounds, page selection, logits inside pages."""
import sys

import pytest
import torch

import dsa_triton as dt
from tuning_db import Database
from dsa_triton import registry
from dsa_triton.attention.block_indexer_logits_reference import gather_selected_torch, page_bounds_torch
from dsa_triton.attention.indexer_logits_reference import indexer_logits_torch
from dsa_triton.attention.indexer_logits_spec import compare_logits, random_queries
from dsa_triton.attention.select_pages_reference import select_pages_torch
from dsa_triton.runtime import default_device, interpreting

from .poison import poisoned_allocations
from .test_indexer import decode_rows, paged_cache
from dsa_triton.bench.reports import REPORTS


def problem(P, lens=(70, 0, 37, 16), rows=(2, 1, 1, 3), H=8, DK=32, seed=0):
    cache = paged_cache(list(lens), P, DK, seed=seed)
    limits, cu = decode_rows(list(lens), list(rows))
    q, w = random_queries(int(cu[-1]), H, DK, torch.Generator().manual_seed(seed + 1))
    return cache, q, w, limits, cu


@pytest.mark.parametrize("P", [16, 64])
def test_bounds_are_upper_bounds(P):
    cache, q, w, limits, cu = problem(P, seed=P)
    assert bool((w < 0).any() and (w > 0).any())  # both signs of the head weights
    n_pages = -(-70 // P)
    with poisoned_allocations():
        bounds = dt.block_scores(q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits, P,
                                 cu_seqlens_q=cu)
    ref = page_bounds_torch(q, w, cache.pmax, cache.pmin, cache.block_table, limits, P, n_pages, cu)
    assert compare_logits(bounds, ref, rtol=1e-5) is None
    dense = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu,
                              block_table=cache.block_table, seq_lens=cache.seq_lens, num_cols=n_pages * P)
    best = dense.view(dense.shape[0], n_pages, P).amax(dim=2)  # each page's best valid token score
    finite = best.isfinite()
    assert torch.equal(finite, bounds.isfinite())
    slack = 1e-5 * bounds.where(finite, 0.0).abs().amax(1, keepdim=True)
    assert bool((bounds + slack >= best)[finite].all())


def test_several_chunks():
    """Over 256 pages (two bound chunks) and 20 selected pages of 16 (two logits chunks of 256 columns)."""
    cache, q, w, limits, cu = problem(16, lens=(4200, 40), rows=(2, 1), H=4, seed=4)
    cfg = {**registry.get("block_indexer_logits").default("decode", {"Q": 2, "H": 4}),
           "bound_BLOCK_N": 16, "bound_CHUNK": 256, "BLOCK_N": 32, "CHUNK": 256}
    with poisoned_allocations():
        bounds = dt.block_scores(q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits, 16,
                                 cu_seqlens_q=cu, config=cfg)
    assert compare_logits(bounds, page_bounds_torch(q, w, cache.pmax, cache.pmin, cache.block_table, limits, 16,
                                                    263, cu), rtol=1e-5) is None
    pages = dt.select_pages(bounds, 20)
    with poisoned_allocations():
        logits, pos = dt.selected_page_logits(q, w, cache.ik, cache.ik_scale, cache.block_table, cache.seq_lens,
                                              limits, pages, cu_seqlens_q=cu, config=cfg)
    dense = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=cache.block_table,
                              seq_lens=cache.seq_lens)
    ref_logits, ref_pos = gather_selected_torch(dense, pages, 16, limits)
    assert torch.equal(pos, ref_pos) and compare_logits(logits, ref_logits, rtol=1e-5) is None


@pytest.mark.parametrize("P", [16, 64])
def test_all_pages_selected_equals_token_level(P):
    cache, q, w, limits, cu = problem(P, seed=3)
    n_pages = -(-70 // P)
    kw = dict(cu_seqlens_q=cu, config={**registry.get("block_indexer_logits").default("decode", {"Q": 3, "H": 8}),
                                       "BLOCK_N": 32, "CHUNK": 256, "num_warps": 4})
    with poisoned_allocations():
        logits, pos = dt.block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin,
                                              cache.block_table, cache.seq_lens, limits, n_pages + 2, **kw)
    dense = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=cache.block_table,
                              seq_lens=cache.seq_lens, num_cols=(n_pages + 2) * P,
                              config={"BLOCK_M": 1, "BLOCK_N": 32, "CHUNK": 256, "num_warps": 4, "num_stages": 3})
    assert torch.equal(logits, dense)  # exactly, -inf past each row's limit included
    fast = dt.block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table,
                                   cache.seq_lens, limits, n_pages + 2, max_len=70, max_q=3, check_values=False, **kw)
    assert torch.equal(fast[0], logits) and torch.equal(fast[1], pos)
    expected = torch.arange((n_pages + 2) * P).expand_as(pos)
    assert torch.equal(pos, expected.where(expected < limits[:, None], -1).int())


def test_n_select_past_the_pages_costs_nothing_more():
    """n_select = 10,000 over 2 pages: the launches cover the 2 pages (the rest of the documented width is one fill
    of -inf / -1), so the call is as fast as n_select = 2 (it took 77 s in the interpreter) and equals the token
    level there; select_pages alike."""
    import time

    cache, q, w, limits, cu = problem(16, lens=(20, 32), rows=(2, 1), seed=5)
    args = (q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits)
    dense = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=cache.block_table,
                              seq_lens=cache.seq_lens, num_cols=32)
    start = time.perf_counter()
    with poisoned_allocations():
        logits, pos, bounds = dt.block_indexer_logits(*args, 10_000, cu_seqlens_q=cu, return_bounds=True)
        fast = dt.block_indexer_logits(*args, 10_000, cu_seqlens_q=cu, max_len=32, max_q=2, check_values=False)
        pages = dt.select_pages(bounds, 10_000)
    assert time.perf_counter() - start < 5.0
    assert logits.shape == pos.shape == (3, 160_000) and bounds.shape == (3, 2)
    assert torch.equal(logits[:, :32], dense) and bool(logits[:, 32:].isneginf().all())
    expected = torch.arange(32).expand(3, -1)
    assert torch.equal(pos[:, :32], expected.where(expected < limits[:, None], -1).int())
    assert bool((pos[:, 32:] == -1).all())
    assert torch.equal(fast[0], logits) and torch.equal(fast[1], pos)
    assert torch.equal(pages, select_pages_torch(bounds, 10_000))


def test_sizes_past_int32_raise_naming_them():
    """A size that sizes an output or an int32 index past 2^31 - 1 raises a ValueError naming it before anything is
    allocated (n_select = 2^31 was an allocation RuntimeError, or no error over no rows)."""
    cache, q, w, limits, cu = problem(16, lens=(20, 32), rows=(2, 1), seed=5)
    args = (q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits)
    fast = dict(cu_seqlens_q=cu, max_len=32, max_q=2, check_values=False)
    for name, call in (
            ("n_select", lambda: dt.select_pages(torch.zeros(0, 3), 2**31)),
            ("n_select", lambda: dt.select_pages(torch.zeros(2, 3), 2**40)),
            ("n_select", lambda: dt.block_indexer_logits(*args, 2**27, cu_seqlens_q=cu)),  # 2^31 columns of P = 16
            ("n_select", lambda: dt.block_indexer_logits(*args, 2**27, **fast)),
            ("max_len", lambda: dt.block_indexer_logits(*args, 2, cu_seqlens_q=cu, max_len=2**40)),
            ("max_len", lambda: dt.block_indexer_logits(*args, 2, **{**fast, "max_len": 2**31})),
            ("max_q", lambda: dt.block_indexer_logits(*args, 2, **{**fast, "max_q": 2**31})),
            ("num_cols", lambda: dt.block_scores(*args[:2], *args[4:], 16, cu_seqlens_q=cu, num_cols=2**31))):
        with pytest.raises(ValueError, match=f"^{name}: must be"):
            call()
    assert dt.select_pages(torch.zeros(0, 3), 2**31 - 1).shape == (0, 2**31 - 1)  # the largest


def test_partial_selection_matches_dense_logits():
    cache, q, w, limits, cu = problem(16, lens=(150, 3, 0), rows=(2, 1, 2), seed=9)
    bounds = dt.block_scores(q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits, 16,
                             cu_seqlens_q=cu)
    pages = dt.select_pages(bounds, 3)
    assert bool((pages[:, :-1] <= pages[:, 1:]).logical_or(pages[:, 1:] == -1).all())  # ascending, -1 last
    top = bounds.topk(3, dim=1).values.amin(1)
    chosen = bounds.gather(1, pages.clamp_min(0).long()).where(pages >= 0, float("inf")).amin(1)
    assert torch.equal(chosen[:2], top[:2])
    assert torch.equal(pages[2], torch.tensor([0, -1, -1], dtype=torch.int32))  # one valid page only
    assert bool((pages[3:] == -1).all())  # zero-length sequence
    with poisoned_allocations():
        logits, pos = dt.selected_page_logits(q, w, cache.ik, cache.ik_scale, cache.block_table, cache.seq_lens,
                                              limits, pages, cu_seqlens_q=cu)
    dense = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu,
                              block_table=cache.block_table, seq_lens=cache.seq_lens, num_cols=150)
    ref_logits, ref_pos = gather_selected_torch(dense, pages, 16, limits)
    assert torch.equal(pos, ref_pos)
    assert compare_logits(logits, ref_logits, rtol=1e-6) is None
    assert bool(logits[3:].isneginf().all()) and bool((pos[3:] == -1).all())


def test_registry_entry():
    spec = registry.get("block_indexer_logits")
    for shape in spec.bench_shapes("decode", False):
        inputs = spec.make_inputs("decode", shape, torch.device("cpu"), 11)
        with poisoned_allocations():
            out = spec.run(inputs, {**spec.default("decode", shape), "path": "block"})
        ref = spec.reference(inputs)
        assert spec.compare(out, ref) is None
        bounds, logits, positions = out
        assert spec.compare((bounds, logits * 1.01, positions), ref) is not None
        assert spec.compare((bounds, logits, positions.roll(1, dims=0)), ref) is not None
        path, dense = spec.run(inputs, {**spec.default("decode", shape), "path": "token"})  # the token path's logits
        assert path == "token" and spec.compare((path, dense), ref) is None
        assert spec.compare((path, dense * 1.01), ref) is not None


def test_indexer_path_is_the_tuned_configs_path():
    """``dt.indexer_path`` answers the path of the shape's launch config: the token path by default and in prefill,
    the block path where the database's record names it."""
    shape = dict(batch=8, max_q=1, max_len=131072, page_size=64, heads=64, head_dim=128, device="cpu")
    assert dt.indexer_path("decode", **shape) == "token" and dt.indexer_path("prefill", **shape) == "token"

    class Block(Database):
        def lookup(self, spec, phase, shape, device):
            return {**spec.default(phase, shape), "path": "block"}

    previous = registry.database()
    try:
        registry.use_database(Block())
        assert dt.indexer_path("decode", **shape) == "block"
    finally:
        registry.use_database(previous)


def test_bad_inputs():
    cache, q, w, limits, cu = problem(16)
    base = (q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits, 16)
    with pytest.raises(ValueError, match="^pmin: strides"):
        dt.block_scores(q, w, cache.pmax, cache.pmin.contiguous(), *base[4:], cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="^pmax: dimension 1"):
        dt.block_scores(q, w, cache.pmax[:, :16], cache.pmin[:, :16], *base[4:], cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="^limits"):
        dt.block_scores(*base[:6], limits + 1, 16, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="^max_len"):
        dt.block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table,
                                cache.seq_lens, limits, 2, cu_seqlens_q=cu, max_len=40)
    with pytest.raises(ValueError, match="^n_select"):
        dt.select_pages(torch.zeros(2, 3), 0)
    pages = torch.tensor([[0, 5]] * q.shape[0], dtype=torch.int32)  # page 5 lies past sequence 0's 70 tokens
    with pytest.raises(ValueError, match="^pages"):
        dt.selected_page_logits(q, w, cache.ik, cache.ik_scale, cache.block_table, cache.seq_lens, limits, pages,
                                cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="^pages: 1 rows"):
        dt.selected_page_logits(q, w, cache.ik, cache.ik_scale, cache.block_table, cache.seq_lens, limits,
                                pages[:1], cu_seqlens_q=cu)


def test_recall_report_on_cpu():
    rows = REPORTS["block_scores_recall"](torch.device("cpu"), None)
    recall = [r for r in rows if r["measure"] == "recall"]
    assert len(recall) == 6 and all(0.0 <= r["recall_min"] <= r["recall_mean"] <= 1.0 for r in recall)
    assert all(r["recall_mean"] >= 0.8 for r in recall if r["locality"] == 1.0)  # a few hot pages: found
    assert all(r["block_us"] > 0 for r in rows if r["measure"] == "time")


@pytest.mark.parametrize("tile", [128, 512])
def test_page_select_registry_entry(tile):
    """Rows longer than a tile, n_select above the row length and above a tile, a row with no valid page;
    outputs poisoned (-2) so a slot the kernel skips shows."""
    spec = registry.get("select_pages")
    for shape in spec.bench_shapes("decode", False) + [{"T": 2, "pages": 300, "SEL": 150}, {"T": 2, "pages": 40, "SEL": 50}]:
        inputs = spec.make_inputs("decode", shape, torch.device("cpu"), tile)
        with poisoned_allocations():
            out = spec.run(inputs, {"TILE": tile, "num_warps": 4})
        ref = spec.reference(inputs)
        assert spec.compare(out, ref) is None
        assert bool((out[0][-1] == -1).all())  # the row without a valid page
        assert spec.compare((out[0].roll(1, dims=1), out[1]), ref) is not None  # the check can fail


def test_page_select_ties_and_nan():
    bounds = torch.tensor([[1.0, 2, 2, 2, 0, float("-inf"), 2, float("nan")]])
    assert dt.select_pages(bounds, 3).tolist() == [[1, 2, 3]]  # ties: the lower pages first
    assert dt.select_pages(bounds, 6).tolist() == [[0, 1, 2, 3, 4, 6]]
    assert dt.select_pages(bounds, 9).tolist() == [[0, 1, 2, 3, 4, 6, -1, -1, -1]]  # -inf and NaN never
    for n in (3, 6, 9):  # the reference agrees: NaN ranks as -inf, not first (torch.topk's order); ties alike
        assert select_pages_torch(bounds, n).tolist() == dt.select_pages(bounds, n).tolist()
    with pytest.raises(ValueError, match="^n_select"):
        dt.select_pages(bounds, 0)
    with pytest.raises(ValueError, match="^bounds: dtype"):
        dt.select_pages(bounds.double(), 2)


def test_ties_go_to_the_lower_pages_and_positions():
    """Rows of many equal bounds (+0.0 and -0.0 apart: -0.0 ranks below, as in every sort key here): select_pages
    and its reference take the lowest pages among equal bounds, exactly. The block path's logits hold their
    positions in ascending order, so a top-k over its columns (lowest columns first among equal logits) takes the
    lowest positions, as the token level does: with every page selected the two give the same positions, many of
    their logits exactly 0.0 (one head, a ReLU)."""
    g = torch.Generator().manual_seed(41)
    bounds = torch.randint(0, 3, (6, 300), generator=g).float()
    bounds[2] = torch.where(torch.rand(300, generator=g) < 0.5, 0.0, -0.0)
    bounds[3, ::3] = float("nan")
    for n in (1, 7, 64, 299):
        pages = dt.select_pages(bounds, n)
        assert torch.equal(pages, select_pages_torch(bounds, n)), n
    assert torch.equal(dt.select_pages(bounds[2:3], 5)[0], (bounds[2].view(torch.int32) == 0).nonzero()[:5, 0].int())
    cache, q, w, limits, cu = problem(16, lens=(150, 40), rows=(2, 1), H=1, seed=8)
    w = w.abs()  # one head, a positive weight: every key whose product is negative scores exactly 0.0
    logits, pos = dt.block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table,
                                          cache.seq_lens, limits, 10, cu_seqlens_q=cu)
    dense = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=cache.block_table,
                              seq_lens=cache.seq_lens)
    assert int((dense == 0).sum()) > 60
    k = 48
    block = pos.gather(1, dt.topk_indices(logits, k).long())
    token = dt.topk_indices(dense, k, limits)
    assert torch.equal(block.sort(1).values, token.sort(1).values)


def test_cached_plan_of_the_fast_path(monkeypatch):
    """The graph-safe call (value checks off, sizes given) caches its checked plan: a second call hits it and
    gives the same answer into fresh (poisoned) outputs; bad scalars or other tensor metadata still raise."""
    cache, q, w, limits, cu = problem(16, seed=5)
    args = (q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits)
    checked = dt.block_indexer_logits(*args, 3, cu_seqlens_q=cu, return_bounds=True)
    path = sys.modules["dsa_triton.attention.block_indexer_logits"]
    real, plans = path._checked_path_plan, []
    monkeypatch.setattr(path, "_checked_path_plan", lambda *a: plans.append(a) or real(*a))
    for _ in range(2):
        with poisoned_allocations():
            fast = dt.block_indexer_logits(*args, 3, cu_seqlens_q=cu, max_len=70, max_q=3, check_values=False,
                                           return_bounds=True)
        assert all(torch.equal(a, b) for a, b in zip(fast, checked))
    assert len(plans) <= 1, "the second call did not hit the cached plan"
    fast = dict(cu_seqlens_q=cu, check_values=False)
    for name, call in (("max_q", lambda: dt.block_indexer_logits(*args, 3, max_len=70, max_q=3.0, **fast)),
                       ("max_len", lambda: dt.block_indexer_logits(*args, 3, max_len=70.0, max_q=3, **fast)),
                       ("n_select", lambda: dt.block_indexer_logits(*args, True, max_len=70, max_q=3, **fast)),
                       ("q", lambda: dt.block_indexer_logits(q.view(torch.uint8), *args[1:], 3, max_len=70, max_q=3,
                                                            **fast))):
        with pytest.raises(ValueError, match=f"^{name}"):
            call()
    one = (q[:2], w[:2], *args[2:7], cache.seq_lens[:1], limits[:2])  # one sequence, no cu: the plan keeps its cu
    for _ in range(2):
        got = dt.block_indexer_logits(*one, 3, max_len=70, max_q=2, check_values=False)
        ref = dt.block_indexer_logits(*one, 3)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_cached_plans_of_the_step_ops():
    """block_scores and selected_page_logits with value checks off and sizes given: repeated calls (cached
    plans) give the checked answers; float sizes still raise."""
    cache, q, w, limits, cu = problem(16, seed=6)
    base = (q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits, 16)
    fast = dict(cu_seqlens_q=cu, max_q=3, check_values=False)
    bounds = dt.block_scores(*base, cu_seqlens_q=cu, num_cols=5)
    pages = dt.select_pages(bounds, 2)
    sel = (q, w, cache.ik, cache.ik_scale, cache.block_table, cache.seq_lens, limits, pages)
    logits, pos = dt.selected_page_logits(*sel, cu_seqlens_q=cu)
    for _ in range(2):
        with poisoned_allocations():
            assert torch.equal(dt.block_scores(*base, num_cols=5, **fast), bounds)
            got = dt.selected_page_logits(*sel, **fast)
        assert torch.equal(got[0], logits) and torch.equal(got[1], pos)
    with pytest.raises(ValueError, match="^page_size"):
        dt.block_scores(*base[:7], 16.0, num_cols=5, **fast)
    with pytest.raises(ValueError, match="^num_cols"):
        dt.block_scores(*base, num_cols=5.0, **fast)
    with pytest.raises(ValueError, match="^max_q"):
        dt.selected_page_logits(*sel, cu_seqlens_q=cu, max_q=3.0, check_values=False)


def test_hostprof_stubs_every_launch():
    """The host-time probe counts each op's launches (none reaches the interpreter) and restores torch.empty."""
    from dsa_triton.bench.hostprof import host_times

    empty = torch.empty
    rows = {r["op"]: r for r in host_times(torch.device("cpu"), ["block_indexer", "topk_indices T=1"], calls=2, rounds=1)}
    assert torch.empty is empty
    assert rows["block_indexer_logits"]["launches"] == 3 and rows["topk_indices T=1"]["launches"] == 3
    assert all(r["host_us"] > 0 for r in rows.values())


def test_non_finite_keys_and_queries_give_nan_never_a_score():
    """Value checks off: a key appended with an inf or a NaN has NaN logits for every row that sees it and its page a
    NaN bound, which select_pages never takes, so the block path never returns it; every other logit and bound
    equals the reference. On a GPU, a NaN in one query head makes that row's logits and bounds NaN (relu keeps NaN)."""
    device = default_device()  # runs on a GPU where there is one: the GPU's max drops NaN unless told not to
    P, DK, H, lens = 16, 32, 8, [40, 20]
    g = torch.Generator().manual_seed(0)
    cache = dt.PagedCache(8, P, 2, kv_dim=0, index_dim=DK, device=device, poison=True)
    keys = torch.randn(60, DK, generator=g)
    keys[21, 5], keys[45, 0] = float("inf"), float("nan")  # sequence 0's page 1, sequence 1's page 0
    cache.append([0, 1], lens, None, keys.to(device), check_values=False)
    limits, cu = (t.to(device) for t in decode_rows(lens, [2, 1]))
    q, w = (t.to(device) for t in random_queries(3, H, DK, g))
    table, seq_lens = cache.block_table, cache.seq_lens
    nan_at = torch.zeros(3, 40, dtype=torch.bool)
    nan_at[:2, 21] = nan_at[2, 5] = True
    out = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=table,
                            seq_lens=seq_lens).cpu()
    ref = indexer_logits_torch(*(t.cpu() for t in (q, w, cache.ik, cache.ik_scale, limits)), 40, cu_seqlens_q=cu.cpu(),
                               block_table=table.cpu())
    assert torch.equal(out.isnan(), nan_at) and torch.equal(ref.isnan(), nan_at)
    assert compare_logits(out.where(~nan_at, 0.0), ref.where(~nan_at, 0.0), rtol=1e-5) is None
    bounds = dt.block_scores(q, w, cache.pmax, cache.pmin, table, seq_lens, limits, P, cu_seqlens_q=cu).cpu()
    ref_bounds = page_bounds_torch(*(t.cpu() for t in (q, w, cache.pmax, cache.pmin, table, limits)), P, 3, cu.cpu())
    bad_page = torch.tensor([[False, True, False]] * 2 + [[True, False, False]])
    assert torch.equal(bounds.isnan(), bad_page) and torch.equal(ref_bounds.isnan(), bad_page)
    assert compare_logits(bounds.where(~bad_page, 0.0), ref_bounds.where(~bad_page, 0.0), rtol=1e-5) is None
    assert dt.select_pages(bounds.to(device), 3).tolist() == [[0, 2, -1], [0, 2, -1], [1, -1, -1]]
    logits, pos = dt.block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, table, seq_lens,
                                          limits, 3, cu_seqlens_q=cu)
    assert not bool(logits.isnan().any())
    assert not bool(((pos // P == 1)[:2]).any()) and not bool(((pos >= 0) & (pos < 16))[2].any())
    if interpreting():
        return  # the interpreter reads the e4m3 NaN byte as 480: the query half runs on a GPU only
    q_nan = q.clone()
    q_nan.view(torch.uint8)[1, 3, 7] = 0x7F  # e4m3 NaN in one head of row 1 (value checks on: a ValueError)
    out = dt.indexer_logits(q_nan, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=table,
                            seq_lens=seq_lens, check_values=False).cpu()
    assert bool(out[1, :40].isnan().all()) and torch.equal(out[[0, 2]].isnan(), nan_at[[0, 2]])
    bounds = dt.block_scores(q_nan, w, cache.pmax, cache.pmin, table, seq_lens, limits, P, cu_seqlens_q=cu,
                             check_values=False).cpu()
    assert bool(bounds[1].isnan().all()) and torch.equal(bounds[[0, 2]].isnan(), bad_page[[0, 2]])
    assert dt.select_pages(bounds.to(device), 3)[1].tolist() == [-1, -1, -1]
