"""Property tests of ``dt.sparse_attention_decode`` and ``dt.sparse_attention_prefill`` (:mod:`tests.property_harness`:
every generated call raises a clear error or equals the reference, :mod:`.sparse_attention_reference`). The defects
it found are kept at the end as explicit cases."""
import math

import pytest
import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.sparse_attention_reference import (sparse_attention_decode_torch,
                                                             sparse_attention_prefill_torch)
from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC, PREFILL_SPEC

from .property_harness import Case, bad_config, bad_int, bad_real, bad_tensor, check, generator, nan_split, run_property

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
    mutation = draw(st.sampled_from(["valid", "q", "kv_cache", "kv pages", "indices", "index values", "block_table",
                                     "table entries", "sm_scale", "d_v", "nan", "config"]))
    names = ()
    if mutation == "q":
        args["q"], kind = draw(bad_tensor(q, dtypes=DTYPES))
        mutation, names = f"q {kind}", ("q", "kv_cache", "indices", "block_table", "d_v")
    elif mutation == "kv_cache":
        args["kv_cache"], kind = draw(bad_tensor(kv, dtypes=(dtype,)))
        mutation, names = f"kv_cache {kind}", ("kv_cache", "block_table", "indices")
    elif mutation == "kv pages" and kv.dim() == 3 and kv.shape[0] > 1:
        wide = torch.randn(kv.shape[0], kv.shape[1] + 1, D, generator=g).to(dtype)
        wide[:, : kv.shape[1]] = kv
        args["kv_cache"], names = wide[:, : kv.shape[1]], ("kv_cache",)  # pages further apart than P rows
    elif mutation == "indices":
        args["indices"], kind = draw(bad_tensor(args["indices"], dtypes=INDEX_DTYPES))
        mutation, names = f"indices {kind}", ("indices", "indices.shape[-1] (k)", "indices.shape[1] (k)")
    elif mutation == "index values" and args["indices"].numel():
        limit = num_slots if "block_table" not in args else args["block_table"].shape[1] * P
        bad = args["indices"].clone()
        bad.view(-1)[draw(st.integers(0, bad.numel() - 1))] = draw(st.sampled_from([-2, limit, 2**31 - 1]))
        args["indices"], args["check_values"], names = bad, True, ("indices",)  # (unchecked: skipped, not compared)
    elif mutation == "block_table" and "block_table" in args:
        args["block_table"], kind = draw(bad_tensor(args["block_table"], dtypes=INDEX_DTYPES))
        mutation, names = f"block_table {kind}", ("block_table", "kv_cache")
    elif mutation == "table entries" and "block_table" in args:
        used = args["indices"].reshape(args["block_table"].shape[0], -1) if phase == "decode" or \
            args["block_table"].shape[0] == rows else args["indices"].reshape(1, -1)
        valid = (used >= 0).nonzero()
        if valid.shape[0]:
            r, c = valid[0].tolist()
            table = args["block_table"].clone()
            table[r if table.shape[0] > 1 else 0, int(used[r, c]) // P] = draw(st.sampled_from([-1, num_slots // P]))
            args["block_table"], args["check_values"], names = table, True, ("block_table",)
    elif mutation == "sm_scale":
        args["sm_scale"], kind = bad_real(draw)
        mutation, names = f"sm_scale {kind}", ("sm_scale",)
    elif mutation == "d_v":
        args["d_v"], kind = bad_int(draw, d_v, huge=False) if draw(st.booleans()) else (D + 1, "D + 1")
        mutation, names = f"d_v {kind}", ("d_v",)
    elif mutation == "nan":  # NaN in q or in a cache row an index names: NaN in, NaN out
        target = draw(st.sampled_from(["q", "kv_cache"]))
        t = args[target]
        if t.numel():
            t.view(-1)[draw(st.integers(0, t.numel() - 1))] = math.nan
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, DECODE_SPEC if phase == "decode" else PREFILL_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"
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
