"""Paged caches and the append kernel (Triton interpreter on CPU) against the PyTorch reference."""
import pytest
import torch

import dsa_triton  # noqa: F401  (interpreter on CPU)
from dsa_triton import registry
from dsa_triton.attention import cache as cache_module
from dsa_triton.attention.append_tokens import append_tokens
from dsa_triton.attention.cache import PageAllocator, PagedCache
from dsa_triton.attention.formats import dequantize_rows, fp8_quantize_rows
from dsa_triton.attention.append_tokens_reference import append_torch
from dsa_triton.checks import exact_mismatch
from dsa_triton.runtime import default_device

DEVICE = default_device()  # the tests of non-finite and boundary values also run on a GPU, where there is one


def replay_and_check(cache: PagedCache, tokens: dict[int, tuple[list, list]]) -> None:
    """Every written slot matches the reference; every other slot of the cache is still NaN."""
    P = cache.page_size
    written = torch.zeros(cache.kv.shape[:2], dtype=torch.bool)
    for s, (kvs, iks) in tokens.items():
        n = cache.lengths()[s]
        assert int(cache.seq_lens[s]) == n
        if n == 0:
            assert bool((cache.block_table[s] == -1).all())
            continue
        kv, ix = torch.cat(kvs), torch.cat(iks)
        slots = cache.slots(s, torch.arange(n))
        assert torch.equal(cache.kv.view(-1, cache.kv.shape[-1])[slots], kv)
        x8, scale = fp8_quantize_rows(ix)
        assert torch.equal(cache.ik.view(-1, cache.ik.shape[-1])[slots].view(torch.uint8), x8.view(torch.uint8))
        assert torch.equal(cache.ik_scale.view(-1)[slots], scale)
        keys = dequantize_rows(x8, scale)
        for j in range(-(-n // P)):
            page = int(cache.block_table[s, j])
            assert torch.equal(cache.pmax[page].float(), keys[j * P:(j + 1) * P].amax(0))  # exact in bf16 too
            assert torch.equal(cache.pmin[page].float(), keys[j * P:(j + 1) * P].amin(0))
            written[page, : min(P, n - j * P)] = True
    assert bool(cache.kv[~written].isnan().all())
    assert bool(cache.ik[~written].float().isnan().all())
    assert bool(cache.ik_scale[~written].isnan().all())


@pytest.mark.parametrize("P, summary_dtype", [(16, torch.bfloat16), (64, torch.float32)])
def test_prefill_chunks_then_decode(P, summary_dtype):
    g = torch.Generator().manual_seed(P)
    cache = PagedCache(num_pages=24, page_size=P, max_seqs=4, max_pages_per_seq=6, kv_dim=40, index_dim=32,
                       dtype=torch.float16, device="cpu", poison=True, summary_dtype=summary_dtype)
    assert cache.summaries.dtype == summary_dtype
    tokens = {s: ([], []) for s in range(4)}

    def add(seq_ids, lens):
        n = sum(lens)
        kv = torch.randn(n, 40, generator=g).half()
        ix = torch.randn(n, 32, generator=g) * torch.rand(n, 1, generator=g) * 10
        cache.append(seq_ids, lens, kv, ix)
        row = 0
        for s, k in zip(seq_ids, lens):
            tokens[s][0].append(kv[row:row + k])
            tokens[s][1].append(ix[row:row + k])
            row += k

    add([0, 1, 3], [P + 3, 0, 5])          # mixed lengths, one zero-length, sequence 2 untouched
    add([1, 0], [2 * P - 1, P - 2])        # second chunk ends exactly on a page boundary for seq 0
    for _ in range(3):
        add([0, 1, 3], [1, 1, 1])          # decode steps: seq 0 opens a fresh page
    replay_and_check(cache, tokens)


def test_release_reuses_pages():
    cache = PagedCache(4, 16, 2, 4, kv_dim=8, index_dim=16, dtype=torch.float16, device="cpu")
    cache.append([0], [40], torch.randn(40, 8).half(), torch.randn(40, 16))
    assert cache.allocator.num_free == 1
    cache.release(0)
    assert cache.allocator.num_free == 4 and cache.lengths() == [0, 0]
    cache.append([1], [64], torch.randn(64, 8).half(), torch.randn(64, 16))
    assert cache.allocator.num_free == 0


def test_index_only_cache():
    cache = PagedCache(3, 16, 1, kv_dim=0, index_dim=16, device="cpu", poison=True)
    ix = torch.randn(20, 16)
    cache.append([0], [20], None, ix)
    x8, scale = fp8_quantize_rows(ix)
    assert torch.equal(cache.ik_scale.view(-1)[cache.slots(0, torch.arange(20))], scale)
    assert cache.kv is None


def test_latent_only_cache():
    cache = PagedCache(3, 16, 2, kv_dim=24, index_dim=0, dtype=torch.float16, device="cpu", poison=True)
    kv = torch.randn(21, 24).half()
    cache.append([1, 0], [17, 4], kv, None)
    assert torch.equal(cache.kv.view(-1, 24)[cache.slots(1, torch.arange(17))], kv[:17])
    assert torch.equal(cache.kv.view(-1, 24)[cache.slots(0, torch.arange(4))], kv[17:])
    assert int(cache.kv.isnan().any(-1).sum()) == 3 * 16 - 21 and cache.ik is None


def test_quantization_scales_are_minimal_powers_of_two():
    x = torch.randn(64, 128) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    x8, scale = fp8_quantize_rows(x)
    mant, _ = torch.frexp(scale)
    assert bool((mant == 0.5).all())  # powers of two
    amax = x.abs().amax(1).clamp_min(1e-4)
    assert bool((amax / scale <= 448).all() and (amax / (scale / 2) > 448).all())
    assert bool((dequantize_rows(x8, scale) - x).abs().le(amax[:, None] / 8).all())


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_registry_entry_matches_reference(phase):
    spec = registry.get("append_tokens")
    for shape in [s for s in spec.bench_shapes(phase, False) if not s["fp8"]]:
        inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 3)
        ref = spec.reference(inputs)
        assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is None
        scales = ref[2].view(-1)
        scales[scales.isfinite().nonzero()[0]] *= 2  # a changed cache must be caught
        assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is not None


def test_bad_inputs():
    cache = PagedCache(4, 16, 2, 3, kv_dim=8, index_dim=16, dtype=torch.float16, device="cpu")
    kv, ix = torch.randn(5, 8).half(), torch.randn(5, 16)
    with pytest.raises(ValueError, match="page_size"):
        PagedCache(4, 24, device="cpu")
    with pytest.raises(ValueError, match="seq_ids"):
        cache.append([2], [5], kv, ix)
    with pytest.raises(ValueError, match="lens"):
        cache.append([0], [4], kv, ix)
    with pytest.raises(ValueError, match="lens"):
        cache.append([0], [49], torch.randn(49, 8).half(), torch.randn(49, 16))  # beyond max_pages_per_seq
    with pytest.raises(ValueError, match="lens"):
        cache.append([0, 1], [48, 17], torch.randn(65, 8).half(), torch.randn(65, 16))  # out of pages
    with pytest.raises(ValueError, match="^kv: dtype"):
        cache.append([0], [5], kv.float(), ix)
    with pytest.raises(ValueError, match="index_k: dimension 1"):
        cache.append([0], [5], kv, ix[:, :8])
    with pytest.raises(ValueError, match="index_k"):
        cache.append([0], [5], kv, None)
    assert cache.lengths() == [0, 0] and cache.allocator.num_free == 4  # nothing changed
    items = torch.tensor([[0, 5, 4, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="items: pages"):
        append_tokens(cache.kv, cache.ik, cache.ik_scale, cache.summaries, kv, ix, items)
    with pytest.raises(ValueError, match="items: slots"):
        append_tokens(cache.kv, cache.ik, cache.ik_scale, cache.summaries, kv, ix,
                      torch.tensor([[0, 5, 1, 12]], dtype=torch.int32))
    with pytest.raises(ValueError, match="n:"):
        PageAllocator(2).allocate(3)
    with pytest.raises(ValueError, match="n: must be an integer >= 0"):
        PageAllocator(2).allocate(-1)  # was: silently handed out pages
    with pytest.raises(ValueError, match="seq_id"):
        cache.slots(2, torch.tensor([0]))  # was: an IndexError from the host bookkeeping


def test_append_tokens_value_checks_with_a_cached_plan():
    """Items are range-checked on every call (one transfer), also once the tensors' metadata has a cached plan;
    ``check_values=False`` skips only those checks: valid items write the same bytes as the checked call."""
    cache = PagedCache(4, 16, 2, 3, kv_dim=8, index_dim=16, dtype=torch.float16, device="cpu")
    kv, ix = torch.randn(5, 8).half(), torch.randn(5, 16)
    ok = torch.tensor([[0, 3, 2, 0], [3, 2, 1, 4]], dtype=torch.int32)
    append_tokens(cache.kv, cache.ik, cache.ik_scale, cache.summaries, kv, ix, ok)
    for name, bad in (("items: token ranges", [[0, 3, 2, 0], [3, 3, 1, 4]]),
                      ("items: pages", [[0, 3, 2, 0], [3, 2, 4, 4]]),
                      ("items: slots", [[0, 3, 2, 14], [3, 2, 1, 4]]),
                      ("items: each page", [[0, 3, 2, 0], [3, 2, 2, 4]])):
        with pytest.raises(ValueError, match=name):
            append_tokens(cache.kv, cache.ik, cache.ik_scale, cache.summaries, kv, ix,
                          torch.tensor(bad, dtype=torch.int32))
    fast = PagedCache(4, 16, 2, 3, kv_dim=8, index_dim=16, dtype=torch.float16, device="cpu")
    append_tokens(fast.kv, fast.ik, fast.ik_scale, fast.summaries, kv, ix, ok, check_values=False)
    for name in ("kv", "ik", "ik_scale", "summaries"):
        assert torch.equal(getattr(fast, name).view(torch.uint8), getattr(cache, name).view(torch.uint8))


def cache_state(cache: PagedCache) -> list:
    """Everything a call may change: lengths, pages per sequence, the free list (in order), the block table,
    seq_lens and the bytes of every cache tensor."""
    tensors = (cache.block_table, cache.seq_lens, cache.kv, cache.ik, cache.ik_scale, cache.summaries)
    return [cache.lengths(), [list(p) for p in cache._pages], list(cache.allocator._free)] + [
        t.clone().view(torch.uint8) for t in tensors if t is not None]


def assert_same_state(got: list, expected: list) -> None:
    assert got[:3] == expected[:3]
    assert all(torch.equal(a, b) for a, b in zip(got[3:], expected[3:]))


def test_a_raising_append_changes_nothing(monkeypatch):
    """Every append that raises leaves lengths, block table, allocator and caches as they were: a bad config
    (wrong type or breaking the constraint), bad ids or lengths, tensors, too few pages, non-finite keys, and a
    launch that fails."""
    cache = PagedCache(4, 16, 2, 3, kv_dim=8, index_dim=16, dtype=torch.float16, device="cpu")
    cache.append([0], [20], torch.randn(20, 8).half(), torch.randn(20, 16))
    kv, ix = torch.randn(5, 8).half(), torch.randn(5, 16)
    inf_ix, nan_kv = ix.clone(), kv.clone()
    inf_ix[2, 7], nan_kv[4, 0] = float("inf"), float("nan")
    before = cache_state(cache)
    config = {"BLOCK_T": 16, "BLOCK_D": 64, "num_warps": 2}
    bad = [("BLOCK_T", dict(config={**config, "BLOCK_T": 16.0})),
           ("BLOCK_T", dict(config={**config, "BLOCK_T": 32})),  # longer than the page
           ("num_warps", dict(config={**config, "num_warps": 3})),
           ("seq_ids", dict(seq_ids=[2])), ("seq_ids", dict(seq_ids=[1.0])), ("seq_ids", dict(seq_ids=[True])),
           ("seq_ids", dict(seq_ids=["1"])), ("lens", dict(lens=[5.0])), ("lens", dict(lens=[4])),
           ("lens", dict(lens=[-1])), ("^kv: dtype", dict(kv=kv.float())),
           ("index_k: dimension 1", dict(index_k=ix[:, :8])),
           ("index_k", dict(index_k=None)), ("^index_k: .*finite", dict(index_k=inf_ix)),
           ("^kv: .*finite", dict(kv=nan_kv))]
    for match, change in bad:
        args = {"seq_ids": [1], "lens": [5], "kv": kv, "index_k": ix, **change}
        with pytest.raises(ValueError, match=match):
            cache.append(args.pop("seq_ids"), args.pop("lens"), **args)
        assert_same_state(cache_state(cache), before)
    with pytest.raises(ValueError, match="lens"):  # needs 3 pages for sequence 1, 2 are free
        cache.append([1], [40], torch.randn(40, 8).half(), torch.randn(40, 16))
    assert_same_state(cache_state(cache), before)

    def failing_launch(*args):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(cache_module, "launch_append", failing_launch)
    with pytest.raises(RuntimeError, match="launch failed"):
        cache.append([1, 0], [5, 13], torch.randn(18, 8).half(), torch.randn(18, 16))  # a new page for each
    assert_same_state(cache_state(cache), before)


def test_a_raising_allocate_or_free_changes_nothing():
    allocator = PageAllocator(4)
    taken = allocator.allocate(2)
    free = list(allocator._free)
    for match, call in (("n:", lambda: allocator.allocate(3)), ("n:", lambda: allocator.allocate(-1)),
                        ("n:", lambda: allocator.allocate(1.0)), ("n:", lambda: allocator.allocate(True)),
                        ("pages", lambda: allocator.free([taken[0], free[0]])),  # one of them is free
                        ("pages", lambda: allocator.free([taken[0], taken[0]])),
                        ("pages", lambda: allocator.free([4])), ("pages", lambda: allocator.free([-1])),
                        ("pages", lambda: allocator.free([float(taken[0])]))):
        with pytest.raises(ValueError, match=match):
            call()
        assert allocator._free == free
    allocator.free(taken)
    assert allocator.num_free == 4 and sorted(allocator.allocate(4)) == [0, 1, 2, 3]


def test_sizes_and_ids_must_be_integers():
    for match, kw in (("max_pages_per_seq", dict(max_pages_per_seq=0)),
                      ("max_pages_per_seq", dict(max_pages_per_seq=-2)),
                      ("max_pages_per_seq", dict(max_pages_per_seq=2.0)), ("page_size", dict(page_size=16.0)),
                      ("kv_dim", dict(kv_dim=8.0)), ("index_dim", dict(index_dim=True))):
        with pytest.raises(ValueError, match=f"^{match}"):
            PagedCache(4, **{"page_size": 16, **kw}, device="cpu")
    cache = PagedCache(4, 16, 2, kv_dim=8, index_dim=16, dtype=torch.float16, device="cpu")
    cache.append([1], [3], torch.randn(3, 8).half(), torch.randn(3, 16))
    for bad in (1.0, 1.7, True, "1", -1, 2):
        with pytest.raises(ValueError, match="^seq_id"):
            cache.release(bad)
        with pytest.raises(ValueError, match="^seq_id"):
            cache.slots(bad, torch.tensor([0]))
    assert cache.lengths() == [0, 3]


def test_sizes_past_int32_raise_before_any_allocation():
    """Slots (page * P + offset), positions and page ids are int32: a cache too large for them raises a ValueError
    naming the size before anything is allocated (it was an allocation RuntimeError or MemoryError)."""
    for match, kw in (("num_pages", dict(num_pages=2**31)), ("num_pages", dict(num_pages=2**25, page_size=64)),
                      ("max_seqs", dict(max_seqs=2**31)), ("max_pages_per_seq", dict(max_pages_per_seq=2**40)),
                      ("max_pages_per_seq", dict(max_pages_per_seq=2**27)), ("kv_dim", dict(kv_dim=2**40)),
                      ("index_dim", dict(index_dim=2**40))):
        with pytest.raises(ValueError, match=f"^{match}: must be"):
            PagedCache(**{"num_pages": 4, "page_size": 16, **kw}, device="cpu")
    with pytest.raises(ValueError, match="^num_pages: must be"):
        PageAllocator(2**40)


def test_non_finite_keys():
    """Value checks on: non-finite new keys raise. Off: a row with NaN or inf gets a NaN scale and NaN key bytes,
    its page a NaN summary (kept by later appends), as the reference computes it; other rows are unchanged."""
    P, DK = 16, 32
    cache = PagedCache(6, P, 2, kv_dim=8, index_dim=DK, dtype=torch.float16, device=DEVICE, poison=True)
    kv, ix = torch.randn(40, 8).half().to(DEVICE), torch.randn(40, DK).to(DEVICE)
    ix[20, 3], ix[35, 0], ix[36] = float("inf"), float("nan"), float("-inf")
    items = torch.tensor([[0, 16, 0, 0], [16, 16, 1, 0], [32, 8, 2, 0]], dtype=torch.int32, device=DEVICE)
    tensors = (cache.kv, cache.ik, cache.ik_scale, cache.summaries)
    nan_kv = kv.masked_fill(ix[:, :8].isnan(), float("nan"))
    for name, bad in (("index_k", (kv, ix)), ("kv", (nan_kv, ix.nan_to_num()))):
        with pytest.raises(ValueError, match=f"^{name}: .*finite"):
            append_tokens(*tensors, *bad, items)
    expected = [t.clone() for t in tensors]
    arange = lambda *a: torch.arange(*a, device=DEVICE)  # noqa: E731  (row i goes to slot i)
    append_torch(*expected, kv, ix, arange(40), arange(3), torch.tensor([16, 16, 8], device=DEVICE))
    append_tokens(*tensors, kv, ix, items, check_values=False)
    assert exact_mismatch(zip(("kv", "ik", "ik_scale", "summaries"), tensors, expected)) is None
    assert cache.ik_scale.view(-1)[:40].isnan().nonzero().flatten().tolist() == [20, 35, 36]
    assert bool((cache.ik.view(-1, DK)[[20, 35, 36]].view(torch.uint8) == 0x7F).all())
    assert cache.summaries.float().isnan().all(2).all(1).tolist()[:3] == [False, True, True]
    assert bool(cache.summaries[:3].float().isnan().any(2).eq(cache.summaries[:3].float().isnan().all(2)).all())
    append_tokens(*tensors, kv[:2], torch.randn(2, DK, device=DEVICE), torch.tensor([[0, 2, 2, 8]], dtype=torch.int32,
                                                                                     device=DEVICE))
    assert bool(cache.summaries[2].float().isnan().all())  # finite keys do not clear the NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_at_the_fp8_boundary(dtype):
    """Rows whose amax is exactly 448 * 2^e take scale 2^e (the kernel compares the mantissa with ``>``, not
    ``>=``); one ulp above takes 2^(e + 1), one ulp below 2^e; the kernel agrees with the reference bit for bit."""
    exps = torch.tensor([-12, -3, 0, 1, 7, 20])
    edge = (448.0 * torch.exp2(exps.float())).to(dtype)
    ulp = lambda x, d: torch.nextafter(x.float(), torch.full_like(x.float(), d)).to(dtype)  # noqa: E731
    if dtype == torch.bfloat16:  # one bf16 ulp: the next representable bf16 value
        ulp = lambda x, d: (x.float() * (1 + (2.0 ** -7 if d > 0 else -2.0 ** -8))).to(dtype)  # noqa: E731
    amax = torch.cat([edge, ulp(edge, float("inf")), ulp(edge, 0.0)])
    n = amax.numel()
    rows = torch.randn(n, 32).to(dtype) * (amax[:, None].float() / 8).to(dtype)
    rows = rows.clamp(-amax[:, None].float() / 2, amax[:, None].float() / 2).to(dtype)
    rows[torch.arange(n), torch.arange(n) % 32] = amax * torch.where(torch.arange(n) % 2 == 0, 1, -1).to(dtype)
    assert torch.equal(rows.float().abs().amax(1), amax.float())
    cache = PagedCache(3, 16, 1, kv_dim=0, index_dim=32, device=DEVICE, poison=True)
    cache.append([0], [n], None, rows.to(DEVICE))
    x8, scale = fp8_quantize_rows(rows)
    got = cache.ik_scale.view(-1)[:n].cpu()
    assert torch.equal(got, scale)
    assert torch.equal(cache.ik.view(-1, 32)[:n].view(torch.uint8).cpu(), x8.view(torch.uint8))
    e = exps.float()
    assert torch.equal(got, torch.exp2(torch.cat([e, e + 1, e])))
