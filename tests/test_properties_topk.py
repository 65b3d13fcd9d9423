"""Property tests of ``dt.topk_indices``: every generated call raises a clear error or equals the reference
(:mod:`tests.property_harness`). Valid calls run the kernels in the interpreter (at most 2 rows: about 0.2 s each)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.topk_indices_reference import check_topk, topk_indices_torch
from dsa_triton.attention.topk_indices_spec import SPEC

from .property_harness import (Case, choice_arg, config_arg, element, generator, int_arg, mutate, one_of, run_property,
                               tensor_arg)

I32 = (torch.int32,)
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
    P, seqs = args.get("page_size"), args["block_table"].shape[0] if "block_table" in args else 0
    expanded = torch.full((T + 1, k), -7, dtype=torch.int32).narrow(0, 0, 1).expand(T, k) if T > 1 else None

    def new_lengths(args):
        return torch.randint(0, L + 1, (T,), generator=g, dtype=torch.int32)

    def table_entries(draw, args):  # the first row's first page: -1, negative, or past num_pages
        if not T:
            return None
        limit = args.get("num_pages", 2**31 // P)  # (2**31 with pages of 1: no int32 reaches it)
        args["block_table"][int(args["row_to_seq"][0]) if "row_to_seq" in args else 0, 0] = draw(st.sampled_from(
            [-1, -5] + ([limit] if limit < 2**31 else [])))
        return "", ("block_table",)

    def stray(draw, args):  # table arguments without a table
        for name in ("block_table", "row_to_seq", "num_pages"):
            args.pop(name, None)
        args["page_size"], args["row_to_seq"] = 16, torch.zeros(T, dtype=torch.int32)
        return "", ("page_size", "row_to_seq", "num_pages")

    mutation, names = mutate(draw, args, {
        "valid": None,
        "scores": tensor_arg("scores", (torch.float32,), ("scores", "lengths", "out", "row_to_seq", "block_table")),
        # any value is valid: the property is the reference's ranking
        "scores values": choice_arg("scores", [torch.full((T, L), v) for v in (math.nan, math.inf, -math.inf, 0.0)],
                                    ()),
        "k": int_arg("k", names=("k", "out"), special=((0, "0"), (4097, "4097"), (L + 3, "k > L"))),
        "lengths": tensor_arg("lengths", I32, like=new_lengths),
        "lengths values": element("lengths", [-1, L + 1, -2**31, 2**31 - 1], like=new_lengths),
        "block_table": tensor_arg("block_table", I32, ("block_table", "row_to_seq")),
        "table entries": table_entries,
        "page_size": int_arg("page_size", names=("page_size", "block_table"),  # (larger: a valid size, other slots)
                             special=((P * 4, "larger"),) if P else ()),
        "row_to_seq": one_of(element("row_to_seq", [-1, seqs]), tensor_arg("row_to_seq", I32)),
        "num_pages": int_arg("num_pages", args.get("num_pages", 4), ("num_pages", "block_table")),
        "out": tensor_arg("out", I32, like=lambda args: torch.full((T, k), -7, dtype=torch.int32),
                          none=(expanded, "expanded (one row for all)")),
        "config": config_arg(SPEC), "stray": stray}, mutation)
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
