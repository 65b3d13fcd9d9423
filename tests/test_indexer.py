"""Token-level indexer logits (Triton interpreter) against the PyTorch reference."""
import pytest
import torch

import dsa_triton as dt
from dsa_triton.attention.formats import fp8_quantize_rows
from dsa_triton.attention.indexer_logits_spec import compare_logits, random_queries
from dsa_triton.attention.indexer_logits_reference import indexer_logits_torch

from .poison import check_registry_entry, poisoned_allocations


def paged_cache(lens, P, DK, seed=0, spare_pages=3):
    """A NaN-poisoned cache filled by the append kernel: sequence b holds lens[b] random keys."""
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // P) for n in lens) + spare_pages
    cache = dt.PagedCache(pages, P, len(lens), kv_dim=0, index_dim=DK, device="cpu", poison=True)
    cache.allocator.allocate(1)  # page 0 stays poisoned and unused
    cache.append(range(len(lens)), lens, None, torch.randn(sum(lens), DK, generator=g) * 3)
    return cache


def decode_rows(lens, rows_per_seq):
    """Limits of the last rows_per_seq[b] positions of each sequence (causal), and cu_seqlens_q."""
    limits = [max(0, n - r + 1 + j) for n, r in zip(lens, rows_per_seq) for j in range(r)]
    cu = torch.tensor([0] + rows_per_seq).cumsum(0).int()
    return torch.tensor(limits, dtype=torch.int32), cu


@pytest.mark.parametrize("P", [16, 64])
def test_decode_paged_mixed_lengths(P):
    lens, rows = [70, 0, 5, 33, 1], [1, 2, 4, 3, 0]  # a zero-length sequence and one without query rows
    H, DK = 6, 48  # neither a power of two
    cache = paged_cache(lens, P, DK, seed=P)
    limits, cu = decode_rows(lens, rows)
    q, w = random_queries(int(cu[-1]), H, DK, torch.Generator().manual_seed(1))
    kw = dict(cu_seqlens_q=cu, block_table=cache.block_table)
    with poisoned_allocations():  # outputs start as NaN: an element the kernel skips shows
        out = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, seq_lens=cache.seq_lens, num_cols=75, **kw)
    ref = indexer_logits_torch(q, w, cache.ik, cache.ik_scale, limits, 75, **kw)
    assert compare_logits(out, ref, rtol=1e-5) is None  # also: no NaN from the poisoned slots
    assert bool(out[limits == 0].isneginf().all())
    assert bool(out[:, 70:].isneginf().all())
    fast = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, seq_lens=cache.seq_lens, num_cols=75, max_q=4,
                             check_values=False, **kw)  # no device-to-host transfer
    assert torch.equal(fast, out)


@pytest.mark.parametrize("P,block_m", [(16, 2), (64, 1)])
def test_decode_paged_several_chunks(P, block_m):
    """Chunks of 128 columns (several per sequence, 8 or 2 pages each): the pages each program loads
    before its tile loop and gathers per tile."""
    lens, rows = [300, 130, 0], [2, 1, 1]
    cache = paged_cache(lens, P, 32, seed=P + 1)
    limits, cu = decode_rows(lens, rows)
    q, w = random_queries(int(cu[-1]), 8, 32, torch.Generator().manual_seed(3))
    kw = dict(cu_seqlens_q=cu, block_table=cache.block_table)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 32, "CHUNK": 128, "num_warps": 4, "num_stages": 3}
    with poisoned_allocations():
        out = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, seq_lens=cache.seq_lens, config=cfg, **kw)
    ref = indexer_logits_torch(q, w, cache.ik, cache.ik_scale, limits, 300, **kw)
    assert compare_logits(out, ref, rtol=1e-5) is None


@pytest.mark.parametrize("block_m,block_n,chunk", [(1, 32, 128), (2, 64, 128), (4, 128, 512)])
def test_prefill_contiguous_several_sequences(block_m, block_n, chunk):
    g = torch.Generator().manual_seed(block_m)
    H, DK = 8, 32
    lens, rows = [150, 9, 40], [7, 9, 0]
    k8, scale = fp8_quantize_rows(torch.randn(sum(lens), DK, generator=g))
    starts = torch.tensor([0] + lens[:-1]).cumsum(0).int()
    limits, cu = decode_rows(lens, rows)
    q, w = random_queries(int(cu[-1]), H, DK, g)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "CHUNK": chunk, "num_warps": 4, "num_stages": 2}
    with poisoned_allocations():
        out = dt.indexer_logits(q, w, k8, scale, limits, cu_seqlens_q=cu, key_starts=starts, config=cfg)
    ref = indexer_logits_torch(q, w, k8, scale, limits, 150, cu_seqlens_q=cu, key_starts=starts)
    assert compare_logits(out, ref, rtol=1e-5) is None


def test_prefill_paged_many_rows():
    lens = [45]
    cache = paged_cache(lens, 16, 32, seed=5)
    limits = torch.arange(1, 46, dtype=torch.int32)  # every row of a 45-token prefill, causal
    q, w = random_queries(45, 8, 32, torch.Generator().manual_seed(2))
    with poisoned_allocations():
        out = dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, block_table=cache.block_table,
                                seq_lens=cache.seq_lens)
    ref = indexer_logits_torch(q, w, cache.ik, cache.ik_scale, limits, 45, block_table=cache.block_table)
    assert compare_logits(out, ref, rtol=1e-5) is None
    assert compare_logits(out, ref.roll(1, dims=1)) is not None  # the check can fail


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_registry_entry(phase):
    check_registry_entry("indexer_logits", phase, 7)


def test_bad_inputs():
    cache = paged_cache([20, 3], 16, 32)
    limits, cu = decode_rows([20, 3], [1, 1])
    q, w = random_queries(2, 4, 32, torch.Generator().manual_seed(0))
    args = (q, w, cache.ik, cache.ik_scale, limits)
    kw = dict(cu_seqlens_q=cu, block_table=cache.block_table, seq_lens=cache.seq_lens)
    call = lambda *a, **k: dt.indexer_logits(*a, **{**kw, **k})  # noqa: E731
    call(*args)  # valid
    with pytest.raises(ValueError, match="^q: dtype"):
        call(q.float(), *args[1:])
    with pytest.raises(ValueError, match="^weights"):
        call(q, w[:, :2], *args[2:])
    with pytest.raises(ValueError, match="^limits: a row's limit"):
        call(q, w, cache.ik, cache.ik_scale, limits + 1)
    with pytest.raises(ValueError, match="^limits: must be >= 0"):
        call(q, w, cache.ik, cache.ik_scale, limits - 5)
    with pytest.raises(ValueError, match="^cu_seqlens_q"):
        call(*args, cu_seqlens_q=torch.tensor([0, 2, 1], dtype=torch.int32))
    bad_table = cache.block_table.clone()
    bad_table[0, 1] = 99
    with pytest.raises(ValueError, match="^block_table"):
        call(*args, block_table=bad_table)
    with pytest.raises(ValueError, match="^seq_lens: required"):
        call(*args, seq_lens=None)
    with pytest.raises(ValueError, match="^k_scale"):
        call(q, w, cache.ik, cache.ik_scale[:, :8], limits)
    with pytest.raises(ValueError, match="^k: page size"):
        call(q, w, cache.ik[:, :8], cache.ik_scale[:, :8], limits)
    with pytest.raises(ValueError, match="^k: must be contiguous"):
        call(q, w, cache.ik.transpose(0, 1).contiguous().transpose(0, 1), cache.ik_scale, limits)
    with pytest.raises(ValueError, match="^num_cols"):
        call(*args, num_cols=-1)
    with pytest.raises(ValueError, match="^max_q: a sequence has more than"):
        call(*args, cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32), max_q=1)
    for name, bad in (("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 1, 1], dtype=torch.int32))),  # ends before T
                      ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 1, 2], dtype=torch.int32))),
                      ("seq_lens", dict(seq_lens=torch.tensor([20, -1], dtype=torch.int32))),
                      ("seq_lens", dict(seq_lens=torch.tensor([20, 16 * cache.block_table.shape[1] + 1],
                                                              dtype=torch.int32))),
                      ("block_table", dict(block_table=cache.block_table.clone().index_fill_(1, torch.tensor([0]), -1)))):
        with pytest.raises(ValueError, match=f"^{name}"):
            call(*args, **bad)
    k8, scale = cache.ik.view(-1, 32)[16:40], cache.ik_scale.view(-1)[16:40]
    with pytest.raises(ValueError, match="^limits: key_starts"):
        dt.indexer_logits(q, w, k8, scale, limits, cu_seqlens_q=cu, key_starts=torch.tensor([0, 22], dtype=torch.int32))
    for starts in ([-1, 0], [0, 25]):
        with pytest.raises(ValueError, match="^key_starts"):
            dt.indexer_logits(q, w, k8, scale, limits * 0, cu_seqlens_q=cu, key_starts=torch.tensor(starts,
                                                                                                  dtype=torch.int32))


def test_sizes_past_int32_raise_naming_them():
    """num_cols and max_q size the output and the grid: past 2^31 - 1 a ValueError names each (num_cols = 2^31
    named "max_q, num_cols" as one launch's limit, and max_q = 2^40 failed a device check on a wrapped value)."""
    cache = paged_cache([20, 3], 16, 32)
    limits, cu = decode_rows([20, 3], [1, 1])
    q, w = random_queries(2, 4, 32, torch.Generator().manual_seed(0))
    kw = dict(cu_seqlens_q=cu, block_table=cache.block_table, seq_lens=cache.seq_lens)
    for name, extra in (("num_cols", dict(num_cols=2**31)), ("max_q", dict(max_q=2**40)),
                        ("max_q", dict(max_q=2**31, num_cols=20, check_values=False))):
        with pytest.raises(ValueError, match=f"^{name}: must be"):
            dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, **kw, **extra)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_bytes_in_q_raise_with_value_checks(byte):
    """An e4m3 NaN byte ((byte & 0x7F) == 0x7F) in q: with value checks on (the default) every indexer op raises a
    ValueError naming q, within the checks' one transfer (the interpreter reads the byte as +-480, so the logits
    came out finite); with checks off nothing is read (on a GPU the NaN propagates to the row's logits)."""
    cache = paged_cache([20, 3], 16, 32)
    limits, cu = decode_rows([20, 3], [2, 1])
    q, w = random_queries(3, 4, 32, torch.Generator().manual_seed(1))
    table, lens = cache.block_table, cache.seq_lens
    bounds = dt.block_scores(q, w, cache.pmax, cache.pmin, table, lens, limits, 16, cu_seqlens_q=cu)
    pages = dt.select_pages(bounds, 2)
    q.view(torch.uint8)[1, 2, 5] = byte
    calls = (lambda **kw: dt.indexer_logits(q, w, cache.ik, cache.ik_scale, limits, cu_seqlens_q=cu, block_table=table,
                                            seq_lens=lens, **kw),
             lambda **kw: dt.block_scores(q, w, cache.pmax, cache.pmin, table, lens, limits, 16, cu_seqlens_q=cu, **kw),
             lambda **kw: dt.selected_page_logits(q, w, cache.ik, cache.ik_scale, table, lens, limits, pages,
                                                  cu_seqlens_q=cu, **kw),
             lambda **kw: dt.block_indexer_logits(q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, table, lens,
                                                  limits, 2, cu_seqlens_q=cu, **kw))
    for call in calls:
        with pytest.raises(ValueError, match="^q: "):
            call()
        call(check_values=False)


def test_cached_plan_of_the_fast_path():
    """Value checks off with the sizes given: the checked plan is cached; repeated calls give the checked
    answer into fresh (poisoned) outputs, with the key_starts / cu it made or the caller's new ones, and
    bad scalars or other metadata still raise."""
    g = torch.Generator().manual_seed(4)
    k8, scale = fp8_quantize_rows(torch.randn(60, 32, generator=g))
    limits, cu = decode_rows([30, 30], [2, 1])
    q, w = random_queries(3, 8, 32, g)
    starts = torch.tensor([0, 30], dtype=torch.int32)
    fast = dict(num_cols=30, max_q=2, check_values=False)
    for kw in (dict(cu_seqlens_q=cu, key_starts=starts), dict(cu_seqlens_q=cu)):
        ref = dt.indexer_logits(q, w, k8, scale, limits, **kw)
        for _ in range(2):
            with poisoned_allocations():
                assert torch.equal(dt.indexer_logits(q, w, k8, scale, limits, **kw, **fast), ref)
    other = torch.tensor([30, 0], dtype=torch.int32)  # same metadata, other values: the call's own tensor is used
    ref = dt.indexer_logits(q, w, k8, scale, limits, cu_seqlens_q=cu, key_starts=other)
    assert torch.equal(dt.indexer_logits(q, w, k8, scale, limits, cu_seqlens_q=cu, key_starts=other, **fast), ref)
    one = dict(num_cols=30, check_values=False)  # one sequence, no cu
    assert torch.equal(dt.indexer_logits(q[:2], w[:2], k8, scale, limits[:2], **one),
                       dt.indexer_logits(q[:2], w[:2], k8, scale, limits[:2], num_cols=30))
    for name, bad in (("num_cols", dict(num_cols=30.0)), ("max_q", dict(max_q=2.0)), ("q", dict(q=q.view(torch.uint8)))):
        args = {"q": q, **fast, **bad}
        with pytest.raises(ValueError, match=f"^{name}"):
            dt.indexer_logits(args.pop("q"), w, k8, scale, limits, cu_seqlens_q=cu, **args)
