"""Property tests of ``dt.sparse_attention_decode`` and ``dt.sparse_attention_prefill`` (:mod:`tests.property_harness`:
every generated call raises a clear error or equals the reference, :mod:`.sparse_attention_reference`)."""
import math

import pytest
import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.sparse_attention_reference import (sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)
from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC, PREFILL_SPEC

from .property_harness import (Case, check, checked, config_arg, element, generator, int_arg, mutate, nan_split,
                               real_arg, run_property, tensor_arg)

DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _cache(draw, g, rows_needed: int, D: int, dtype):
    """``(kv_cache, num_slots, P)``: paged ``[pages, P, D]`` or flat ``[slots, D]`` random rows."""
    P = draw(st.sampled_from([1, 4, 16]))
    pages = max(1, -(-rows_needed // P)) + draw(st.integers(0, 2))
    kv = torch.randn(pages, P, D, generator=g).to(dtype)
    if draw(st.booleans()) and P > 1:
        return kv, pages * P, P
    return kv.view(pages * P, D) if draw(st.booleans()) else kv, pages * P, P


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
    D, d_v = draw(st.sampled_from([(16, 16), (48, 32), (80, 64), (40, 8)]))
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
    logical = draw(st.booleans())
    kv, num_slots, P = _cache(draw, g, 24, D, dtype)
    index_dtype = draw(st.sampled_from(INDEX_DTYPES))
    args = {"q": q, "kv_cache": kv, "sm_scale": draw(st.sampled_from([D ** -0.5, 0.3, -0.2, 0.0])), "d_v": d_v}
    if logical and kv.dim() == 3:
        width = draw(st.integers(1, 3))
        table_rows = B if phase == "decode" else draw(st.sampled_from([1, T] if T else [1]))
        table = torch.stack([torch.randperm(kv.shape[0], generator=g)[:width] if width <= kv.shape[0] else
                             torch.randint(0, kv.shape[0], (width,), generator=g) for _ in range(table_rows)])
        args["block_table"] = table.to(draw(st.sampled_from(INDEX_DTYPES)))
        idx = _indices(g, rows, k, width * P, index_dtype)
    else:
        idx = _indices(g, rows, k, num_slots, index_dtype)
    args["indices"] = idx.view(B, S, k) if per_token else idx
    args["check_values"] = draw(st.booleans())
    limit = num_slots if "block_table" not in args else args["block_table"].shape[1] * P

    def kv_pages(draw, args):  # pages further apart than P rows
        if kv.dim() != 3 or kv.shape[0] <= 1:
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
        table[r if table.shape[0] > 1 else 0, int(used[r, c]) // P] = draw(st.sampled_from([-1, num_slots // P]))
        args["block_table"] = table
        return "", ("block_table",)

    mutation, names = mutate(draw, args, {
        "valid": None, "q": tensor_arg("q", DTYPES, ("q", "kv_cache", "indices", "block_table", "d_v")),
        "kv_cache": tensor_arg("kv_cache", (dtype,), ("kv_cache", "block_table", "indices")),
        "kv pages": kv_pages,
        "indices": tensor_arg("indices", INDEX_DTYPES, ("indices", "indices.shape[-1] (k)", "indices.shape[1] (k)")),
        "index values": checked(element("indices", [-2, limit, 2**31 - 1])),  # (unchecked: skipped, not compared)
        "block_table": tensor_arg("block_table", INDEX_DTYPES, ("block_table", "kv_cache")),
        "table entries": checked(table_entries),
        "sm_scale": real_arg("sm_scale"),
        "d_v": int_arg("d_v", huge=False, special=((D + 1, "D + 1"),)),
        "nan": element(("q", "kv_cache"), [math.nan], ()),  # NaN in q or in a cache row an index names: NaN in, NaN out
        "config": config_arg(DECODE_SPEC if phase == "decode" else PREFILL_SPEC)})
    return _case(phase, mutation, args, names)


def _case(phase, mutation, args, names):
    op = dt.sparse_attention_decode if phase == "decode" else dt.sparse_attention_prefill
    oracle = sparse_attention_decode_torch if phase == "decode" else sparse_attention_prefill_torch
    spec = DECODE_SPEC if phase == "decode" else PREFILL_SPEC

    def reference():
        return oracle(args["q"], args["kv_cache"], args["indices"], args["sm_scale"], args["d_v"],
                      args.get("block_table"))

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
            values = args["kv_cache"][..., : args["d_v"]].float()
            largest = values.where(values.isfinite(), 0.0).abs().max().item() if values.numel() else 0.0
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
