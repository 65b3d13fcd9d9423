"""Property tests of ``dt.topk_indices``: every generated call raises a clear error or equals the reference
(:mod:`tests.property_harness`). Valid calls run the kernels in the interpreter (at most 2 rows: about 0.2 s each)."""
import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.topk_reference import check_topk, topk_indices_torch
from dsa_triton.attention.topk_spec import SPEC

from .property_harness import Case, bad_config, bad_int, bad_tensor, generator, run_property

MUTATIONS = ["scores", "valid", "scores values", "k", "lengths", "lengths values", "block_table",
             "table entries", "page_size", "row_to_seq", "num_pages", "out", "config", "stray"]


def _special_scores(draw, g, T, L):
    scores = torch.randn(T, L, generator=g)
    if T * L and draw(st.booleans()):  # ties, infinities and NaN of either sign
        values = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
        picks = torch.randint(0, values.numel(), (T, L), generator=g)
        scores = torch.where(torch.rand(T, L, generator=g) < 0.3, values[picks], scores)
    return scores


@st.composite
def topk_cases(draw):
    g = generator(draw)
    mutation = draw(st.sampled_from(MUTATIONS))
    T = draw(st.sampled_from([1, 2, 0]))
    L, k = draw(st.integers(1, 48)), draw(st.integers(1, 20))
    args = {"scores": _special_scores(draw, g, T, L), "k": k}
    if draw(st.booleans()):
        args["lengths"] = torch.randint(0, L + 1, (T,), generator=g, dtype=torch.int32)
    if draw(st.booleans()) or mutation in ("block_table", "table entries", "page_size", "row_to_seq", "num_pages"):
        P = draw(st.sampled_from([1, 3, 16]))
        pages = -(-L // P) + draw(st.integers(0, 1))
        seqs = max(T, 1) + draw(st.integers(0, 1))
        args["block_table"] = torch.randperm(seqs * pages + 2, generator=g)[: seqs * pages].view(seqs, pages).int()
        args["page_size"] = P
        if draw(st.booleans()) or mutation == "row_to_seq":
            args["row_to_seq"] = torch.randint(0, seqs, (T,), generator=g, dtype=torch.int32)
        if draw(st.booleans()):
            args["num_pages"] = seqs * pages + 2
    if draw(st.booleans()):
        args["out"] = torch.full((T, k), -7, dtype=torch.int32)
    args["check_values"] = draw(st.booleans()) if mutation == "valid" else True
    names = ()
    if mutation == "scores":
        args["scores"], kind = draw(bad_tensor(args["scores"], dtypes=(torch.float32,)))
        mutation += f" {kind}"
        names = ("scores", "lengths", "out", "row_to_seq", "block_table")
    elif mutation == "scores values" and T * L:  # any value is valid: the property is the reference's ranking
        args["scores"] = torch.full((T, L), float(draw(st.sampled_from(["nan", "inf", "-inf", "0"]))))
    elif mutation == "k":
        args["k"], kind = draw(st.sampled_from([(0, "0"), (4097, "4097"), (L + 3, "k > L")])) if draw(
            st.booleans()) else bad_int(draw, k)
        mutation += f" {kind}"
        names = ("k", "out")
    elif mutation == "lengths":
        args["lengths"], kind = draw(bad_tensor(torch.randint(0, L + 1, (T,), generator=g, dtype=torch.int32),
                                                dtypes=(torch.int32,)))
        mutation += f" {kind}"
        names = ("lengths",)
    elif mutation == "lengths values" and T:
        lengths = torch.randint(0, L + 1, (T,), generator=g, dtype=torch.int32)
        lengths[draw(st.integers(0, T - 1))] = draw(st.sampled_from([-1, L + 1, -2**31, 2**31 - 1]))
        args["lengths"] = lengths
        names = ("lengths",)
    elif mutation == "block_table" and "block_table" in args:
        args["block_table"], kind = draw(bad_tensor(args["block_table"], dtypes=(torch.int32,)))
        mutation += f" {kind}"
        names = ("block_table", "row_to_seq")
    elif mutation == "table entries" and T:
        table = args["block_table"]
        row = int(args["row_to_seq"][0]) if "row_to_seq" in args else 0
        limit = args.get("num_pages", 2**31 // args["page_size"])  # (2**31 with pages of 1: no int32 reaches it)
        table[row, 0] = draw(st.sampled_from([-1, -5] + ([limit] if limit < 2**31 else [])))
        names = ("block_table",)
    elif mutation == "page_size":
        if draw(st.booleans()):
            args["page_size"], kind = bad_int(draw, args["page_size"])
        else:
            args["page_size"], kind = args["page_size"] * 4, "larger"  # a valid size: other slots
        mutation += f" {kind}"
        names = ("page_size", "block_table")
    elif mutation == "row_to_seq" and "row_to_seq" in args:
        if T and draw(st.booleans()):
            args["row_to_seq"][0] = draw(st.sampled_from([-1, args["block_table"].shape[0]]))
            kind = "out of range"
        else:
            args["row_to_seq"], kind = draw(bad_tensor(args["row_to_seq"], dtypes=(torch.int32,)))
        mutation += f" {kind}"
        names = ("row_to_seq",)
    elif mutation == "num_pages":
        args["num_pages"], kind = bad_int(draw, args.get("num_pages", 4))
        mutation += f" {kind}"
        names = ("num_pages", "block_table")
    elif mutation == "out":
        args["out"], kind = draw(bad_tensor(torch.full((T, k), -7, dtype=torch.int32), dtypes=(torch.int32,)))
        if kind == "None":
            args["out"] = torch.full((T + 1, k), -7, dtype=torch.int32).narrow(0, 0, 1).expand(T, k) if T > 1 else None
            kind = "expanded (one row for all)"
        mutation += f" {kind}"
        names = ("out",)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, SPEC)
        mutation += f" {kind}"
    elif mutation == "stray":  # table arguments without a table
        for name in ("block_table", "row_to_seq", "num_pages"):
            args.pop(name, None)
        args["page_size"], args["row_to_seq"] = 16, torch.zeros(T, dtype=torch.int32)
        names = ("page_size", "row_to_seq", "num_pages")
    else:
        mutation = "valid"
    return _case(mutation, args, names)


def _case(mutation, args, names):
    kwargs = {k: v for k, v in args.items() if k not in ("scores", "k")}
    table = {k: args.get(k) for k in ("block_table", "page_size", "row_to_seq")}

    def call():
        return dt.topk_indices(args["scores"], args["k"], **kwargs)

    def reference():
        return topk_indices_torch(args["scores"], args["k"], args.get("lengths"), **table)

    def compare(out, expected):
        given = args.get("out")
        if isinstance(given, torch.Tensor) and out is not given:
            return "out: a tensor was given, another returned"
        return check_topk(out, expected, args["scores"], args["k"], args.get("lengths"), **table)

    return Case("topk_indices", mutation, args, call, names, reference, compare, pure=not isinstance(args.get("out"), torch.Tensor))


# found by this test: a table entry was compared with 2**31 (the limit at page size 1) in int32, which wraps
PAGE_SIZE_ONE = _case("valid: page size 1", {"scores": torch.tensor([[1.5]]), "k": 1,
                                              "block_table": torch.tensor([[1]], dtype=torch.int32), "page_size": 1}, ())


def test_topk_indices():
    run_property(topk_cases(), examples=[PAGE_SIZE_ONE])
