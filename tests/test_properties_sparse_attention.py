"""Property tests of ``dt.sparse_attention_decode`` and ``dt.sparse_attention_prefill`` (:mod:`tests.property_harness`:
every generated call raises a clear error or equals the reference, :mod:`.sparse_attention_reference`), DeepSeek-V4's
arguments included (sinks, lengths, a second index set over a second cache, MODEL1 FP8 pages)."""
import math

import pytest
import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.formats import model1_cache, model1_dequantize, model1_quantize
from dsa_triton.attention.sparse_attention_reference import (sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)
from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC, PREFILL_SPEC, V4_ARGS

from .property_harness import (Case, check, checked, config_arg, element, generator, int_arg, mutate, nan_split,
                               real_arg, run_property, tensor_arg)

DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MODEL1_ROPE = 16  # MODEL1 rows here: 64 quantized + 16 rope values


def _cache(draw, g, rows_needed: int, D: int, dtype):
    """``(kv_cache, num_slots, P)``: paged ``[pages, P, D]`` or flat ``[slots, D]`` random rows."""
    P = draw(st.sampled_from([1, 4, 16]))
    pages = max(1, -(-rows_needed // P)) + draw(st.integers(0, 2))
    kv = torch.randn(pages, P, D, generator=g).to(dtype)
    if draw(st.booleans()) and P > 1:
        return kv, pages * P, P
    return kv.view(pages * P, D) if draw(st.booleans()) else kv, pages * P, P


def _model1_cache(draw, g, rows_needed: int):
    """``(kv_cache, num_slots, P)``: MODEL1 pages of 80 values (64 quantized + 16 rope), FlashMLA's page stride."""
    P = draw(st.sampled_from([1, 4, 16]))
    pages = max(1, -(-rows_needed // P)) + draw(st.integers(0, 2))
    kv = model1_cache(pages, P, 64, MODEL1_ROPE)
    kv.copy_(model1_quantize(torch.randn(pages, P, 80, generator=g) * 4, MODEL1_ROPE))
    return kv, pages * P, P


def _table(g, kv: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    """``[rows, width]`` pages of ``kv`` (distinct where there are enough)."""
    return torch.stack([torch.randperm(kv.shape[0], generator=g)[:width] if width <= kv.shape[0] else
                        torch.randint(0, kv.shape[0], (width,), generator=g) for _ in range(rows)])


def _values(cache: torch.Tensor, d_v: int) -> torch.Tensor:
    """A cache's values as fp32 (MODEL1 pages dequantized)."""
    return model1_dequantize(cache, MODEL1_ROPE) if cache.dtype == torch.uint8 else cache[..., :d_v].float()


def _indices(g, rows: int, k: int, limit: int, dtype):
    """``[rows, k]`` distinct positions below ``limit`` (as many as there are), some -1."""
    idx = torch.stack([torch.randperm(max(limit, k), generator=g)[:k] for _ in range(rows)]) if rows else \
        torch.zeros(0, k, dtype=torch.int64)
    idx = torch.where(idx < limit, idx, -1)
    idx = torch.where(torch.rand(rows, k, generator=g) < 0.2, -1, idx)
    return idx.to(dtype)


@st.composite
def attention_cases(draw, phase: str):
    g = generator(draw)
    dtype = draw(st.sampled_from(DTYPES))
    D, d_v = draw(st.sampled_from([(16, 16), (48, 32), (80, 64), (40, 8), (80, 80)]))
    model1 = D == d_v == 80 and draw(st.booleans())
    H, k = draw(st.integers(1, 4)), draw(st.integers(1, 20))
    if phase == "decode":
        B, S = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        q = torch.randn(B, S, H, D, generator=g).to(dtype)
        four_dims = S > 1 or draw(st.booleans())
        q = q if four_dims else q[:, 0]
        per_token = four_dims and draw(st.booleans())
        rows = B * S if per_token else B
    else:
        B = T = draw(st.integers(0, 3))
        q = torch.randn(T, H, D, generator=g).to(dtype)
        rows, per_token, S = T, False, 1
    new_cache = (lambda: _model1_cache(draw, g, 24)) if model1 else (lambda: _cache(draw, g, 24, D, dtype))
    index_dtype = draw(st.sampled_from(INDEX_DTYPES))
    table_rows = B if phase == "decode" else draw(st.sampled_from([1, T] if T else [1]))
    lead = (B, S) if per_token else (rows,)

    def index_set(k):  # (cache, indices, block table or None, the indices' limit, P)
        kv, num_slots, P = new_cache()
        if draw(st.booleans()) and kv.dim() == 3:
            table = _table(g, kv, draw(st.integers(1, 3)), table_rows).to(draw(st.sampled_from(INDEX_DTYPES)))
            return kv, _indices(g, rows, k, table.shape[1] * P, index_dtype).view(*lead, k), table, \
                table.shape[1] * P, P
        return kv, _indices(g, rows, k, num_slots, index_dtype).view(*lead, k), None, num_slots, P

    kv, idx, table, limit, P = index_set(k)
    args = {"q": q, "kv_cache": kv, "indices": idx, "sm_scale": draw(st.sampled_from([D ** -0.5, 0.3, -0.2, 0.0])),
            "d_v": d_v, **({"block_table": table} if table is not None else {})}
    args["check_values"] = draw(st.booleans())
    limit2 = 0
    if model1 or draw(st.booleans()):  # DeepSeek-V4's arguments, each or not
        if draw(st.booleans()):
            sink = torch.randn(H, generator=g)
            sink[torch.rand(H, generator=g) < 0.3] = draw(st.sampled_from([math.inf, -math.inf]))
            args["attn_sink"] = sink
        length_shape = (B,) if per_token and draw(st.booleans()) else lead  # decode [B, S, k]: also one a sequence
        if draw(st.booleans()):
            args["topk_length"] = torch.randint(0, k + 1, length_shape, generator=g, dtype=torch.int32)
        if draw(st.booleans()):
            k2 = draw(st.integers(1, 20))
            args["extra_kv_cache"], args["extra_indices"], table2, limit2, _ = index_set(k2)
            args.update({"extra_block_table": table2} if table2 is not None else {})
            if draw(st.booleans()):
                args["extra_topk_length"] = torch.randint(0, k2 + 1, length_shape, generator=g, dtype=torch.int32)

    def kv_pages(draw, args):  # pages further apart than P rows
        if kv.dim() != 3 or kv.shape[0] <= 1 or model1:
            return None
        wide = torch.randn(kv.shape[0], kv.shape[1] + 1, D, generator=g).to(dtype)
        wide[:, : kv.shape[1]] = kv
        args["kv_cache"] = wide[:, : kv.shape[1]]
        return "", ("kv_cache",)

    def table_entries(draw, args):  # a table entry an index reads: -1, or past the cache
        if "block_table" not in args:
            return None
        table = args["block_table"]
        used = args["indices"].reshape(table.shape[0], -1) if phase == "decode" or table.shape[0] == rows else \
            args["indices"].reshape(1, -1)
        valid = (used >= 0).nonzero()
        if not valid.shape[0]:
            return None
        r, c = valid[0].tolist()
        table = table.clone()
        table[r if table.shape[0] > 1 else 0, int(used[r, c]) // P] = draw(st.sampled_from([-1, kv.shape[0]]))
        args["block_table"] = table
        return "", ("block_table",)

    mutation, names = mutate(draw, args, {
        "valid": None, "q": tensor_arg("q", DTYPES, ("q", "kv_cache", "indices", "block_table", "d_v", "attn_sink",
                                                    "extra_kv_cache")),
        "kv_cache": tensor_arg("kv_cache", (kv.dtype,), ("kv_cache", "block_table", "indices", "extra_kv_cache")),
        "kv pages": kv_pages,
        "indices": tensor_arg("indices", INDEX_DTYPES, ("indices", "indices.shape[-1] (k)", "indices.shape[1] (k)",
                                                        "extra_indices", "topk_length", "extra_topk_length")),
        "index values": checked(element("indices", [-2, limit, 2**31 - 1])),  # (unchecked: skipped, not compared)
        "block_table": tensor_arg("block_table", INDEX_DTYPES, ("block_table", "kv_cache")),
        "table entries": checked(table_entries),
        "sm_scale": real_arg("sm_scale"),
        "d_v": int_arg("d_v", huge=False, special=((D + 1, "D + 1"),), names=("d_v", "kv_cache")),
        # NaN in q or in a cache row an index names (a MODEL1 byte 0xFF: a NaN value or scale): NaN in, NaN out
        "nan": element(("q",) if model1 else ("q", "kv_cache"), [math.nan], ()),
        "nan byte": element("kv_cache", [0xFF], ()) if model1 else None,
        "attn_sink": tensor_arg("attn_sink", (torch.float32,), none=(None, "None")),
        "topk_length": tensor_arg("topk_length", INDEX_DTYPES, none=(None, "None")),
        "extra_topk_length": tensor_arg("extra_topk_length", INDEX_DTYPES, none=(None, "None")),
        "length values": checked(element(("topk_length", "extra_topk_length"), [-1, 2**20])),
        "extra_kv_cache": tensor_arg("extra_kv_cache", (kv.dtype,), ("extra_kv_cache", "extra_block_table",
                                                                    "extra_indices")),
        "extra_indices": tensor_arg("extra_indices", INDEX_DTYPES, ("extra_indices", "extra_indices.shape[-1] (k2)",
                                                                    "extra_kv_cache", "extra_topk_length",
                                                                    "extra_block_table")),
        "extra index values": checked(element("extra_indices", [-2, limit2, 2**31 - 1])),
        "extra_block_table": tensor_arg("extra_block_table", INDEX_DTYPES, ("extra_block_table", "extra_kv_cache")),
        "config": config_arg(DECODE_SPEC if phase == "decode" else PREFILL_SPEC)})
    return _case(phase, mutation, args, names)


def _case(phase, mutation, args, names):
    op = dt.sparse_attention_decode if phase == "decode" else dt.sparse_attention_prefill
    oracle = sparse_attention_decode_torch if phase == "decode" else sparse_attention_prefill_torch
    spec = DECODE_SPEC if phase == "decode" else PREFILL_SPEC

    def reference():
        return oracle(args["q"], args["kv_cache"], args["indices"], args["sm_scale"], args["d_v"],
                      args.get("block_table"), **{k: args[k] for k in V4_ARGS if k in args})

    def compare(out, ref):
        """The spec's comparison, with a bf16 term: the kernel's probabilities enter the value dot in bf16 (as on the
        tensor cores), an error up to 2^-8 of the largest value read, which a few indices do not average down."""
        (o, lse), (ro, rlse) = out, ref
        if o.dtype != args["q"].dtype or lse.dtype != torch.float32:
            return f"dtypes {o.dtype} / {lse.dtype}"
        problem, o, ro = nan_split(o, ro)
        problem = problem or nan_split(lse, rlse)[0]
        if problem:
            return problem
        if o.dtype == torch.bfloat16:
            values = [_values(args[c], args["d_v"]) for c in ("kv_cache", "extra_kv_cache") if args.get(c) is not None]
            largest = max((v.where(v.isfinite(), 0.0).abs().max().item() for v in values if v.numel()), default=0.0)
            bad = ~((o.float() - ro).abs() <= 1e-3 + 1e-2 * ro.abs() + 2.0 ** -8 * largest)
            if bool(bad.any()):
                return f"out: {int(bad.sum())} elements off (max abs error {(o.float() - ro).abs().max().item():.3g})"
            o = ro.to(o.dtype)  # (the out check is done: the spec's checks the lse)
        nan = rlse.isnan()
        return spec.compare((o, lse.where(~nan, 0.0)), (ro, rlse.where(~nan, 0.0)))

    return Case(f"sparse_attention_{phase}", mutation, args, lambda: op(**args), names, reference, compare)


def test_sparse_attention_decode():
    run_property(attention_cases("decode"), examples=[Q_WITHOUT_S])


def test_sparse_attention_prefill():
    run_property(attention_cases("prefill"))


# -- defects found by this test, kept as explicit cases -----------------------------------------------------------
def _decode_args(**changes):
    g = torch.Generator().manual_seed(0)
    args = {"q": torch.randn(1, 2, 16, generator=g).half(), "kv_cache": torch.randn(4, 16, generator=g).half(),
            "indices": torch.tensor([[0, 3]], dtype=torch.int32), "sm_scale": 0.25, "d_v": 16}
    args.update(changes)
    return args


# q [B, Hq, D] with per-token indices [B, 1, k] passed the checks and failed in a reshape (RuntimeError) or in the
# kernel launcher (a ValueError from unpacking q's shape), naming nothing
Q_WITHOUT_S = _case("decode", "q [B, Hq, D], indices [B, S, k]",
                    _decode_args(indices=torch.tensor([[[0, 3]]], dtype=torch.int32)), ("indices",))


# a config that is not a dict raised a TypeError from dict() that named nothing
@pytest.mark.parametrize("config", [7, "BLOCK_N"])
def test_config_not_a_dict_is_named(config):
    check(_case("decode", "config not a dict", _decode_args(config=config), ("config",)))
