"""The FP8 latent cache (DeepSeek's 656-byte layout): its reference, the append kernel into it (bit for bit against the
reference), and sparse attention over it (Triton interpreter, fp16 queries, and bf16 in one test) against the fp32
reference, which dequantizes the gathered rows.

Unused cache slots hold NaN-equivalent bytes (NaN scales and rope values; 0xFF in a poisoned ``PagedCache``), and
every buffer the ops allocate starts as NaN: a stray read or an unwritten element shows up in the result.
"""
import pytest
import torch

import dsa_triton as dt
from dsa_triton import registry
from dsa_triton.attention.append_tokens import append_tokens
from dsa_triton.attention.cache import PagedCache
from dsa_triton.attention.formats import fp8_latent_bytes, fp8_latent_dequantize, fp8_latent_quantize, fp8_quantize_rows
from dsa_triton.attention.append_tokens_reference import append_torch
from dsa_triton.attention.sparse_attention_reference import (slots_from_indices, sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)
from dsa_triton.attention.sparse_attention_spec import random_paged_cache
from dsa_triton.checks import exact_mismatch

from .poison import poisoned_allocations
from .test_sparse_attention import CFG, check, pick, prefill_and_check

D, DV = 80, 64  # 64 latent values (one partial 128-group) + 16 rope values: 100 bytes a row


@pytest.fixture(autouse=True)
def poisoned_buffers():
    with poisoned_allocations():
        yield


def group_scaled(x: torch.Tensor, d_latent: int, g: torch.Generator) -> torch.Tensor:
    """``x`` with each 128-value latent group of each row scaled by its own 2^-3 .. 1 (so neighbouring groups take
    different scales and a scale read for the wrong group shows; no larger, so that the probabilities' rounding
    to q's dtype stays inside the bf16 tests' tolerance)."""
    groups = -(-d_latent // 128)
    factors = torch.exp2(torch.randint(-3, 1, (*x.shape[:-1], groups), generator=g).float())
    x = x.float().clone()
    x[..., :d_latent] *= factors.repeat_interleave(128, dim=-1)[..., :d_latent]
    return x


def fp8_cache(seqs: int, L: int, P: int, d: int, d_v: int, g: torch.Generator):
    """uint8 FP8 rows ``kv[pages, P, bytes]`` of ``seqs`` sequences of ``L`` random tokens (latent groups scaled
    apart), NaN-equivalent bytes elsewhere, and the block table."""
    kv, table = random_paged_cache(seqs, L, P, d, torch.float32, g)
    return fp8_latent_quantize(group_scaled(kv, d_v, g), d_v), table


# -- the layout and its reference ---------------------------------------------------------------------------------

def test_layout_bytes_and_round_trip():
    """656 bytes for 512 + 64; each latent group is quantized with its own power-of-two scale (the indexer keys'
    rule), rope values are bf16; the dequantized rows are within half an e4m3 step of the input."""
    assert fp8_latent_bytes(512, 64) == 656 and fp8_latent_bytes(200, 24) == 200 + 8 + 48
    g = torch.Generator().manual_seed(1)
    x = group_scaled(torch.randn(6, 5, 224, generator=g) * 8, 200, g)
    rows = fp8_latent_quantize(x, 200)
    assert rows.dtype == torch.uint8 and rows.shape == (6, 5, 256)
    x8, scale = fp8_quantize_rows(torch.nn.functional.pad(x[..., :200], (0, 56)).unflatten(-1, (2, 128)))
    assert torch.equal(rows[..., :200], x8.view(torch.uint8).flatten(-2)[..., :200])
    assert torch.equal(rows[..., 200:208].contiguous().view(torch.float32), scale)
    assert torch.equal(rows[..., 208:].contiguous().view(torch.bfloat16), x[..., 200:].bfloat16())
    assert bool((torch.frexp(scale)[0] == 0.5).all())  # powers of two
    assert not torch.equal(scale[..., 0], scale[..., 1])
    back = fp8_latent_dequantize(rows, 200)
    err = (back[..., :200] - x[..., :200]).abs()
    assert bool((err <= scale.repeat_interleave(128, -1)[..., :200] * 16).all())  # half a step of 32 at the top
    assert torch.equal(back[..., 200:], x[..., 200:].bfloat16().float())
    bad = x.clone()
    bad[0, 0, 150], bad[0, 1, 3] = float("inf"), float("nan")
    back = fp8_latent_dequantize(fp8_latent_quantize(bad, 200), 200)
    assert bool(back[0, 0, 128:200].isnan().all()) and not back[0, 0, :128].isnan().any()  # only its group
    assert bool(back[0, 1, :128].isnan().all()) and not back[0, 1, 128:].isnan().any()


# -- append ---------------------------------------------------------------------------------------------------------

def replay_fp8(cache: PagedCache, rows: dict[int, list[torch.Tensor]]) -> None:
    """Every written slot holds its row's FP8 bytes (the reference's); every other byte is still 0xFF."""
    written = torch.zeros(cache.kv.shape[:2], dtype=torch.bool)
    for s, chunks in rows.items():
        n = cache.lengths()[s]
        if n == 0:
            continue
        slots = cache.slots(s, torch.arange(n))
        want = fp8_latent_quantize(torch.cat(chunks), cache.kv_dim - cache.rope_dim)
        assert torch.equal(cache.kv.view(-1, cache.kv.shape[-1])[slots], want)
        written.view(-1)[slots] = True
    assert bool((cache.kv[~written] == 0xFF).all())


@pytest.mark.parametrize("kv_dim, rope_dim, dtype", [(224, 24, torch.float16), (48, 8, torch.float32)])
def test_append_prefill_chunks_then_decode(kv_dim, rope_dim, dtype):
    """Chunks that cross pages, a zero-length one, decode steps opening a fresh page: the FP8 rows equal the
    reference's bit for bit (scales, e4m3 bytes and bf16 rope values), the indexer cache as before, and no
    unwritten byte changes."""
    g = torch.Generator().manual_seed(kv_dim)
    P, DK = 16, 32
    cache = PagedCache(num_pages=12, page_size=P, max_seqs=3, max_pages_per_seq=4, kv_dim=kv_dim, index_dim=DK,
                       dtype=torch.float16, device="cpu", poison=True, kv_dtype="fp8", rope_dim=rope_dim)
    assert cache.kv.dtype == torch.uint8 and cache.kv.shape[-1] == fp8_latent_bytes(kv_dim - rope_dim, rope_dim)
    rows = {s: [] for s in range(3)}
    keys = {s: [] for s in range(3)}

    def add(seq_ids, lens):
        n = sum(lens)
        kv = group_scaled(torch.randn(n, kv_dim, generator=g), kv_dim - rope_dim, g).to(dtype)
        ix = torch.randn(n, DK, generator=g)
        cache.append(seq_ids, lens, kv, ix)
        at = 0
        for s, k in zip(seq_ids, lens):
            rows[s].append(kv[at:at + k])
            keys[s].append(ix[at:at + k])
            at += k

    add([0, 1, 2], [P + 3, 0, 5])
    add([1, 0], [2 * P - 1, P - 2])  # sequence 0 ends on a page boundary
    for _ in range(2):
        add([0, 1, 2], [1, 1, 1])  # sequence 0 opens a fresh page
    replay_fp8(cache, rows)
    for s in range(3):  # the indexer cache is the bf16 cache's
        slots = cache.slots(s, torch.arange(cache.lengths()[s]))
        assert torch.equal(cache.ik_scale.view(-1)[slots], fp8_quantize_rows(torch.cat(keys[s]))[1])


def test_append_tokens_non_finite_rows():
    """Value checks on: a non-finite row raises naming ``kv``. Off: the group holding it gets a NaN scale and NaN
    bytes, the other groups and the rope values are written as the reference writes them (bit for bit; a NaN rope
    value is NaN in both, its bits are the converter's)."""
    P, kv_dim, rope_dim = 16, 160, 16
    cache = PagedCache(4, P, 1, kv_dim=kv_dim, index_dim=0, device="cpu", poison=True, kv_dtype="fp8",
                       rope_dim=rope_dim)
    kv = torch.randn(20, kv_dim, generator=torch.Generator().manual_seed(3))
    kv[2, 130], kv[7, 5], kv[9, 150] = float("nan"), float("inf"), float("nan")  # group 1, group 0, a rope value
    items = torch.tensor([[0, 16, 1, 0], [16, 4, 3, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="^kv: .*finite"):
        append_tokens(cache.kv, None, None, None, kv, None, items, rope_dim=rope_dim)
    expected = cache.kv.clone()
    slots = torch.cat([torch.arange(16, 32), torch.arange(48, 52)])
    append_torch(expected, None, None, None, kv, None, slots, None, None, rope_dim=rope_dim)
    append_tokens(cache.kv, None, None, None, kv, None, items, rope_dim=rope_dim, check_values=False)
    rope_nan = fp8_latent_bytes(kv_dim - rope_dim, 0) + 2 * (150 - (kv_dim - rope_dim))  # kv[9, 150]'s bytes
    for t in (cache.kv, expected):
        t.view(-1, t.shape[-1])[slots[9], rope_nan:rope_nan + 2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)
    assert exact_mismatch([("kv", cache.kv, expected)]) is None
    back = fp8_latent_dequantize(cache.kv.view(-1, cache.kv.shape[-1])[slots], kv_dim - rope_dim)
    assert back[2].isnan().nonzero().flatten().tolist() == list(range(128, 144))
    assert back[7].isnan().nonzero().flatten().tolist() == list(range(128))
    assert back[9].isnan().nonzero().flatten().tolist() == [150]
    assert not back[[0, 1, 3, 19]].isnan().any()


def test_bytes_per_token():
    """656 + 132 bytes a DeepSeek-V3.2 token in FP8, 1152 + 132 in bf16; what the tensors hold agrees."""
    for kv_dtype, kv_bytes in ((None, 1152), ("fp8", 656)):
        cache = PagedCache(2, 64, kv_dim=576, index_dim=128, device="cpu", kv_dtype=kv_dtype)
        assert cache.bytes_per_token == kv_bytes + 132
        held = sum(t.numel() * t.element_size() for t in (cache.kv, cache.ik, cache.ik_scale))
        assert held == 2 * 64 * cache.bytes_per_token
    assert PagedCache(2, 16, kv_dim=0, index_dim=32, device="cpu", kv_dtype="fp8").bytes_per_token == 36


def test_bad_inputs_append():
    for match, kwargs in (("kv_dtype", dict(kv_dtype="fp16")), ("kv_dtype", dict(kv_dtype=torch.float8_e4m3fn)),
                          ("rope_dim", dict(kv_dtype="fp8", rope_dim=7)),
                          ("rope_dim", dict(kv_dtype="fp8", rope_dim=48)),  # not below kv_dim
                          ("rope_dim", dict(kv_dtype="fp8", rope_dim=6))):  # latent 42: not a multiple of 4
        with pytest.raises(ValueError, match=match):
            PagedCache(4, 16, kv_dim=48, index_dim=16, device="cpu", **kwargs)
    cache = PagedCache(4, 16, 2, kv_dim=48, index_dim=16, device="cpu", kv_dtype="fp8", rope_dim=8)
    ix = torch.randn(5, 16)
    with pytest.raises(ValueError, match="^kv: dtype"):
        cache.append([0], [5], torch.randint(0, 9, (5, 48)), ix)
    with pytest.raises(ValueError, match="^kv: expected 2"):
        cache.append([0], [5], torch.randn(5, 1, 48), ix)
    items = torch.tensor([[0, 5, 0, 0]], dtype=torch.int32)
    args = (cache.kv, cache.ik, cache.ik_scale, cache.summaries)
    with pytest.raises(ValueError, match="^kv_cache: FP8 rows"):
        append_tokens(*args, torch.randn(5, 48), ix, items, rope_dim=16)  # 32 + 16: another width in bytes
    with pytest.raises(ValueError, match="^rope_dim"):
        append_tokens(*args, torch.randn(5, 48), ix, items, rope_dim=8.0)
    assert cache.lengths() == [0, 0] and bool((cache.kv == 0).all())


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_append_registry_entry(phase):
    spec = registry.get("append_tokens")
    for shape in [s for s in spec.bench_shapes(phase, False) if s["fp8"]]:
        inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 5)
        ref = spec.reference(inputs)
        assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is None
        ref[0].view(-1)[(ref[0].view(-1) != 0xFF).nonzero()[0]] ^= 1  # a changed byte must be caught
        assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is not None
    dsa = [s for s in spec.bench_shapes(phase, True) if s["fp8"]][0]
    bf16 = spec.cost(phase, {**dsa, "Dr": 0, "fp8": 0})
    assert bf16.bytes - spec.cost(phase, dsa).bytes == dsa["N"] * (1152 - 656)


# -- attention ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H, S, per_token, P, logical, config", [
    (1, None, False, 16, False, {}),                    # q [B, Hq, D], physical slots
    (3, 2, False, 16, True, {"num_splits": 2}),         # two tokens share an index set; block table; splits
    (5, 3, True, 64, True, {"BLOCK_N": 32}),            # per-token index sets; block table, page 64
    (24, 1, False, 16, False, {"BLOCK_H": 32, "num_splits": 2, "num_warps": 8}),  # 24 heads in a 32-row tile
])
def test_decode(H, S, per_token, P, logical, config):
    """Full rows, -1 padded rows, rows without a valid index (out 0, lse -inf) and rows with one."""
    g = torch.Generator().manual_seed(H * 10 + P)
    B, L, k = 4, 70, 40
    kv, table = fp8_cache(B, L, P, D, DV, g)
    q = torch.randn((B, H, D) if S is None else (B, S, H, D), generator=g).half()
    rows = B * (S or 1) if per_token else B
    idx = pick(rows, L, k, [k, 9, 0, 1], g)
    bt = table.repeat_interleave(S or 1, dim=0) if per_token else table
    slots = slots_from_indices(idx, bt, P).to(torch.int32)
    shape = (B, S) if per_token else (B,)
    indices, table_arg = (idx, table) if logical else (slots, None)
    indices = indices.view(*shape, k)
    out, lse = dt.sparse_attention_decode(q, kv, indices, 0.2, d_v=DV, block_table=table_arg,
                                          config={**CFG, **config})
    check(out, lse, *sparse_attention_decode_torch(q, kv, indices, 0.2, DV, table_arg))
    flat = dt.sparse_attention_decode(q, kv.flatten(0, 1), slots.view(*shape, k), 0.2, d_v=DV, config={**CFG, **config})
    assert torch.equal(flat[0], out) and torch.equal(flat[1], lse)  # the same rows through the flat cache
    # the dequantized rows are exact in fp16: the bf16-layout kernel over them gives the same bits
    plain = fp8_latent_dequantize(kv, DV).half()
    same = dt.sparse_attention_decode(q, plain, indices, 0.2, d_v=DV, block_table=table_arg, config={**CFG, **config})
    assert torch.equal(same[0], out) and torch.equal(same[1], lse)


@pytest.mark.parametrize("d, d_v, table_rows", [(80, 64, 1), (224, 200, 2), (72, 40, 0), (100, 64, 1)])
def test_prefill(d, d_v, table_rows):
    """Head dims that are no power of two, a latent of two groups (the second partial); a shared, per-token or no
    block table."""
    g = torch.Generator().manual_seed(d + d_v)
    L = 50
    kv, table = fp8_cache(max(table_rows, 1), L, 16, d, d_v, g)
    prefill_and_check(torch.randn(6, 3, d, generator=g).half(), kv, table, L, table_rows, 0.05, d_v, g)


@pytest.mark.parametrize("decode", [True, False])
def test_bf16_queries(decode):
    """bf16 queries (the GPU's dtype): the rows are dequantized into bf16 (exact), the interpreter upcasts the dot
    operands to fp32."""
    g = torch.Generator().manual_seed(31)
    B, H, L, k, P = 3, 4, 48, 24, 16
    kv, table = fp8_cache(B if decode else 1, L, P, D, DV, g)
    q = torch.randn(B, H, D, generator=g).bfloat16()
    idx = pick(B, L, k, [k, 7, 0], g)
    bt = table if decode else table.expand(B, -1)
    op, oracle = ((dt.sparse_attention_decode, sparse_attention_decode_torch) if decode else
                  (dt.sparse_attention_prefill, sparse_attention_prefill_torch))
    out, lse = op(q, kv, idx, 0.2, d_v=DV, block_table=bt, config=CFG)
    check(out, lse, *oracle(q, kv, idx, 0.2, DV, bt), dtype=torch.bfloat16)


def test_decode_from_a_paged_fp8_cache():
    """Rows appended by the kernel into a poisoned (0xFF) cache, read back through its block table."""
    g = torch.Generator().manual_seed(3)
    cache = PagedCache(num_pages=12, page_size=16, max_seqs=3, max_pages_per_seq=4, kv_dim=D, index_dim=32,
                       device="cpu", poison=True, kv_dtype="fp8", rope_dim=D - DV)
    lens = [33, 5, 60]
    kv = torch.randn(sum(lens), D, generator=g).half()
    cache.append([0, 1, 2], lens, kv, torch.randn(sum(lens), 32, generator=g))
    idx = torch.stack([pick(1, n, 20, [min(n, 20)], g)[0] for n in lens])
    q = torch.randn(3, 4, D, generator=g).half()
    table = cache.block_table[:3]
    out, lse = dt.sparse_attention_decode(q, cache.kv, idx, 0.1, d_v=DV, block_table=table, config=CFG)
    check(out, lse, *sparse_attention_decode_torch(q, cache.kv, idx, 0.1, DV, table))
    # against the unquantized rows: within the FP8 rounding (latent values to 3 mantissa bits)
    rows = torch.zeros(cache.kv.shape[0] * 16, D).half()
    for s, n in enumerate(lens):
        rows[cache.slots(s, torch.arange(n))] = kv[sum(lens[:s]):sum(lens[:s]) + n]
    ref_out, _ = sparse_attention_decode_torch(q, rows.view(-1, 16, D), idx, 0.1, DV, table)
    assert (out.float() - ref_out).abs().max() < 0.1


def test_nan_in_a_read_row_gives_nan():
    """A NaN in a latent group of a cache row (its scale NaN) or in its rope values makes NaN every query row that
    reads it; other rows are unchanged."""
    g = torch.Generator().manual_seed(8)
    B, H, L, k, P = 3, 4, 48, 32, 16
    kv, table = fp8_cache(1, L, P, D, DV, g)
    q = torch.randn(B, H, D, generator=g).half()
    slots = slots_from_indices(pick(B, L, k, [k, 5, 0], g), table.expand(B, -1), P).to(torch.int32)
    only_1 = [s for s in slots[1].tolist() if s >= 0 and s not in slots[0].tolist()]
    rows = kv.view(-1, kv.shape[-1])
    rows[only_1[0], DV:DV + 4] = 0xFF  # the scale of group 0: NaN
    for op, oracle in ((dt.sparse_attention_decode, sparse_attention_decode_torch),
                       (dt.sparse_attention_prefill, sparse_attention_prefill_torch)):
        out, lse = op(q, kv, slots, 0.2, d_v=DV, config={**CFG, "num_splits": 2}, check_values=False)
        ref_out, ref_lse = oracle(q, kv, slots, 0.2, DV)
        nan_rows = torch.zeros(B, H, dtype=torch.bool)
        nan_rows[1] = True
        assert torch.equal(ref_lse.isnan(), nan_rows) and torch.equal(lse.isnan(), nan_rows)
        assert bool(out[nan_rows].isnan().all())
        check(out[~nan_rows], lse[~nan_rows], ref_out[~nan_rows], ref_lse[~nan_rows])


def test_bad_inputs_attention():
    g = torch.Generator().manual_seed(0)
    kv, table = fp8_cache(2, 32, 16, D, DV, g)
    q = torch.randn(2, 3, D, generator=g).half()
    idx = pick(2, 32, 8, [8], g)
    ok = dict(q=q, kv_cache=kv, indices=idx, sm_scale=0.1, d_v=DV, block_table=table)
    odd_rope, _ = fp8_cache(1, 16, 16, 81, DV, g)
    cases = [
        ("kv_cache", dict(kv_cache=kv[..., :-4])),                         # bytes of other rows
        ("kv_cache", dict(kv_cache=kv.view(torch.int8))),
        ("kv_cache", dict(kv_cache=torch.cat([kv, kv[..., :1]], -1)[..., :-1])),  # rows not 4-byte aligned
        ("d_v", dict(d_v=DV - 2)),                                         # latent width not a multiple of 4
        ("d_v", dict(q=torch.randn(2, 3, 81).half(), kv_cache=odd_rope, block_table=None,
                     indices=idx.clamp_max(15))),                          # odd rope width
        ("d_v", dict(d_v=D + 1)),
    ]
    dt.sparse_attention_decode(**ok)  # valid: its cached plan must not serve the calls below
    for name, change in cases:
        args = {**ok, **change}
        with pytest.raises(ValueError, match=f"^{name}"):
            dt.sparse_attention_decode(args.pop("q"), args.pop("kv_cache"), args.pop("indices"), **args)
    with pytest.raises(ValueError, match="^kv_cache"):
        dt.sparse_attention_prefill(q, kv[..., :-2], idx, 0.1, d_v=DV, block_table=table[:1])


@pytest.mark.parametrize("name", ["sparse_attention_decode", "sparse_attention_prefill"])
def test_attention_registry_entries(name):
    """The FP8 cache's shapes (``fp8`` 1): checked runs at their CPU shapes, 656 bytes a selected token in the cost
    (the bf16 cache's 1152), the bf16 cache's FLOPs, and defaults valid at the GPU shapes."""
    spec = registry.get(name)
    phase = spec.phases[0]
    for shape in [s for s in spec.bench_shapes(phase, False) if s["fp8"]]:
        inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 7)
        assert inputs["kv_cache"].dtype == torch.uint8
        out, ref = spec.run(inputs, spec.launch_config(phase, shape, "cpu")), spec.reference(inputs)
        assert spec.compare(out, ref) is None
        assert spec.compare((out[0] + 0.01, out[1]), ref) is not None
    dsa = [s for s in spec.bench_shapes(phase, True) if s["fp8"]][0]
    bf16 = {**dsa, "fp8": 0}
    rows = dsa["B"] * dsa["k"] if phase == "decode" else min(dsa["T"] * dsa["k"], dsa["L"])
    assert spec.cost(phase, bf16).bytes - spec.cost(phase, dsa).bytes == rows * (1152 - 656)
    assert spec.cost(phase, dsa).flops == spec.cost(phase, bf16).flops
    assert all(spec.is_valid(spec.default(phase, s), s) for s in spec.bench_shapes(phase, True))
    long_tile = {"BLOCK_N": 128, "BLOCK_H": 64, "num_splits": 1, "num_warps": 8, "num_stages": 1}
    assert spec.constraint(long_tile, bf16) is None and "dequantized tile" in spec.constraint(long_tile, dsa)


# -- the runner -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model_runner.__main__ import main

    folder = tmp_path_factory.mktemp("tiny")
    assert main(["make-tiny", str(folder)]) == 0
    return folder


def test_runner_fp8_kv_cache(tiny):
    """``kv_cache="fp8"``: uint8 latent rows in every layer; the kernel mode's prefill logits equal the reference
    mode's (the same quantization on both sides), and stay near the activation-dtype cache's (FP8 rounding only; an
    expert choice it flips moves a logit by more than the rounding, so near is a cosine)."""
    from model_runner import SamplingParams, build_engine

    prompts = [list(range(1, 11))]  # 10 tokens: longer than the tiny model's top-k (8)
    logits = {}
    for mode, kv_cache in (("kernel", "fp8"), ("reference", "fp8"), ("reference", "activation")):
        eng = build_engine(tiny, mode=mode, dtype=torch.float16, device="cpu", num_pages=8, page_size=16, max_seqs=2,
                           max_seq_len=32, max_num_batched_tokens=64, poison=True, kv_cache=kv_cache)
        layer = eng.cache.layers[0]
        config = eng.model.config
        row = (fp8_latent_bytes(config.kv_lora_rank, config.qk_rope_head_dim) if kv_cache == "fp8" else
               2 * config.latent_dim)
        assert layer.kv.shape[-1] * layer.kv.element_size() == row == eng.cache.bytes_per_token()["kv cache"]
        forward, steps = eng.model.forward, []
        eng.model.forward = lambda *args: steps.append(forward(*args)) or steps[-1]
        eng.generate(prompts, SamplingParams(max_new_tokens=1), progress=False)
        logits[mode, kv_cache] = steps[0]
    torch.testing.assert_close(logits["kernel", "fp8"], logits["reference", "fp8"], rtol=0, atol=3e-2)
    fp8, plain = logits["reference", "fp8"].flatten(), logits["reference", "activation"].flatten()
    assert not torch.equal(fp8, plain) and torch.nn.functional.cosine_similarity(fp8, plain, dim=0) > 0.95
    with pytest.raises(Exception, match="kv_cache"):
        build_engine(tiny, mode="reference", dtype=torch.float32, device="cpu", kv_cache="fp16")


def test_cli_kv_cache_flag(tiny, tmp_path, capsys):
    """``generate --kv-cache fp8`` runs on the FP8 cache; the memory plan names it with its bytes a token (all
    layers: the tiny model's 68-byte rows instead of 96)."""
    import json

    from model_runner import ModelConfig
    from model_runner.__main__ import main

    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text(json.dumps([5, 6, 7]) + "\n")
    layers = ModelConfig.from_json(tiny / "config.json").num_hidden_layers
    for kv_cache, row in (("fp8", 68), ("activation", 96)):
        assert main(["generate", "--model", str(tiny), "--prompts", str(prompts), "--out", str(out), "--mode",
                     "reference", "--max-new-tokens", "2", "--no-progress", "--kv-cache", kv_cache]) == 0
        stdout = capsys.readouterr().out
        assert f"kv cache {kv_cache}" in stdout and f"kv cache ({kv_cache}, {row * layers} B a token)" in stdout
        assert len(json.loads(out.read_text())["token_ids"]) == 2


def test_fp8_cache_report():
    """The bench report beside the kernel rows: both caches checked at the same shape, bytes per selected token
    (2 D for bf16, the FP8 row), and the FP8 rate as a fraction of the bf16 rate."""
    from dsa_triton.bench.reports import REPORTS

    (row,) = REPORTS["sparse_attention_fp8_cache"](torch.device("cpu"), None)
    assert "error" not in row, row
    assert row["bf16_bytes_per_selected_token"] == 2 * D and row["fp8_bytes_per_selected_token"] == 100
    assert row["fp8_rate_of_bf16"] == row["bf16_us"] / row["fp8_us"] > 0
