"""Sparse paged attention (Triton interpreter on CPU; fp16, and bf16 in one test) against the fp32 PyTorch reference.

Every cache slot no sequence owns is NaN, and every buffer the op allocates (out, lse, split partials)
starts as NaN: a stray read or an unwritten element shows up in the result.
"""
import pytest
import torch

import dsa_triton as dt
from dsa_triton import registry
from dsa_triton.plans import PlanCache
from dsa_triton.attention import sparse_attention, sparse_attention_kernels
from dsa_triton.attention.cache import PagedCache
from dsa_triton.attention.sparse_attention_spec import random_paged_cache
from dsa_triton.attention.sparse_attention_reference import (slots_from_indices, sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)

from .poison import poisoned_allocations

D, DV = 80, 64  # 64 value dims + 16 rope dims: the DSA split (512 + 64) in small
CFG = {"BLOCK_N": 16, "BLOCK_H": 16, "num_splits": 1, "num_warps": 4, "num_stages": 2}


@pytest.fixture(autouse=True)
def poisoned_buffers():
    with poisoned_allocations():
        yield


def paged_cache(seqs: int, L: int, P: int, g: torch.Generator):
    """fp16 ``kv[pages, P, D]``, NaN outside the ``seqs`` sequences of ``L`` tokens, and their block table."""
    return random_paged_cache(seqs, L, P, D, torch.float16, g)


def pick(rows: int, L: int, k: int, valid: list[int], g: torch.Generator) -> torch.Tensor:
    """``[rows, k]`` int32: up to ``valid[r % len(valid)]`` distinct positions below ``L`` in random columns, -1 elsewhere."""
    idx = torch.rand(rows, max(L, k), generator=g).argsort(dim=1)[:, :k]
    idx = torch.where(idx < L, idx, -1)
    counts = torch.tensor([valid[r % len(valid)] for r in range(rows)])
    idx = torch.where(torch.arange(k)[None, :] < counts[:, None], idx, -1)
    return idx.gather(1, torch.rand(rows, k, generator=g).argsort(dim=1)).to(torch.int32)


def check(out, lse, ref_out, ref_lse, dtype=torch.float16):
    """Against the fp32 reference: out within 1e-3 + 2e-3 |ref| for fp16 (5e-3 + 1e-2 |ref| for bf16, whose
    probabilities are rounded to 8 bits before the value dot), lse within 2e-5."""
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    assert bool((out[empty] == 0).all())
    atol, rtol = (5e-3, 1e-2) if dtype == torch.bfloat16 else (1e-3, 2e-3)
    torch.testing.assert_close(out.float(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=2e-5, rtol=0)


@pytest.mark.parametrize("H, S, per_token, P, logical, block_h", [
    (1, None, False, 16, False, 16),   # q [B, Hq, D], physical slots
    (3, 2, False, 16, True, 16),       # 2 tokens sharing one index set: a 6-row tile; block table
    (16, 4, True, 64, True, 16),       # 4 tokens with their own index sets; block table, page 64
    (5, 3, True, 64, False, 16),       # per-token sets, physical slots
    (24, 1, False, 16, True, 32),      # a tensor-parallel shard's head count: 24 rows in a 32-row tile
])
def test_decode(H, S, per_token, P, logical, block_h):
    g = torch.Generator().manual_seed(H * 10 + P)
    B, L, k = 4, 70, 40
    kv, table = paged_cache(B, L, P, g)
    q = torch.randn((B, H, D) if S is None else (B, S, H, D), generator=g).half()
    rows = B * (S or 1) if per_token else B
    idx = pick(rows, L, k, [k, 9, 0, 1], g)  # full, -1 padded, all invalid, one valid
    bt = table.repeat_interleave(S or 1, dim=0) if per_token else table
    slots = slots_from_indices(idx, bt, P).to(torch.int32)
    shape = (B, S) if per_token else (B,)
    indices = (idx if logical else slots).view(*shape, k)
    table_arg = table if logical else None
    config = {**CFG, "BLOCK_H": block_h}
    out, lse = dt.sparse_attention_decode(q, kv, indices, 0.2, d_v=DV, block_table=table_arg, config=config)
    check(out, lse, *sparse_attention_decode_torch(q, kv, indices, 0.2, DV, table_arg))
    flat = dt.sparse_attention_decode(q, kv.flatten(0, 1), slots.view(*shape, k), 0.2, d_v=DV, config=config)
    assert torch.equal(flat[0], out) and torch.equal(flat[1], lse)  # the same rows through the flat cache


@pytest.mark.parametrize("k, config", [
    (1, {}),
    (17, {"BLOCK_N": 16, "num_splits": 2}),
    (64, {"BLOCK_N": 16, "num_splits": 4, "BLOCK_H": 32, "num_warps": 8}),  # rows 3/4: later splits all -1
    (64, {"BLOCK_N": 32, "num_splits": 2, "num_stages": 1}),
])
def test_decode_k_and_splits(k, config):
    g = torch.Generator().manual_seed(k)
    B, H, L = 4, 9, 80  # 2 tokens x 9 heads: 18 rows
    kv, table = paged_cache(1, L, 16, g)
    q = torch.randn(B, 2, H, D, generator=g).half()
    idx = pick(B, L, k, [k, max(1, k // 2), 0, 1], g)
    idx[2:, k // 4:] = -1  # valid indices only in the first split(s)
    slots = slots_from_indices(idx, table.expand(B, -1), 16).to(torch.int32)
    out, lse = dt.sparse_attention_decode(q, kv, slots, 0.15, d_v=DV, config={**CFG, **config})
    check(out, lse, *sparse_attention_decode_torch(q, kv, slots, 0.15, DV))


def test_combine_in_column_chunks(monkeypatch):
    """The combine over several column chunks of d_v (as at d_v=512 with 32 splits), some splits empty."""
    monkeypatch.setattr(sparse_attention_kernels, "COMBINE_ELEMENTS", 64)  # 4 splits -> 16-column chunks
    monkeypatch.setattr(sparse_attention, "_DECODE_PLANS", PlanCache())  # plans made with the constant changed
    g = torch.Generator().manual_seed(11)
    B, H, L, k = 3, 5, 64, 64
    kv, table = paged_cache(1, L, 16, g)
    q = torch.randn(B, H, D, generator=g).half()
    idx = pick(B, L, k, [k, 20, 0], g)
    idx[1, k // 2:] = -1  # row 1: the last two splits empty
    slots = slots_from_indices(idx, table.expand(B, -1), 16).to(torch.int32)
    out, lse = dt.sparse_attention_decode(q, kv, slots, 0.2, d_v=DV, config={**CFG, "num_splits": 4})
    check(out, lse, *sparse_attention_decode_torch(q, kv, slots, 0.2, DV))


@pytest.mark.parametrize("H, P, table_rows", [(3, 16, 1), (16, 64, 2), (2, 16, 0)])
def test_prefill(H, P, table_rows):
    """Each token its own index set; the block table shared ([1, pages]), per token ([T, pages]) or none."""
    g = torch.Generator().manual_seed(H + P)
    L = 50
    kv, table = paged_cache(max(table_rows, 1), L, P, g)
    prefill_and_check(torch.randn(6, H, D, generator=g).half(), kv, table, L, table_rows, 0.3, DV, g)


def prefill_and_check(q, kv, table, L: int, table_rows: int, sm_scale: float, d_v: int, g: torch.Generator) -> None:
    """Prefill of ``q[T, H, D]``, 24 indices a token (full, 3 valid, none), over sequences of ``L`` tokens in ``kv``
    with block table ``table``: shared (``table_rows`` 1), per token (2: tokens alternate between two sequences)
    or physical slots (0); checked against the reference."""
    T, P, k = q.shape[0], kv.shape[1], 24
    idx = pick(T, L, k, [k, 3, 0], g)
    if table_rows == 0:
        indices, bt = slots_from_indices(idx, table.expand(T, -1), P).to(torch.int32), None
    else:
        indices, bt = idx, table if table_rows == 1 else table[torch.arange(T) % table_rows]
    out, lse = dt.sparse_attention_prefill(q, kv, indices, sm_scale, d_v=d_v, block_table=bt,
                                           config={**CFG, "num_splits": 2})
    check(out, lse, *sparse_attention_prefill_torch(q, kv, indices, sm_scale, d_v, bt))


def test_decode_from_paged_cache():
    """Indices into the cache helper's latent KV cache through its block table (page 16, three sequences)."""
    g = torch.Generator().manual_seed(3)
    cache = PagedCache(num_pages=12, page_size=16, max_seqs=3, max_pages_per_seq=4, kv_dim=D, index_dim=32,
                       dtype=torch.float16, device="cpu", poison=True)
    lens = [33, 5, 60]
    cache.append([0, 1, 2], lens, torch.randn(sum(lens), D, generator=g).half(), torch.randn(sum(lens), 32, generator=g))
    idx = torch.stack([pick(1, n, 20, [min(n, 20)], g)[0] for n in lens])
    q = torch.randn(3, 4, D, generator=g).half()
    out, lse = dt.sparse_attention_decode(q, cache.kv, idx, 0.1, d_v=DV, block_table=cache.block_table[:3])
    check(out, lse, *sparse_attention_decode_torch(q, cache.kv, idx, 0.1, DV, cache.block_table[:3]))


def test_out_of_range_indices_rejected_or_skipped():
    g = torch.Generator().manual_seed(5)
    P, L, k = 16, 40, 16
    kv, table = paged_cache(2, L, P, g)
    q = torch.randn(2, 3, D, generator=g).half()
    idx = pick(2, L, k, [k, 8], g)
    num_slots = kv.shape[0] * P
    bad_slots = slots_from_indices(idx, table, P).to(torch.int32)
    bad_slots[0, 3], bad_slots[1, 0] = num_slots, -7
    with pytest.raises(ValueError, match="indices"):
        dt.sparse_attention_decode(q, kv, bad_slots, 0.2, d_v=DV)
    out, lse = dt.sparse_attention_decode(q, kv, bad_slots, 0.2, d_v=DV, config=CFG, check_values=False)
    skipped = torch.where((bad_slots >= 0) & (bad_slots < num_slots), bad_slots, -1)
    check(out, lse, *sparse_attention_decode_torch(q, kv, skipped, 0.2, DV))

    bad_pos = idx.clone()
    bad_pos[0, 5] = table.shape[1] * P  # past the block table
    with pytest.raises(ValueError, match="indices"):
        dt.sparse_attention_decode(q, kv, bad_pos, 0.2, d_v=DV, block_table=table)
    bad_table = table.clone()
    bad_table[1, 0], bad_table[0, 1] = -1, kv.shape[0]  # an unmapped page and a page past the cache
    row = torch.arange(2)[:, None]
    used = (idx >= 0) & (((row == 1) & (idx // P == 0)) | ((row == 0) & (idx // P == 1)))
    assert used.any()
    with pytest.raises(ValueError, match="block_table"):
        dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=DV, block_table=bad_table)
    for indices, bt, skip in ((bad_pos, table, bad_pos >= table.shape[1] * P), (idx, bad_table, used)):
        out, lse = dt.sparse_attention_decode(q, kv, indices, 0.2, d_v=DV, block_table=bt, config=CFG,
                                              check_values=False)
        check(out, lse, *sparse_attention_decode_torch(q, kv, torch.where(skip, -1, indices), 0.2, DV, table))


@pytest.mark.parametrize("decode", [True, False])
def test_bf16_against_the_reference(decode):
    """bf16 (a documented dtype) through both ops; in the interpreter the kernels upcast bf16 dot operands to fp32
    (its bf16 ``tl.dot`` returns garbage)."""
    g = torch.Generator().manual_seed(21)
    B, H, L, k, P = 3, 4, 48, 24, 16
    kv, table = random_paged_cache(B if decode else 1, L, P, D, torch.bfloat16, g)
    q = torch.randn(B, H, D, generator=g).bfloat16()
    idx = pick(B, L, k, [k, 7, 0], g)
    bt = table if decode else table.expand(B, -1)
    slots = slots_from_indices(idx, bt, P).to(torch.int32)
    config = {**CFG, "num_splits": 2}
    if decode:
        out, lse = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=DV, block_table=table, config=config)
        ref = sparse_attention_decode_torch(q, kv, idx, 0.2, DV, table)
    else:
        out, lse = dt.sparse_attention_prefill(q, kv, slots, 0.2, d_v=DV, config=config)
        ref = sparse_attention_prefill_torch(q, kv, slots, 0.2, DV)
    check(out, lse, *ref, dtype=torch.bfloat16)


class _Recorded:
    """A launchable stand-in for a Gluon kernel: notes each launch and its keywords, then runs the Triton kernel on
    them (and the values of the arguments it takes beyond the Gluon kernel's in a DeepSeek-V3.2 call)."""

    def __init__(self):
        self.launches, self.meta = 0, None

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.launches += 1
            self.meta = meta
            return sparse_attention_kernels._sparse_attention_fwd[grid](
                *args, *sparse_attention_kernels.NO_EXTRA_ARGS, **meta)
        return run


def test_plans_that_gluon_serves_launch_it_on_aligned_pointers_only(monkeypatch):
    """A plan :func:`gluon_applies` to (on the CPU: patched true) launches the Gluon kernel (over a bf16-style cache:
    the seesaw's, at 4 warps) when q and the cache are 16-byte aligned, the Triton kernel otherwise; its outputs are
    the contract's either way (the stand-in runs the Triton kernel)."""
    stand_in = _Recorded()
    monkeypatch.setattr(sparse_attention_kernels, "_sparse_attention_fwd_seesaw", stand_in)
    monkeypatch.setattr(sparse_attention, "gluon_applies", lambda *args: True)
    monkeypatch.setattr(sparse_attention, "_DECODE_PLANS", PlanCache())
    g = torch.Generator().manual_seed(5)
    B, H, L, k, P = 2, 4, 40, 24, 16
    kv, table = random_paged_cache(B, L, P, D, torch.float16, g)
    idx = pick(B, L, k, [k, 9], g)
    q_storage = torch.randn(B * H * D + 8, generator=g).half()
    for offset, gluon in ((0, 1), (4, 0)):  # 4 fp16 elements: an 8-byte aligned q
        q = q_storage[offset:offset + B * H * D].view(B, H, D)
        before = stand_in.launches
        out, lse = dt.sparse_attention_decode(q, kv, idx, 0.3, d_v=DV, block_table=table, config=CFG)
        assert stand_in.launches - before == gluon
        check(out, lse, *sparse_attention_decode_torch(q, kv, idx, 0.3, DV, table))
    assert stand_in.meta["num_warps"] == 4 and "KV_FP8" not in stand_in.meta


def test_a_launch_takes_the_seesaw_over_either_cache():
    from dsa_triton.attention.sparse_attention_seesaw import GLUON_CONFIG, _sparse_attention_fwd_seesaw

    config = {**GLUON_CONFIG, "num_splits": 2}
    for fp8 in (False, True):
        launch = sparse_attention_kernels.AttentionLaunch(576, 512, 2048, 1, torch.bfloat16, fp8, config)
        assert launch.gluon_kernel == (_sparse_attention_fwd_seesaw, {**launch.fwd_meta, "num_warps": 4})
        assert launch.fwd_meta.get("KV_FP8", False) == fp8


@pytest.mark.parametrize("d, d_v", [(72, 40), (100, 64)])  # value part, then rope part, not a power of two
@pytest.mark.parametrize("decode", [True, False])
def test_head_dims_that_are_not_powers_of_two(d, d_v, decode):
    """Padded head-dim blocks: the tile mask's column term keeps q, the cache rows and out inside each row
    (without it the padding reads the next part or row and out writes into the next row)."""
    g = torch.Generator().manual_seed(d + d_v)
    B, H, L, k, P = 3, 5, 40, 20, 16
    kv, table = random_paged_cache(1, L, P, d, torch.float16, g)
    q = torch.randn(B, H, d, generator=g).half()
    slots = slots_from_indices(pick(B, L, k, [k, 6, 0], g), table.expand(B, -1), P).to(torch.int32)
    op, oracle = ((dt.sparse_attention_decode, sparse_attention_decode_torch) if decode else
                  (dt.sparse_attention_prefill, sparse_attention_prefill_torch))
    out, lse = op(q, kv, slots, 0.2, d_v=d_v, config=CFG)
    check(out, lse, *oracle(q, kv, slots, 0.2, d_v))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_nan_in_q_or_a_read_cache_row_gives_nan(num_splits):
    """NaN in, NaN out (value checks off or on: they look at indices only): a NaN in q makes its row's out and lse
    NaN; a NaN in a cache row makes NaN every row that reads it. An lse of -inf would claim an empty row."""
    g = torch.Generator().manual_seed(num_splits)
    B, H, L, k, P = 3, 4, 48, 32, 16
    kv, table = paged_cache(1, L, P, g)
    q = torch.randn(B, H, D, generator=g).half()
    slots = slots_from_indices(pick(B, L, k, [k, 5, 0], g), table.expand(B, -1), P).to(torch.int32)
    q[0, 1, 3] = float("nan")
    read_by_1_only = int(next(s for s in slots[1].tolist() if s >= 0 and s not in slots[0].tolist()))
    kv.view(-1, D)[read_by_1_only, D - 2] = float("nan")  # a rope dim: it enters the score only
    config = {**CFG, "num_splits": num_splits}
    for out, (ref_out, ref_lse) in (
            (dt.sparse_attention_decode(q, kv, slots, 0.2, d_v=DV, config=config, check_values=False),
             sparse_attention_decode_torch(q, kv, slots, 0.2, DV)),
            (dt.sparse_attention_prefill(q, kv, slots, 0.2, d_v=DV, config=config),
             sparse_attention_prefill_torch(q, kv, slots, 0.2, DV))):
        out, lse = out
        nan_rows = torch.zeros(B, H, dtype=torch.bool)
        nan_rows[0, 1] = nan_rows[1] = True
        assert torch.equal(ref_lse.isnan(), nan_rows)  # the reference's policy, the same
        assert torch.equal(lse.isnan(), nan_rows) and bool(out[nan_rows].isnan().all())
        check(out[~nan_rows], lse[~nan_rows], ref_out[~nan_rows], ref_lse[~nan_rows])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_an_infinite_score_gives_nan_in_the_kernel_and_the_reference(num_splits):
    """A +inf score (here +inf in q against a positive key dim) has no softmax: the kernel's online softmax meets
    inf - inf, and the reference (whose lse was +inf) agrees: NaN out and NaN lse for that query row, the others as
    before. A -inf score is a probability of 0, like a skipped index (every score -inf: out 0, lse -inf)."""
    g = torch.Generator().manual_seed(7 + num_splits)
    B, H, L, k, P = 3, 4, 48, 32, 16
    kv, table = paged_cache(1, L, P, g)
    kv[..., D - 1] = kv[..., D - 1].abs() + 0.5  # a rope dim positive in every row (NaN rows stay NaN)
    q = torch.randn(B, H, D, generator=g).half()
    slots = slots_from_indices(pick(B, L, k, [k, 5, 9], g), table.expand(B, -1), P).to(torch.int32)
    q[0, 1, D - 1] = float("inf")
    q[2, 3, D - 1] = float("-inf")  # every score of row (2, 3) is -inf: as if no index were valid
    config = {**CFG, "num_splits": num_splits}
    keep = torch.ones(B, H, dtype=torch.bool)
    keep[0, 1] = False
    for op, oracle in ((dt.sparse_attention_decode, sparse_attention_decode_torch),
                       (dt.sparse_attention_prefill, sparse_attention_prefill_torch)):
        out, lse = op(q, kv, slots, 0.2, d_v=DV, config=config)
        ref_out, ref_lse = oracle(q, kv, slots, 0.2, DV)
        assert bool(ref_lse[0, 1].isnan()) and bool(ref_out[0, 1].isnan().all())
        assert bool(lse[0, 1].isnan()) and bool(out[0, 1].isnan().all())
        assert lse[2, 3] == ref_lse[2, 3] == float("-inf")
        check(out[keep], lse[keep], ref_out[keep], ref_lse[keep])


def test_out_of_range_indices_raise_before_launch(monkeypatch):
    """With check_values on (the default) an index outside the cache raises a ValueError naming ``indices``
    before any launch; off, nothing is checked on the host."""
    from dsa_triton.attention import sparse_attention

    g = torch.Generator().manual_seed(4)
    kv, table = paged_cache(1, 32, 16, g)
    q = torch.randn(2, 3, D, generator=g).half()
    slots = slots_from_indices(pick(2, 32, 8, [8], g), table.expand(2, -1), 16).to(torch.int32)
    slots[1, 2] = kv.shape[0] * 16
    launched, launch = [], sparse_attention.sparse_attention_fwd
    monkeypatch.setattr(sparse_attention, "sparse_attention_fwd", lambda *args: launched.append(1) or launch(*args))
    for op in (dt.sparse_attention_decode, dt.sparse_attention_prefill):
        with pytest.raises(ValueError, match="indices"):
            op(q, kv, slots, 0.2, d_v=DV, config=CFG)
        assert not launched
        op(q, kv, slots, 0.2, d_v=DV, config=CFG, check_values=False)
        assert len(launched) == 1
        launched.clear()


def test_bad_inputs():
    g = torch.Generator().manual_seed(0)
    kv, table = paged_cache(2, 32, 16, g)
    q = torch.randn(2, 3, D, generator=g).half()
    idx = pick(2, 32, 8, [8], g)
    ok = dict(q=q, kv_cache=kv, indices=idx, sm_scale=0.1, d_v=DV, block_table=table)
    cases = [
        ("q", dict(q=q.float())),
        ("q", dict(q=q[0])),
        ("q", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("kv_cache", dict(kv_cache=kv.float())),
        ("kv_cache", dict(kv_cache=kv[..., :64])),
        ("kv_cache", dict(kv_cache=kv[:, :8])),
        ("kv_cache", dict(kv_cache=kv.flatten(0, 1))),  # a block table needs the page size
        ("indices", dict(indices=idx.float())),
        ("indices", dict(indices=idx[:1])),
        ("indices", dict(indices=idx[:, :0])),
        ("indices", dict(indices=idx[None])),
        ("d_v", dict(d_v=D + 1)),
        ("d_v", dict(d_v=0)),
        ("d_v", dict(d_v=float(DV))),  # hashes like DV: must not hit the plan of the valid call below
        ("sm_scale", dict(sm_scale=float("nan"))),
        ("sm_scale", dict(sm_scale=True)),
        ("sm_scale", dict(sm_scale="0.1")),
        ("block_table", dict(block_table=table.float())),
        ("block_table", dict(block_table=table[:1])),
        ("BLOCK_H", dict(config={**CFG, "BLOCK_H": 48})),
    ]
    dt.sparse_attention_decode(**ok)  # valid: its checked plan is cached, and must not serve the calls below
    for name, change in cases:
        args = {**ok, **change}
        with pytest.raises(ValueError, match=name):
            dt.sparse_attention_decode(args.pop("q"), args.pop("kv_cache"), args.pop("indices"), **args)
    with pytest.raises(ValueError, match="indices"):
        dt.sparse_attention_prefill(q, kv, idx[:1], 0.1, d_v=DV, block_table=table[:1])
    with pytest.raises(ValueError, match="block_table"):
        dt.sparse_attention_prefill(q, kv, idx, 0.1, d_v=DV, block_table=table.repeat(2, 1)[:3])
    with pytest.raises(registry.ConfigError):
        dt.sparse_attention_prefill(q, kv, idx, 0.1, d_v=DV, config={**CFG, "BLOCK_K": 16})


@pytest.mark.parametrize("name", ["sparse_attention_decode", "sparse_attention_prefill"])
def test_registry_entries(name):
    spec = registry.get(name)
    phase = spec.phases[0]
    for shape in spec.bench_shapes(phase, False):
        inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 7)
        out, ref = spec.run(inputs, spec.launch_config(phase, shape, "cpu")), spec.reference(inputs)
        assert spec.compare(out, ref) is None
        assert spec.compare((out[0] + 0.01, out[1]), ref) is not None
        assert spec.compare((out[0], out[1] + 1e-3), ref) is not None
    dsa = spec.bench_shapes(phase, True)[0]
    cost = spec.cost(phase, dsa)
    assert cost.flops == 2 * (dsa.get("B") or dsa.get("T")) * dsa["H"] * dsa["k"] * (576 + 512)
    wide = {**spec.default(phase, dsa), "BLOCK_H": 64, "num_warps": 4}  # 256 accumulator registers a thread
    assert spec.constraint(wide, dsa) is not None
    assert spec.constraint({**spec.default(phase, dsa), "BLOCK_N": 128, "num_stages": 2}, dsa) is not None  # smem
    assert all(spec.is_valid(spec.default(phase, s), s) for s in spec.bench_shapes(phase, True))


@pytest.mark.parametrize("B, H, expected", [
    (1, 64, (16, 4, 64)), (2, 64, (16, 4, 32)), (8, 64, (64, 8, 16)),
    (1, 128, (16, 4, 32)), (2, 128, (32, 8, 16)), (8, 128, (64, 8, 8))])
def test_default_decode_programs_fit_one_wave(monkeypatch, B, H, expected):
    """Small batches over the FP8 cache split k until the programs fill one wave of 132 SMs: 256 programs of 16 rows
    at 4 warps (two an SM), 128 at 8 warps (one an SM; B=2 at 128 heads had 32 splits, 256 programs: two waves).
    (BLOCK_H, num_warps, num_splits) each."""
    from dsa_triton.attention import sparse_attention as sa
    monkeypatch.setattr(sa, "_sm_count", lambda: 132)
    config = sa.DECODE.default("decode", {"B": B, "S": 1, "H": H, "D": 576, "Dv": 512, "k": 2048, "fp8": 1})
    assert (config["BLOCK_H"], config["num_warps"], config["num_splits"]) == expected
