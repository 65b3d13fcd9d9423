"""DeepSeek-V4's sparse attention (Triton interpreter on CPU, fp16 queries) against the fp32 reference: attention sinks,
per-row index lengths, the union of two index sets over two caches (the sliding window and the compressed entries),
D = Dv with the rope dims last, and FlashMLA's MODEL1 FP8 cache (its layout byte for byte, its append, attention
over it).

Every cache slot no sequence owns is NaN (NaN bytes in a MODEL1 cache: 0xFF), and every buffer the op allocates
starts as NaN: a stray read or an unwritten element shows up in the result.
"""
import sys
from pathlib import Path

import pytest
import torch

import dsa_triton as dt
from dsa_triton.attention import sparse_attention
from dsa_triton.attention.append_tokens import append_tokens
from dsa_triton.attention.append_tokens_reference import append_torch
from dsa_triton.attention.formats import (model1_bytes, model1_cache, model1_dequantize, model1_gather,
                                          model1_page_stride, model1_quantize, model1_rope)
from dsa_triton.attention.sparse_attention_reference import (slots_from_indices, sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)
from dsa_triton.attention.sparse_attention_spec import random_paged_cache
from dsa_triton.plans import PlanCache

from .poison import poisoned_allocations
from .test_sparse_attention import check, pick

D, DR = 96, 32  # 64 quantized values (one MODEL1 tile) + 32 rope values; the values are all 96 dims
CFG = {"BLOCK_N": 16, "BLOCK_H": 16, "num_splits": 1, "num_warps": 4, "num_stages": 2}
FLASHMLA_QUANT = Path(__file__).resolve().parents[1] / ".flashmla" / "tests" / "quant.py"


@pytest.fixture(autouse=True)
def poisoned_buffers():
    with poisoned_allocations():
        yield


def tile_scaled(x: torch.Tensor, d_nope: int, g: torch.Generator) -> torch.Tensor:
    """``x`` with each 64-value tile of each row scaled by its own 2^-3 .. 1 (a scale read for the wrong tile or token
    shows)."""
    factors = torch.exp2(torch.randint(-3, 1, (*x.shape[:-1], d_nope // 64), generator=g).float())
    x = x.float().clone()
    x[..., :d_nope] *= factors.repeat_interleave(64, dim=-1)
    return x


def cache(kind: str, seqs: int, L: int, P: int, g: torch.Generator, d: int = D, d_rope: int = DR):
    """``(kv_cache, block_table)``: ``seqs`` sequences of ``L`` random tokens on shuffled pages, NaN elsewhere;
    ``kind`` "fp16" rows or "model1" pages (FlashMLA's page stride, tiles scaled apart)."""
    if kind == "fp16":
        return random_paged_cache(seqs, L, P, d, torch.float16, g)
    kv, table = random_paged_cache(seqs, L, P, d, torch.float32, g)
    pages = model1_cache(kv.shape[0], P, d - d_rope, d_rope)
    pages.copy_(model1_quantize(tile_scaled(kv, d - d_rope, g), d_rope))
    return pages, table


def sinks(H: int, g: torch.Generator) -> torch.Tensor:
    """Per-head sinks: +inf, -inf, then finite ones around the scores' lse."""
    sink = torch.randn(H, generator=g) + 2.0
    sink[0] = float("inf")
    if H > 1:
        sink[1] = float("-inf")
    return sink


def union_args(kind: str, rows: int, seqs: int, g: torch.Generator, logical: bool, P=16, P2=4, k=9, k2=13,
               L=40, L2=30):
    """A first set (a window: ``k`` of ``L`` tokens) and a second set (``k2`` of ``L2`` compressed entries) of
    ``rows`` index rows over caches of ``seqs`` sequences: ``(kv_cache, indices, block_table, extra kwargs)``. Row
    r % 4: both sets full, 3 valid each, the first empty, both empty."""
    kv, table = cache(kind, seqs, L, P, g)
    kv2, table2 = cache(kind, seqs, L2, P2, g)
    idx = pick(rows, L, k, [k, 3, 0, 0], g)
    idx2 = pick(rows, L2, k2, [k2, 3, k2, 0], g)
    per_row = rows // seqs  # index row r belongs to sequence r // per_row
    tables = [t.repeat_interleave(per_row, dim=0) for t in (table, table2)]
    extra = {"extra_kv_cache": kv2}
    if logical:
        extra |= {"extra_indices": idx2, "extra_block_table": table2}
        return kv, idx, table, extra
    extra["extra_indices"] = slots_from_indices(idx2, tables[1], P2).to(torch.int32)
    return kv, slots_from_indices(idx, tables[0], P).to(torch.int32), None, extra


# -- the MODEL1 layout ----------------------------------------------------------------------------------------------

def flashmla_model1_quantize(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's ``tests/quant.py`` ``quantize_k_cache(x[:, :, None], MODEL1_FP8Sparse)`` for bf16 pages
    ``x[num_blocks, block_size, 512]``, transcribed (its ``torch.empty`` made zeros: the pad bytes are unset there)."""
    d_nope, d_rope, tile_size, num_tiles = 448, 64, 64, 7
    num_blocks, block_size, _ = x.shape
    bytes_per_token = d_nope + 2 * d_rope + num_tiles + 1
    size_per_block_padded = (block_size * bytes_per_token + 576 - 1) // 576 * 576
    result = torch.zeros((num_blocks, size_per_block_padded), dtype=torch.float8_e4m3fn)
    result = result[:, :block_size * bytes_per_token]
    nope_rope = result[:, :block_size * (d_nope + 2 * d_rope)].view(num_blocks, block_size, d_nope + 2 * d_rope)
    nope, rope = nope_rope[:, :, :d_nope], nope_rope[:, :, d_nope:].view(x.dtype)
    scales = result[:, block_size * (d_nope + 2 * d_rope):].view(num_blocks, block_size, 8)[:, :, :7].view(
        torch.float8_e8m0fnu)
    rope[:] = x[..., d_nope:]
    for t in range(num_tiles):
        inv = torch.abs(x[..., t * tile_size:(t + 1) * tile_size]).max(dim=-1).values.float() / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil())
        scales[:, :, t] = inv.to(torch.float8_e8m0fnu)
        nope[:, :, t * tile_size:(t + 1) * tile_size] = (
            x[..., t * tile_size:(t + 1) * tile_size].float() / inv[..., None]).to(torch.float8_e4m3fn)
    return result.view(num_blocks, block_size, -1)


def flashmla_model1_dequantize(pages: torch.Tensor) -> torch.Tensor:
    """``dequantize_k_cache`` of the same file for MODEL1 pages ``[num_blocks, block_size, 584]`` (bf16 out)."""
    num_blocks, block_size, _ = pages.shape
    flat = pages.reshape(num_blocks, -1)
    nope_rope = flat[:, :block_size * 576].view(num_blocks, block_size, 576)
    scales = flat[:, block_size * 576:].view(num_blocks, block_size, 8)[:, :, :7].view(torch.float8_e8m0fnu)
    result = torch.empty(num_blocks, block_size, 512, dtype=torch.bfloat16)
    result[..., 448:] = nope_rope[..., 448:].view(torch.bfloat16)
    for t in range(7):
        result[..., t * 64:(t + 1) * 64] = (nope_rope[..., t * 64:(t + 1) * 64].view(torch.float8_e4m3fn).to(
            torch.bfloat16) * scales[:, :, t].to(torch.bfloat16)[..., None])
    return result


def test_model1_layout_is_flashmlas_byte_for_byte():
    """584 bytes a token; per page the tokens' e4m3 + bf16 bytes, then their scale bytes; pages as FlashMLA pads them.
    Bytes equal to FlashMLA's quantizer (over values spanning 2^-14 .. 2^8, zero tiles included: the 1e-4 floor)."""
    assert model1_bytes() == model1_bytes(448, 64) == 584 and model1_page_stride(64) == 37440
    assert model1_rope(512, 584) == 64 and model1_rope(D, model1_bytes(64, DR)) == DR and model1_rope(512, 583) is None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 512, generator=g) * torch.exp2(torch.randint(-14, 9, (3, 16, 8), generator=g).float()
                                                           ).repeat_interleave(64, dim=-1)
    x[0, 2, :64] = 0
    x = x.bfloat16()
    ours, theirs = model1_quantize(x), flashmla_model1_quantize(x).view(torch.uint8)
    assert ours.shape == (3, 16, 584) and torch.equal(ours, theirs)
    assert int(ours[0].view(-1)[16 * 576 + 2 * 8]) == 127 - 13  # a zero tile: FlashMLA's floor, scale 2^-13
    pages = model1_cache(3, 16, fill=0xFF)
    pages.copy_(ours)
    assert pages.stride() == (model1_page_stride(16), 584, 1) and model1_page_stride(16) == 9792
    values = model1_dequantize(pages)
    assert torch.equal(values, flashmla_model1_dequantize(pages).float())
    assert torch.equal(values[..., 448:], x[..., 448:].float())  # rope values as they are
    slots = torch.tensor([[0, 17], [47, 5]])
    assert torch.equal(model1_gather(pages, slots), values.view(-1, 512)[slots])


@pytest.mark.skipif(not FLASHMLA_QUANT.is_file(), reason="FlashMLA's sources are not vendored here")
def test_model1_layout_matches_the_vendored_flashmla_quant():
    """The same against FlashMLA's own ``tests/quant.py`` (quantize and dequantize), where it is vendored."""
    sys.path.insert(0, str(FLASHMLA_QUANT.parent))
    try:
        import quant
    finally:
        sys.path.remove(str(FLASHMLA_QUANT.parent))
    layout = quant.FP8KVCacheLayout.MODEL1_FP8Sparse
    x = torch.randn(2, 64, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    theirs = quant.quantize_k_cache(x[:, :, None], layout)
    ours = model1_quantize(x)
    pad = (64 * 576 + 8 * torch.arange(64) + 7)
    mine, flash = ours.view(2, -1).clone(), theirs.view(torch.uint8).view(2, -1).clone()
    mine[:, pad] = flash[:, pad] = 0  # (uninitialized there)
    assert torch.equal(mine, flash)
    assert torch.equal(model1_dequantize(ours), quant.dequantize_k_cache(theirs, layout)[:, :, 0].float())


def test_model1_non_finite_tiles_are_nan():
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(3))
    x[0, 1, 5], x[1, 3, D - 1] = float("nan"), float("inf")
    values = model1_dequantize(model1_quantize(x, DR), DR)
    assert int(model1_quantize(x, DR)[0].view(-1)[4 * 128 + 1 * 2]) == 0xFF  # token 1's scale byte: NaN
    assert bool(values[0, 1, :64].isnan().all()) and not values[0, 1, 64:].isnan().any()
    assert values[1, 3, D - 1] == float("inf") and not values[1, 3, :D - 1].isnan().any()
    assert not values[0, 0].isnan().any()


@pytest.mark.parametrize("d, d_rope, dtype", [(512, 64, torch.bfloat16), (D, DR, torch.float32),
                                              (D, DR, torch.float16)])
def test_model1_append_bit_exact(d, d_rope, dtype):
    """``append_tokens`` into MODEL1 pages (FlashMLA's page stride): a prefill chunk over two pages, then a decode
    token, bit for bit the reference's; unwritten tokens keep their NaN bytes; rows then read back by attention."""
    g = torch.Generator().manual_seed(d + d_rope)
    P = 16
    pages, ref = model1_cache(4, P, d - d_rope, d_rope, fill=0xFF), model1_cache(4, P, d - d_rope, d_rope, fill=0xFF)
    x = tile_scaled(torch.randn(20, d, generator=g) * 4, d - d_rope, g).to(dtype)
    # tokens 0..18 at page 2 slots 3.. and page 1 slots 0..5 (a prefill chunk), then token 19 at page 1 slot 6
    for items in ([[0, 13, 2, 3], [13, 6, 1, 0]], [[19, 1, 1, 6]]):
        append_tokens(pages, None, None, None, x, None, torch.tensor(items, dtype=torch.int32), rope_dim=d_rope)
    slots = torch.cat([2 * P + 3 + torch.arange(13), P + torch.arange(7)])
    append_torch(ref, None, None, None, x, None, slots, None, None, rope_dim=d_rope)
    assert torch.equal(pages, ref)
    written = torch.zeros(4 * P, dtype=torch.bool)
    written[slots] = True
    assert torch.equal(model1_gather(pages, slots, d_rope), model1_gather(ref, slots, d_rope))
    assert bool(model1_gather(pages, (~written).nonzero()[:, 0], d_rope).isnan().all())
    q = torch.randn(2, 3, d, generator=g).half()
    idx = slots[torch.randperm(20, generator=g)[:16]].view(2, 8).int()
    out, lse = dt.sparse_attention_decode(q, pages, idx, 0.1, d_v=d, config=CFG)
    check(out, lse, *sparse_attention_decode_torch(q, ref, idx, 0.1, d))


# -- attention --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, H, S, per_token, logical, splits, k, k2", [
    ("fp16", 5, None, False, True, 1, 9, 13),     # q [B, Hq, D], logical positions and a block table per set
    ("fp16", 3, 2, False, False, 4, 20, 37),      # 2 tokens sharing each set (a 6-row tile), 4 splits over both
    ("fp16", 64, 2, True, True, 2, 9, 13),        # per-token sets, 64 heads
    ("model1", 3, 2, True, False, 2, 9, 13),      # MODEL1 pages, per-token sets
    ("model1", 128, None, False, True, 1, 9, 13),  # 128 heads
])
def test_decode_union_sinks_and_lengths(kind, H, S, per_token, logical, splits, k, k2):
    """Both sets, each alone (rows whose other set is empty or cut to length 0), neither (out 0, lse -inf), with
    sinks of +inf, -inf and finite values and lengths that cut rows partly, fully or not at all."""
    g = torch.Generator().manual_seed(H + splits)
    B = 4
    q = torch.randn((B, H, D) if S is None else (B, S, H, D), generator=g).half()
    rows = B * (S or 1) if per_token else B
    kv, idx, table, extra = union_args(kind, rows, B, g, logical, k=k, k2=k2, L2=50)
    lead = (B, S) if per_token else (B,)
    idx, extra["extra_indices"] = idx.view(*lead, -1), extra["extra_indices"].view(*lead, -1)
    extra |= {"attn_sink": sinks(H, g), "topk_length": torch.tensor([k, 2, k, 0], dtype=torch.int32),
              "extra_topk_length": torch.randint(0, k2 + 1, lead, generator=g, dtype=torch.int32)}
    config = {**CFG, "num_splits": splits}
    out, lse = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, block_table=table, config=config, **extra)
    ref_out, ref_lse = sparse_attention_decode_torch(q, kv, idx, 0.2, D, table, **extra)
    assert bool((ref_lse == float("-inf")).any()) and bool((ref_lse > float("-inf")).any())
    check(out, lse, ref_out, ref_lse)
    assert bool((out[..., 0, :] == 0).all())  # the +inf sink's head


@pytest.mark.parametrize("kind, table_rows, splits", [("fp16", 1, 1), ("model1", 2, 2), ("fp16", 0, 2)])
def test_prefill_union_sinks_and_lengths(kind, table_rows, splits):
    """Each token its own sets; block tables shared ([1, pages]), per token ([T, pages]) or none (slots)."""
    g = torch.Generator().manual_seed(10 + table_rows)
    T, H = 7, 3
    q = torch.randn(T, H, D, generator=g).half()
    kv, table = cache(kind, 2, 40, 16, g)
    kv2, table2 = cache(kind, 2, 30, 4, g)
    seq = torch.arange(T) % 2 if table_rows == 2 else torch.zeros(T, dtype=torch.long)
    idx, idx2 = pick(T, 40, 9, [9, 3, 0, 0], g), pick(T, 30, 13, [13, 3, 13, 0], g)
    if table_rows == 0:
        idx, idx2 = (slots_from_indices(i, t[seq], P).int() for i, t, P in ((idx, table, 16), (idx2, table2, 4)))
        bt = bt2 = None
    else:
        bt, bt2 = (table[seq], table2[seq]) if table_rows == 2 else (table[:1], table2[:1])
    extra = {"attn_sink": sinks(H, g), "topk_length": torch.randint(0, 10, (T,), generator=g, dtype=torch.int32),
             "extra_kv_cache": kv2, "extra_indices": idx2, "extra_block_table": bt2,
             "extra_topk_length": torch.tensor([13, 5, 0, 13, 2, 13, 13], dtype=torch.int32)}
    out, lse = dt.sparse_attention_prefill(q, kv, idx, 0.3, d_v=D, block_table=bt, config={**CFG, "num_splits": splits},
                                           **extra)
    check(out, lse, *sparse_attention_prefill_torch(q, kv, idx, 0.3, D, bt, **extra))


@pytest.mark.parametrize("kind", ["fp16", "model1"])
def test_deepseek_v4_dims(kind):
    """D = Dv = 512 with the 64 rope dims last (MODEL1: 448 quantized values), a window of 20 and 24 compressed
    entries, sinks and lengths, at 5 heads."""
    g = torch.Generator().manual_seed(4)
    B, H = 2, 5
    kv, table = cache(kind, B, 32, 16, g, 512, 64)
    kv2, table2 = cache(kind, B, 40, 16, g, 512, 64)
    q = torch.randn(B, H, 512, generator=g).half()
    idx = slots_from_indices(pick(B, 32, 20, [20, 5], g), table, 16).int()
    idx2 = slots_from_indices(pick(B, 40, 24, [24, 24], g), table2, 16).int()
    extra = {"attn_sink": sinks(H, g), "topk_length": torch.tensor([20, 4], dtype=torch.int32),
             "extra_kv_cache": kv2, "extra_indices": idx2,
             "extra_topk_length": torch.tensor([17, 24], dtype=torch.int32)}
    for splits in (1, 2):
        out, lse = dt.sparse_attention_decode(q, kv, idx, 512 ** -0.5, d_v=512, config={**CFG, "num_splits": splits},
                                              **extra)
        check(out, lse, *sparse_attention_decode_torch(q, kv, idx, 512 ** -0.5, 512, **extra))


def test_fp8_latent_caches_take_the_extras_too():
    """The DeepSeek-V3.2 FP8 latent cache (d_v < D) with a second set, sinks and lengths: the same kernel paths."""
    g = torch.Generator().manual_seed(11)
    B, H, d, d_v = 3, 4, 80, 64
    (kv, table), (kv2, table2) = (random_paged_cache(1, L, 16, d, torch.float32, g) for L in (40, 30))
    kv, kv2 = dt.fp8_latent_quantize(kv, d_v), dt.fp8_latent_quantize(kv2, d_v)
    q = torch.randn(B, H, d, generator=g).half()
    idx = slots_from_indices(pick(B, 40, 12, [12, 4, 0], g), table.expand(B, -1), 16).int()
    extra = {"attn_sink": sinks(H, g), "topk_length": torch.tensor([12, 2, 5], dtype=torch.int32),
             "extra_kv_cache": kv2, "extra_indices": pick(B, 30, 9, [9, 9, 0], g),
             "extra_block_table": table2, "extra_topk_length": torch.tensor([4, 9, 9], dtype=torch.int32)}
    out, lse = dt.sparse_attention_prefill(q, kv, idx, 0.2, d_v=d_v, config={**CFG, "num_splits": 2}, **extra)
    check(out, lse, *sparse_attention_prefill_torch(q, kv, idx, 0.2, d_v, **extra))


def test_sink_semantics():
    """A sink of +inf gives out 0, -inf changes nothing, a finite one scales out by exp(lse) / (exp(lse) +
    exp(sink)); lse never changes; a row without a valid index stays out 0, lse -inf whatever the sink."""
    g = torch.Generator().manual_seed(5)
    B, H = 3, 4
    kv, table = cache("fp16", 1, 40, 16, g)
    q = torch.randn(B, H, D, generator=g).half()
    idx = slots_from_indices(pick(B, 40, 20, [20, 4, 0], g), table.expand(B, -1), 16).int()
    sink = torch.tensor([float("inf"), float("-inf"), 0.5, -1.0])
    for splits in (1, 2):
        config = {**CFG, "num_splits": splits}
        plain_out, plain_lse = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, config=config)
        out, lse = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, config=config, attn_sink=sink)
        assert torch.equal(lse, plain_lse) and bool((lse[2] == float("-inf")).all()) and bool((out[2] == 0).all())
        assert bool((out[:, 0] == 0).all()) and torch.equal(out[:, 1], plain_out[:, 1])
        factor = torch.sigmoid(lse[:2, 2:] - sink[2:])[..., None]
        torch.testing.assert_close(out[:2, 2:].float(), plain_out[:2, 2:].float() * factor, atol=1e-3, rtol=2e-3)


def test_each_set_alone_equals_the_single_set_call():
    """The second set alone (the first all -1) equals a call over the second cache only; lengths of 0 in the second
    set give the first set's result; an index past its row's length is never read (NaN slots there)."""
    g = torch.Generator().manual_seed(6)
    B, H = 2, 3
    kv, idx, _, extra = union_args("model1", B, B, g, False)
    q = torch.randn(B, H, D, generator=g).half()
    kv2, idx2 = extra["extra_kv_cache"], extra["extra_indices"]
    alone = dt.sparse_attention_decode(q, kv2, idx2, 0.2, d_v=D, config=CFG)
    none_first = dt.sparse_attention_decode(q, kv, torch.full_like(idx, -1), 0.2, d_v=D, config=CFG, **extra)
    cut_first = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, config=CFG,
                                           topk_length=torch.zeros(B, dtype=torch.int32), **extra)
    for out, ref in ((none_first, alone), (cut_first, alone)):
        torch.testing.assert_close(out[0], ref[0], atol=1e-3, rtol=2e-3)
        torch.testing.assert_close(out[1], ref[1], atol=2e-5, rtol=0)
    first = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, config=CFG)
    cut_second = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, config=CFG,
                                            extra_topk_length=torch.zeros(B, dtype=torch.int32), **extra)
    torch.testing.assert_close(cut_second[0], first[0], atol=1e-3, rtol=2e-3)
    past = idx.clone()
    past[:, 5:] = torch.tensor(0, dtype=torch.int32)  # slot 0: page 0, NaN bytes
    cut = dt.sparse_attention_decode(q, kv, past, 0.2, d_v=D, config=CFG,
                                     topk_length=torch.full((B,), 5, dtype=torch.int32))
    check(*cut, *sparse_attention_decode_torch(q, kv, torch.where(torch.arange(9) < 5, idx, -1), 0.2, D))


def test_unchecked_lengths_are_clamped():
    """check_values=False: a length past k counts k indices, a negative one none."""
    g = torch.Generator().manual_seed(7)
    B, H = 2, 3
    kv, idx, _, extra = union_args("fp16", B, B, g, False)
    q = torch.randn(B, H, D, generator=g).half()
    lengths = torch.tensor([100, -5], dtype=torch.int32)
    out, lse = dt.sparse_attention_decode(q, kv, idx, 0.2, d_v=D, config=CFG, check_values=False, topk_length=lengths,
                                          **extra)
    check(out, lse, *sparse_attention_decode_torch(q, kv, idx, 0.2, D, topk_length=lengths.clamp(0, 9), **extra))


def test_gluon_serves_deepseek_v32_calls_only(monkeypatch):
    """Where the Gluon kernel applies (patched true on the CPU), a call with any DeepSeek-V4 argument takes the Triton
    kernel."""
    monkeypatch.setattr(sparse_attention, "gluon_applies", lambda *args: True)
    monkeypatch.setattr(sparse_attention, "_DECODE_PLANS", PlanCache())
    g = torch.Generator().manual_seed(8)
    kv, idx, _, extra = union_args("fp16", 2, 2, g, False)
    q = torch.randn(2, 3, D, generator=g).half()
    plans = [sparse_attention._checked_decode_plan(q, kv, idx, None, D, CFG, sparse_attention._Extra(**args))
             for args in ({}, {"attn_sink": sinks(3, g)}, {"topk_length": torch.ones(2, dtype=torch.int32)},
                          {k: extra[k] for k in ("extra_kv_cache", "extra_indices")})]
    assert [p.gluon for p in plans] == [True, False, False, False]


def test_bad_inputs(monkeypatch):
    """Each a ValueError naming the argument, before any launch."""
    g = torch.Generator().manual_seed(9)
    B, H = 2, 3
    kv, idx, table, extra = union_args("fp16", B, B, g, True)
    m1, m1_idx, _, m1_extra = union_args("model1", B, B, g, False)
    q = torch.randn(B, H, D, generator=g).half()
    ok = dict(q=q, kv_cache=kv, indices=idx, sm_scale=0.1, d_v=D, block_table=table, attn_sink=sinks(H, g),
              topk_length=torch.tensor([9, 3], dtype=torch.int32),
              extra_topk_length=torch.tensor([1, 13], dtype=torch.int32), **extra)
    bad_table = extra["extra_block_table"].clone()
    bad_table[0] = extra["extra_kv_cache"].shape[0]  # past the cache, for every index of row 0
    cases = [
        ("attn_sink", dict(attn_sink=ok["attn_sink"].half())),
        ("attn_sink", dict(attn_sink=torch.zeros(H + 1))),
        ("topk_length", dict(topk_length=ok["topk_length"].float())),
        ("topk_length", dict(topk_length=torch.zeros(B + 1, dtype=torch.int32))),
        ("topk_length", dict(topk_length=torch.zeros(B, 2, dtype=torch.int32)[:, 0])),
        ("topk_length", dict(topk_length=torch.tensor([10, 0], dtype=torch.int32))),  # past k = 9
        ("extra_topk_length", dict(extra_topk_length=torch.tensor([-1, 0], dtype=torch.int32))),
        ("extra_indices", dict(extra_indices=None)),  # a second cache without its indices
        ("extra_kv_cache", dict(extra_kv_cache=None)),
        ("extra_indices", dict(extra_indices=extra["extra_indices"][:1])),
        ("extra_indices", dict(extra_indices=extra["extra_indices"].float())),
        ("extra_indices", dict(extra_indices=extra["extra_indices"] + 100)),  # past the block table
        ("extra_block_table", dict(extra_block_table=bad_table)),
        ("extra_block_table", dict(extra_block_table=extra["extra_block_table"][:1])),
        ("extra_kv_cache", dict(extra_kv_cache=extra["extra_kv_cache"].float())),
        ("extra_kv_cache", dict(extra_kv_cache=extra["extra_kv_cache"][..., :-1])),
        ("kv_cache", dict(kv_cache=m1, extra_kv_cache=m1_extra["extra_kv_cache"], indices=m1_idx, block_table=None,
                          extra_block_table=None, extra_indices=m1_extra["extra_indices"], d_v=D - 16)),  # not MODEL1
        ("kv_cache", dict(kv_cache=m1[..., :-1], block_table=None)),
        ("kv_cache", dict(kv_cache=m1.flatten(0, 1), block_table=None)),  # MODEL1 needs its pages
        ("extra_kv_cache", dict(kv_cache=m1, extra_kv_cache=dt.fp8_latent_quantize(kv.float(), D - 16), indices=m1_idx,
                                block_table=None)),
    ]
    launched, launch = [], sparse_attention.sparse_attention_fwd
    monkeypatch.setattr(sparse_attention, "sparse_attention_fwd", lambda *args: launched.append(1) or launch(*args))
    dt.sparse_attention_decode(**ok, config=CFG)  # valid: its plan is cached, and must not serve the calls below
    launched.clear()
    for name, change in cases:
        args = {**ok, **change}
        with pytest.raises(ValueError, match=f"^{name}"):
            dt.sparse_attention_decode(args.pop("q"), args.pop("kv_cache"), args.pop("indices"), **args, config=CFG)
        assert not launched, name
    for name in ("extra_topk_length", "extra_block_table"):
        with pytest.raises(ValueError, match=f"^{name}"):
            dt.sparse_attention_prefill(q, kv, idx, 0.1, d_v=D, block_table=table[:1], **{name: ok[name]})
    with pytest.raises(ValueError, match="^topk_length"):  # prefill: one per token
        dt.sparse_attention_prefill(q, kv, idx, 0.1, d_v=D, block_table=table[:1],
                                    topk_length=torch.zeros(B, 1, dtype=torch.int32))
    assert not launched


# -- registry: model dims and costs -----------------------------------------------------------------------------------

V4_CONFIG = {"model_type": "deepseek_v4", "num_attention_heads": 64, "head_dim": 512, "partial_rotary_factor": 0.125,
             "sliding_window": 128, "index_topk": 512, "index_head_dim": 128, "max_position_embeddings": 1048576,
             "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}}


def test_model_dims_of_deepseek_v4_and_v32():
    """DeepSeek-V4's field names: one K=V head of ``head_dim`` values (rope last), MODEL1 FP8 pages, per attention
    layer type a window and compressed entries; DeepSeek-V3.2's dims as they were."""
    from dsa_triton import registry
    from dsa_triton.model_dims import ModelDims

    m = ModelDims(V4_CONFIG)
    assert (m.v4, m.qk, m.latent, m.rope, m.kv_fp8) == (True, 512, 512, 64, 2)
    assert m.attention_index_sets() == [(128, 512), (128, 8192)]  # transformers' default layers: CSA and HCA
    sliding = ModelDims({**V4_CONFIG, "compress_ratios": [0, 4, 4], "qk_rope_head_dim": 32})
    assert sliding.attention_index_sets() == [(128, 0), (128, 512)] and sliding.rope == 32
    v32 = ModelDims({"num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048})
    assert (v32.v4, v32.qk, v32.latent, v32.kv_fp8) == (False, 576, 512, 1)
    decode = registry.get("sparse_attention_decode")
    assert decode.model_dims(m) == [{"H": 64, "D": 512, "Dv": 512, "k": 128 + k2, "k2": k2, "sink": 1, "lengths": 1,
                                     "P": 64, "fp8": fp8} for k2 in (512, 8192) for fp8 in (0, 2)]
    assert [d["fp8"] for d in decode.model_dims(v32)] == [0, 1]
    append = registry.get("append_tokens")
    assert {(d["D"], d["Dr"], d["DK"], d["fp8"]) for d in append.model_dims(m)} == {
        (512, 0, 128, 0), (512, 0, 0, 0), (512, 64, 128, 2), (512, 64, 0, 2)}


@pytest.mark.parametrize("name", ["sparse_attention_decode", "sparse_attention_prefill"])
def test_v4_bench_shapes_and_costs(name):
    """GPU shapes with 64 and 128 heads, 512 and 1024 compressed entries; a MODEL1 row costs 584 bytes where a bf16
    row costs 1024, the FLOPs are the same; the defaults are valid; the CPU shapes run and match the reference."""
    from dsa_triton import registry

    spec = registry.get(name)
    phase = spec.phases[0]
    v4 = [s for s in spec.bench_shapes(phase, True) if s.get("k2")]
    assert {(s["H"], s["k2"]) for s in v4} >= {(64, 512), (128, 1024)} and {s["fp8"] for s in v4} == {0, 2}
    for shape in v4:
        assert spec.is_valid(spec.default(phase, shape), shape)
    model1 = next(s for s in v4 if s["fp8"] == 2)
    bf16 = {**model1, "fp8": 0}
    rows = (model1["B"] * model1["k"] if phase == "decode" else
            min(model1["T"] * 128, model1["L"]) + min(model1["T"] * model1["k2"], model1["L2"]))
    assert spec.cost(phase, bf16).bytes - spec.cost(phase, model1).bytes == rows * (1024 - 584)
    assert spec.cost(phase, bf16).flops == spec.cost(phase, model1).flops
    for shape in [s for s in spec.bench_shapes(phase, False) if s.get("k2")]:
        inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 3)
        out, ref = spec.run(inputs, spec.default(phase, shape)), spec.reference(inputs)
        assert spec.compare(out, ref) is None
        assert spec.compare((out[0] + 0.01, out[1]), ref) is not None


MODEL1_APPENDS = [{"B": 2, "N": 40, "P": 16, "D": 96, "Dr": 32, "DK": 32, "ctx": 5, "fp8": 2},
                  {"B": 3, "N": 3, "P": 16, "D": 96, "Dr": 32, "DK": 0, "ctx": 17, "fp8": 2}]


@pytest.mark.parametrize("phase, shape", [("prefill", MODEL1_APPENDS[0]), ("decode", MODEL1_APPENDS[1])])
def test_append_registry_entry_into_model1_pages(phase, shape):
    """The append's registry entry at MODEL1 shapes (``fp8`` 2; with index keys and without, as the window's): bit
    for bit the reference's, a changed byte caught."""
    from dsa_triton import registry

    spec = registry.get("append_tokens")
    inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 5)
    assert inputs["kv_cache"].dtype == torch.uint8 and not inputs["kv_cache"].is_contiguous()  # FlashMLA's pages
    ref = spec.reference(inputs)
    assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is None
    ref[0].view(-1)[(ref[0].view(-1) != 0xFF).nonzero()[0]] ^= 1
    assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is not None


def test_model1_append_compiles_for_sm90():
    """The MODEL1 append launches lower for sm_90 (the bench shapes that tests/test_sm90_compile.py compiles are
    DeepSeek-V3.2's for this op)."""
    from dsa_triton import registry
    from dsa_triton.bench import aot

    spec = registry.get("append_tokens")
    with aot.record_launches() as launches:
        for phase, shape in (("prefill", MODEL1_APPENDS[0]), ("decode", MODEL1_APPENDS[1])):
            spec.run(spec.make_inputs(phase, shape, torch.device("cpu"), 0), spec.default(phase, shape))
    records = [r for r in launches if r["values"].get("KV_MODEL1")]
    assert len(records) == 2
    assert [r["error"] for r in aot.compile_in_subprocess(records)] == [None, None]


def test_shared_memory_count_matches_the_h100_at_model1_widths():
    """The constraint refuses the config an H100 refused (262,400 bytes of shared memory: MODEL1 pages at D 512,
    BLOCK_H 32 / BLOCK_N 64) and keeps the ones that launched there, MODEL1 and FP8 latent alike."""
    constraint = sparse_attention._constraint("decode")
    v4 = {"B": 1, "S": 2, "H": 128, "D": 512, "Dv": 512, "k": 1152, "fp8": 2}
    v32 = {"B": 1, "S": 2, "H": 128, "D": 576, "Dv": 512, "k": 2048, "fp8": 1}

    def config(bh, bn, warps):
        return {"BLOCK_H": bh, "BLOCK_N": bn, "num_splits": 1, "num_warps": warps, "num_stages": 2}

    assert "shared memory" in constraint(config(32, 64, 8), v4)
    for bh, bn, warps in ((16, 32, 4), (64, 64, 8)):
        assert constraint(config(bh, bn, warps), v4) is None
    assert constraint(config(32, 64, 8), v32) is None
    assert constraint(sparse_attention.DECODE.default("decode", v4), v4) is None
