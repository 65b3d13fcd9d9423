"""Property tests of the indexer ops: ``dt.indexer_logits``, ``dt.block_scores``, ``dt.select_pages``,
``dt.selected_page_logits``, ``dt.block_indexer_logits`` (:mod:`tests.property_harness`: every generated call raises a
clear error or equals the reference)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.block_indexer_logits_reference import gather_selected_torch, page_bounds_torch, page_summaries_torch
from dsa_triton.attention.block_indexer_logits_spec import SPEC as PATH_SPEC
from dsa_triton.attention.formats import fp8_quantize_rows
from dsa_triton.attention.indexer_logits_reference import indexer_logits_torch
from dsa_triton.attention.indexer_logits_spec import SPEC as LOGITS_SPEC
from dsa_triton.attention.indexer_logits_spec import compare_logits, random_queries
from dsa_triton.attention.select_pages_reference import select_pages_torch
from dsa_triton.attention.select_pages_spec import SPEC as SELECT_SPEC

from .property_harness import (Case, checked, config_arg, element, generator, int_arg, mutate, nan_split, one_of,
                               run_property, tensor_arg)

I32 = (torch.int32,)
SUMMARY_DTYPES = (torch.bfloat16, torch.float32)
BOUNDS = ("pmax", "pmin")


def _problem(draw, g, paged: bool, rows_min: int = 0, most: int = 3):
    """Query rows (up to ``most`` a sequence) of 1-3 sequences over FP8 keys, paged on shuffled pages (NaN in every
    slot no sequence owns) or contiguous; limits at most each sequence's length."""
    B = draw(st.integers(1, 3))
    rows = [draw(st.integers(rows_min, most)) for _ in range(B)]
    lens = [draw(st.integers(0, 40)) for _ in range(B)]
    T, H, DK = sum(rows), draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([16, 32, 48]))
    q, w = random_queries(T, H, DK, g)
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(rows))
    lens_t = torch.tensor(lens)
    limits = (torch.rand(T, generator=g) * (lens_t[seq] + 1)).floor().int() if T else torch.zeros(0, dtype=torch.int32)
    cu = torch.tensor([0] + rows).cumsum(0).int()
    p = {"q": q, "weights": w, "limits": limits, "cu_seqlens_q": cu if B > 1 or draw(st.booleans()) else None,
         "B": B, "lens": lens, "rows": rows}
    if paged:
        P = draw(st.sampled_from([16, 32]))
        pages = [-(-n // P) for n in lens]
        width = max(pages + [1]) + draw(st.integers(0, 1))
        num_pages = sum(pages) + 1
        k8, scale = fp8_quantize_rows(torch.randn(num_pages * P, DK, generator=g))
        order = torch.randperm(num_pages, generator=g).tolist()
        table = torch.full((B + draw(st.integers(0, 1)), width), -1, dtype=torch.int32)
        for b, n in enumerate(pages):
            table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        k, k_scale = k8.view(num_pages, P, DK), scale.view(num_pages, P)
        seq_lens = torch.tensor(lens + [0] * (table.shape[0] - B), dtype=torch.int32)
        used = torch.zeros(num_pages * P, dtype=torch.bool)
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            used[table[b].long()[pos // P] * P + pos % P] = True
        k.view(-1, DK).view(torch.uint8)[~used] = 0x7F  # poison: never read
        k_scale.view(-1)[~used] = math.nan
        p.update(k=k, k_scale=k_scale, block_table=table, seq_lens=seq_lens, P=P)
    else:
        S = sum(lens) + draw(st.integers(0, 2))
        k, k_scale = fp8_quantize_rows(torch.randn(S, DK, generator=g))
        p.update(k=k, k_scale=k_scale, key_starts=torch.tensor([0] + lens[:-1]).cumsum(0).int() if B > 1 or
                 draw(st.booleans()) else None)
    return p


def _common_mutations(p) -> dict:
    """Mutations the indexer ops share, of the arguments :func:`_problem` makes."""
    T = p["q"].shape[0]
    cu = p["cu_seqlens_q"] if p["cu_seqlens_q"] is not None else torch.tensor([0, T], dtype=torch.int32)
    cu_names = ("cu_seqlens_q", "max_q", "block_table", "seq_lens", "key_starts", "limits")

    def cu_values(draw, args):  # one offset off by one
        bad = cu.clone()
        bad[draw(st.integers(0, bad.numel() - 1))] += draw(st.sampled_from([-1, 1]))
        args["cu_seqlens_q"] = bad
        return "values", cu_names

    return {"q": tensor_arg("q", (torch.float8_e4m3fn,), ("q", "weights", "limits", "k", "pmax", "cu_seqlens_q",
                                                          "pages")),
            "weights": tensor_arg("weights", (torch.float32,)), "limits": tensor_arg("limits", I32),
            "limit values": checked(element("limits", [-1, max(p["lens"]) + 1, 2**31 - 1], ("limits", "max_len"))),
            # (unchecked, cu_seqlens_q and max_q: a broken promise)
            "cu_seqlens_q": checked(one_of(tensor_arg("cu_seqlens_q", I32, cu_names, like=lambda args: cu), cu_values)),
            "max_q": checked(int_arg("max_q", max(p["rows"]), special=((max(p["rows"]) - 1, "too small"),),
                                     allow_none=True))}


# NaN goes in a weight, a key scale or a page bound (not checked: NaN in, NaN out); never in a byte of q or k, which
# the interpreter reads as 480
NAN = (math.nan,)


# -- indexer_logits ---------------------------------------------------------------------------------------------
LOGITS_MUTATIONS = ["valid", "q", "weights", "limits", "limit values", "cu_seqlens_q", "max_q", "k", "k_scale",
                    "block_table", "table entries", "seq_lens", "key_starts", "num_cols", "nan", "config"]


@st.composite
def logits_cases(draw):
    g = generator(draw)
    mutation = draw(st.sampled_from(LOGITS_MUTATIONS))
    paged = draw(st.booleans()) if mutation not in ("block_table", "table entries", "seq_lens", "key_starts") \
        else mutation != "key_starts"
    p = _problem(draw, g, paged)
    args = {k: p[k] for k in ("q", "weights", "k", "k_scale", "limits", "cu_seqlens_q")}
    if paged:
        args.update(block_table=p["block_table"], seq_lens=p["seq_lens"])
    else:
        args["key_starts"] = p["key_starts"]
    args["check_values"] = draw(st.booleans())
    if draw(st.booleans()) or not args["check_values"]:
        args["num_cols"] = draw(st.sampled_from([max(p["lens"]), max(p["lens"]) + 3, max(p["lens"]) // 2, 0]))
    if draw(st.booleans()) or not args["check_values"]:
        args["max_q"] = max(p["rows"]) + draw(st.integers(0, 1))
    S, capacity = p["k"].shape[0], p["block_table"].shape[1] * p["P"] if paged else 0
    starts = torch.zeros(p["B"], dtype=torch.int32) if paged or p["key_starts"] is None else p["key_starts"]
    seq_names, start_names = ("seq_lens", "limits"), ("key_starts", "limits")

    def table_entries(draw, args):  # a used entry of a sequence's table: -1, or past the cache
        if not any(p["lens"]):
            return None
        b = next(b for b, n in enumerate(p["lens"]) if n)
        table = p["block_table"].clone()
        table[b, draw(st.integers(0, (p["lens"][b] - 1) // p["P"]))] = draw(st.sampled_from([-1, S]))
        args["block_table"] = table
        return "", ("block_table",)

    mutation, names = mutate(draw, args, {
        "valid": None, **_common_mutations(p),
        "k": tensor_arg("k", (torch.float8_e4m3fn,), ("k", "k_scale", "block_table", "key_starts", "limits")),
        "k_scale": tensor_arg("k_scale", (torch.float32,)),
        "block_table": tensor_arg("block_table", I32, ("block_table", "seq_lens", "key_starts", "k")),
        "table entries": checked(table_entries),
        "seq_lens": one_of(tensor_arg("seq_lens", I32, seq_names),
                           checked(element("seq_lens", [-1, capacity + 1], seq_names))),
        "key_starts": one_of(tensor_arg("key_starts", I32, start_names, like=lambda args: starts),
                             checked(element("key_starts", [-1, S + 1, S], start_names, like=lambda args: starts))),
        "num_cols": int_arg("num_cols", 8, allow_none=True),
        "nan": element(("weights", "k_scale"), NAN, ()), "config": config_arg(LOGITS_SPEC)}, mutation)
    return _logits_case(mutation, args, names)


def _logits_case(mutation, args, names):
    def reference():
        limits = args["limits"]
        width = args.get("num_cols")
        width = (int(limits.max()) if limits.numel() else 0) if width is None else width
        return indexer_logits_torch(args["q"], args["weights"], args["k"], args["k_scale"], limits, width,
                                    cu_seqlens_q=args["cu_seqlens_q"], block_table=args.get("block_table"),
                                    key_starts=args.get("key_starts"))

    def compare(out, ref):
        problem, out, ref = nan_split(out, ref)
        return problem or compare_logits(out, ref)

    return Case("indexer_logits", mutation, args, lambda: dt.indexer_logits(**args), names, reference, compare)


def _one_head_expanded():
    """Found by this test: one head whose stride is below DK (never read) was rejected as overlapping heads."""
    p = _one_key_problem()
    q = p["q"][:, :1].contiguous()
    q = q.view(torch.uint8).as_strided((3, 1, 16), (16, 0, 1)).view(torch.float8_e4m3fn)
    args = {"q": q, "weights": p["weights"][:, :1].contiguous(), "k": p["k"], "k_scale": p["k_scale"],
            "limits": p["limits"], "cu_seqlens_q": p["cu_seqlens_q"], "block_table": p["block_table"],
            "seq_lens": p["seq_lens"]}
    return _logits_case("valid: one head of stride 0", args, ())


def test_indexer_logits():
    run_property(logits_cases(), examples=[_one_head_expanded()])


# -- block_scores ---------------------------------------------------------------------------------------------------
def _summaries(p):
    s = page_summaries_torch(p["k"], p["k_scale"], p["block_table"], p["seq_lens"]).to(torch.bfloat16)
    return s[:, 0], s[:, 1]


@st.composite
def bound_cases(draw):
    g = generator(draw)
    p = _problem(draw, g, True)
    pmax, pmin = _summaries(p)
    args = {k: p[k] for k in ("q", "weights")}
    args.update(pmax=pmax, pmin=pmin, block_table=p["block_table"], seq_lens=p["seq_lens"], limits=p["limits"],
                page_size=p["P"], cu_seqlens_q=p["cu_seqlens_q"], check_values=draw(st.booleans()))
    if draw(st.booleans()) or not args["check_values"]:
        args["num_cols"] = -(-max(p["lens"]) // p["P"]) + draw(st.integers(-1, 1)) if max(p["lens"]) else 0
    if draw(st.booleans()) or not args["check_values"]:
        args["max_q"] = max(p["rows"])
    mutation, names = mutate(draw, args, {
        "valid": None, **_common_mutations(p), "pmax": tensor_arg("pmax", SUMMARY_DTYPES, BOUNDS),
        "pmin": tensor_arg("pmin", SUMMARY_DTYPES, BOUNDS), "page_size": int_arg("page_size", special=((48, "48"),)),
        "block_table": tensor_arg("block_table", I32, ("block_table", "seq_lens")),
        "nan": element(("weights", "pmax"), NAN, ()), "config": config_arg(PATH_SPEC)})

    def reference():
        limits, P = args["limits"], args["page_size"]
        width = args.get("num_cols")
        width = (-(-int(limits.max()) // P) if limits.numel() else 0) if width is None else width
        return page_bounds_torch(args["q"], args["weights"], args["pmax"], args["pmin"], args["block_table"], limits,
                                 P, width, args["cu_seqlens_q"])

    def compare(out, ref):
        problem, out, ref = nan_split(out, ref)
        return problem or compare_logits(out, ref, rtol=1e-5)

    return Case("block_scores", mutation, args, lambda: dt.block_scores(**args), names, reference, compare)


def test_block_scores():
    run_property(bound_cases())


# -- select_pages ---------------------------------------------------------------------------------------------------
@st.composite
def select_cases(draw):
    g = generator(draw)
    T, n_pages = draw(st.integers(0, 2)), draw(st.integers(0, 12))
    bounds = torch.randn(T, n_pages, generator=g)
    if T * n_pages and draw(st.booleans()):  # ties, infinities, NaN: NaN ranks as -inf, never taken
        values = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0])
        special = torch.rand(T, n_pages, generator=g) < 0.4
        bounds = torch.where(special, values[torch.randint(0, 6, (T, n_pages), generator=g)], bounds)
    args = {"bounds": bounds, "n_select": draw(st.integers(1, 14))}
    mutation, names = mutate(draw, args, {
        "bounds": tensor_arg("bounds", (torch.float32,)),
        "n_select": int_arg("n_select", 3),  # (2**31: past int32, a ValueError)
        "config": config_arg(SELECT_SPEC), "valid": None})  # (valid last: the least drawn)
    return Case("select_pages", mutation, args, lambda: dt.select_pages(**args), names,
                lambda: select_pages_torch(args["bounds"], args["n_select"]),
                lambda out, ref: SELECT_SPEC.compare((out, args["bounds"]), (ref, None)))


def test_select_pages():
    run_property(select_cases())


# -- selected_page_logits ---------------------------------------------------------------------------------------------
def _pages(draw, g, p, n_sel):
    """``[T, n_sel]`` logical pages of each row's sequence (-1 padded), distinct and ascending as select_pages gives."""
    T, P = p["q"].shape[0], p["P"]
    seq = torch.repeat_interleave(torch.arange(p["B"]), torch.tensor(p["rows"]))
    pages = torch.full((T, n_sel), -1, dtype=torch.int32)
    for t in range(T):
        n = -(-p["lens"][int(seq[t])] // P)
        chosen = torch.randperm(n, generator=g)[: draw(st.integers(0, min(n, n_sel)))].sort().values
        pages[t, : chosen.numel()] = chosen.int()
    return pages


@st.composite
def selected_cases(draw):
    g = generator(draw)
    p = _problem(draw, g, True)
    args = {k: p[k] for k in ("q", "weights", "k", "k_scale", "block_table", "seq_lens", "limits")}
    args["pages"] = _pages(draw, g, p, draw(st.integers(1, 3)))
    args.update(cu_seqlens_q=p["cu_seqlens_q"], check_values=draw(st.booleans()))
    if draw(st.booleans()) or not args["check_values"]:
        args["max_q"] = max(p["rows"])
    mutation, names = mutate(draw, args, {
        "valid": None, **_common_mutations(p),
        "k": tensor_arg("k", (torch.float8_e4m3fn,), ("k", "k_scale", "block_table")),
        "pages": tensor_arg("pages", I32),
        "page values": checked(element("pages", [-2, p["block_table"].shape[1], 2**31 - 1])),
        "nan": element(("weights", "k_scale"), NAN, ()), "config": config_arg(PATH_SPEC)})

    def reference():
        limits = args["limits"]
        dense = indexer_logits_torch(args["q"], args["weights"], args["k"], args["k_scale"], limits,
                                     int(limits.max()) if limits.numel() else 0, cu_seqlens_q=args["cu_seqlens_q"],
                                     block_table=args["block_table"])
        return gather_selected_torch(dense, args["pages"], args["k"].shape[1], limits)

    def compare(out, ref):
        (logits, positions), (ref_logits, ref_positions) = out, ref
        if not torch.equal(positions, ref_positions):
            return "positions differ from the reference"
        problem, logits, ref_logits = nan_split(logits, ref_logits)
        return problem or compare_logits(logits, ref_logits)

    return Case("selected_page_logits", mutation, args, lambda: dt.selected_page_logits(**args), names, reference,
                compare)


def test_selected_page_logits():
    run_property(selected_cases())


# -- block_indexer_logits ---------------------------------------------------------------------------------------------
@st.composite
def path_cases(draw):
    g = generator(draw)
    p = _problem(draw, g, True, rows_min=1, most=2)  # (page selection: about 0.05 s a row in the interpreter)
    pmax, pmin = _summaries(p)
    args = {k: p[k] for k in ("q", "weights", "k", "k_scale")}
    args.update(pmax=pmax, pmin=pmin, block_table=p["block_table"], seq_lens=p["seq_lens"], limits=p["limits"],
                n_select=draw(st.integers(1, 4)), cu_seqlens_q=p["cu_seqlens_q"], check_values=draw(st.booleans()),
                return_bounds=True)
    if draw(st.booleans()) or not args["check_values"]:
        args["max_len"] = max(p["lens"] + [1]) + draw(st.integers(0, 20))
    if draw(st.booleans()) or not args["check_values"]:
        args["max_q"] = max(p["rows"])
    common = _common_mutations(p)
    del common["weights"]
    mutation, names = mutate(draw, args, {
        **common, "pmax": tensor_arg("pmax", SUMMARY_DTYPES, BOUNDS), "n_select": int_arg("n_select", 2),
        "max_len": checked(int_arg("max_len", 8, special=((1, "below a limit"),))),
        "config": config_arg(PATH_SPEC), "valid": None})  # (valid last: the least drawn, 3 launches)
    return _path_case(mutation, args, names)


def _path_case(mutation, args, names):
    def reference():
        limits, P = args["limits"], args["k"].shape[1]
        width = int(limits.max()) if limits.numel() else 0
        n_pages = -(-(args.get("max_len") or width) // P)
        bounds = page_bounds_torch(args["q"], args["weights"], args["pmax"], args["pmin"], args["block_table"], limits,
                                   P, n_pages, args["cu_seqlens_q"])
        dense = indexer_logits_torch(args["q"], args["weights"], args["k"], args["k_scale"], limits, width,
                                     cu_seqlens_q=args["cu_seqlens_q"], block_table=args["block_table"])
        return bounds, dense, args["n_select"], P, limits

    def compare(out, ref):
        logits, positions, bounds = out
        return PATH_SPEC.compare((bounds, logits, positions), ref)

    return Case("block_indexer_logits", mutation, args, lambda: dt.block_indexer_logits(**args), names, reference,
                compare)


def _one_key_problem():
    """Three one-row sequences, only the last holding a key (on page 1 of 2)."""
    g = torch.Generator().manual_seed(0)
    q, w = random_queries(3, 4, 16, g)
    k8, scale = fp8_quantize_rows(torch.randn(32, 16, generator=g))
    p = {"q": q, "weights": w, "k": k8.view(2, 16, 16), "k_scale": scale.view(2, 16),
         "block_table": torch.tensor([[-1], [-1], [1]], dtype=torch.int32),
         "seq_lens": torch.tensor([0, 0, 1], dtype=torch.int32), "limits": torch.tensor([0, 0, 1], dtype=torch.int32),
         "cu_seqlens_q": torch.tensor([0, 1, 2, 3], dtype=torch.int32)}
    p["pmax"], p["pmin"] = _summaries({**p, "lens": [0, 0, 1]})
    return p


# found by this test: the path's comparison scattered a -1 entry onto page 0, unmarking the page chosen there
PAGE_ZERO = _path_case("valid: page 0 and a -1", {**_one_key_problem(), "n_select": 2, "check_values": True,
                                                  "return_bounds": True}, ())


def test_block_indexer_logits():
    run_property(path_cases(), examples=[PAGE_ZERO])
