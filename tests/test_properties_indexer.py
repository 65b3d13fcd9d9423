"""Property tests of the indexer ops: ``dt.indexer_logits``, ``dt.block_scores``, ``dt.select_pages``,
``dt.selected_page_logits``, ``dt.block_indexer_logits`` (:mod:`tests.property_harness`: every generated call raises a
clear error or equals the reference)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.block_scores_reference import gather_selected_torch, page_bounds_torch, page_summaries_torch
from dsa_triton.attention.block_scores_spec import SPEC as PATH_SPEC
from dsa_triton.attention.cache_reference import fp8_quantize_rows
from dsa_triton.attention.indexer_reference import indexer_logits_torch
from dsa_triton.attention.indexer_spec import SPEC as LOGITS_SPEC
from dsa_triton.attention.indexer_spec import compare_logits, random_queries
from dsa_triton.attention.page_select_reference import select_pages_torch
from dsa_triton.attention.page_select_spec import SPEC as SELECT_SPEC

from .property_harness import Case, bad_config, bad_int, bad_tensor, generator, nan_split, run_property

I32 = (torch.int32,)


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


def _nan_values(draw, p, names=("weights", "k_scale")):
    """A NaN in a weight or a key scale (not checked: NaN in, NaN out); never in a byte of ``q`` or ``k``, which the
    interpreter reads as 480."""
    t = p[draw(st.sampled_from(names))]
    if t.numel():
        t[torch.unravel_index(torch.tensor(draw(st.integers(0, t.numel() - 1))), t.shape)] = math.nan


def _common_mutation(draw, mutation, p, args, g):
    """Mutations the indexer ops share; returns ``(mutation, names)`` or None when ``mutation`` is not one."""
    T = p["q"].shape[0]
    if mutation == "q":
        args["q"], kind = draw(bad_tensor(p["q"], dtypes=(torch.float8_e4m3fn,)))
        return f"q {kind}", ("q", "weights", "limits", "k", "pmax", "cu_seqlens_q", "pages")
    if mutation == "weights":
        args["weights"], kind = draw(bad_tensor(p["weights"], dtypes=(torch.float32,)))
        return f"weights {kind}", ("weights",)
    if mutation == "limits":
        args["limits"], kind = draw(bad_tensor(p["limits"], dtypes=I32))
        return f"limits {kind}", ("limits",)
    if mutation == "limit values" and T:
        limits = p["limits"].clone()
        limits[draw(st.integers(0, T - 1))] = draw(st.sampled_from([-1, max(p["lens"]) + 1, 2**31 - 1]))
        args["limits"], args["check_values"] = limits, True
        return "limit values", ("limits", "max_len")
    if mutation == "cu_seqlens_q":
        cu = p["cu_seqlens_q"] if p["cu_seqlens_q"] is not None else torch.tensor([0, T], dtype=torch.int32)
        if draw(st.booleans()):
            args["cu_seqlens_q"], kind = draw(bad_tensor(cu, dtypes=I32))
        else:
            bad = cu.clone()
            bad[draw(st.integers(0, bad.numel() - 1))] += draw(st.sampled_from([-1, 1]))
            args["cu_seqlens_q"], kind = bad, "values"
        args["check_values"] = True  # (unchecked: a broken promise)
        return f"cu_seqlens_q {kind}", ("cu_seqlens_q", "max_q", "block_table", "seq_lens", "key_starts", "limits")
    if mutation == "max_q":
        if draw(st.booleans()):
            args["max_q"], kind = bad_int(draw, max(p["rows"]), allow_none=True)
        else:
            args["max_q"], kind = max(p["rows"]) - 1, "too small"
        args["check_values"] = True  # (unchecked: a broken promise)
        return f"max_q {kind}", ("max_q",)
    return None


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
    names = ()
    common = _common_mutation(draw, mutation, p, args, g)
    if common:
        mutation, names = common
    elif mutation == "k":
        args["k"], kind = draw(bad_tensor(p["k"], dtypes=(torch.float8_e4m3fn,)))
        mutation, names = f"k {kind}", ("k", "k_scale", "block_table", "key_starts", "limits")
    elif mutation == "k_scale":
        args["k_scale"], kind = draw(bad_tensor(p["k_scale"], dtypes=(torch.float32,)))
        mutation, names = f"k_scale {kind}", ("k_scale",)
    elif mutation == "block_table":
        args["block_table"], kind = draw(bad_tensor(p["block_table"], dtypes=I32))
        mutation, names = f"block_table {kind}", ("block_table", "seq_lens", "key_starts", "k")
    elif mutation == "table entries" and any(p["lens"]):
        b = next(b for b, n in enumerate(p["lens"]) if n)
        table = p["block_table"].clone()
        table[b, draw(st.integers(0, (p["lens"][b] - 1) // p["P"]))] = draw(st.sampled_from([-1, p["k"].shape[0]]))
        args["block_table"], args["check_values"], names = table, True, ("block_table",)
    elif mutation == "seq_lens":
        if draw(st.booleans()):
            args["seq_lens"], kind = draw(bad_tensor(p["seq_lens"], dtypes=I32))
        else:
            bad = p["seq_lens"].clone()
            bad[draw(st.integers(0, p["B"] - 1))] = draw(st.sampled_from([-1, p["block_table"].shape[1] * p["P"] + 1]))
            args["seq_lens"], args["check_values"], kind = bad, True, "values"
        mutation, names = f"seq_lens {kind}", ("seq_lens", "limits")
    elif mutation == "key_starts":
        starts = p["key_starts"] if p["key_starts"] is not None else torch.zeros(p["B"], dtype=torch.int32)
        if draw(st.booleans()):
            args["key_starts"], kind = draw(bad_tensor(starts, dtypes=I32))
        else:
            bad = starts.clone()
            bad[draw(st.integers(0, p["B"] - 1))] = draw(st.sampled_from([-1, p["k"].shape[0] + 1,
                                                                          p["k"].shape[0]]))
            args["key_starts"], args["check_values"], kind = bad, True, "values"
        mutation, names = f"key_starts {kind}", ("key_starts", "limits")
    elif mutation == "num_cols":
        args["num_cols"], kind = bad_int(draw, 8, allow_none=True, huge=False)
        mutation, names = f"num_cols {kind}", ("num_cols",)
    elif mutation == "nan":
        _nan_values(draw, p)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, LOGITS_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"
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
    mutation = draw(st.sampled_from(["valid", "q", "weights", "limits", "limit values", "cu_seqlens_q", "max_q",
                                     "pmax", "pmin", "page_size", "block_table", "nan", "config"]))
    names = ()
    common = _common_mutation(draw, mutation, p, args, g)
    if common:
        mutation, names = common
    elif mutation in ("pmax", "pmin"):
        args[mutation], kind = draw(bad_tensor(args[mutation], dtypes=(torch.bfloat16, torch.float32)))
        mutation, names = f"{mutation} {kind}", ("pmax", "pmin")
    elif mutation == "page_size":
        args["page_size"], kind = bad_int(draw, p["P"]) if draw(st.booleans()) else (48, "48")
        mutation, names = f"page_size {kind}", ("page_size",)
    elif mutation == "block_table":
        args["block_table"], kind = draw(bad_tensor(p["block_table"], dtypes=I32))
        mutation, names = f"block_table {kind}", ("block_table", "seq_lens")
    elif mutation == "nan":
        _nan_values(draw, {**p, "pmax": pmax}, ("weights", "pmax"))
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, PATH_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"

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
    mutation = draw(st.sampled_from(["bounds", "n_select", "config", "valid"]))  # (valid last: the least drawn)
    names = ()
    if mutation == "bounds":
        args["bounds"], kind = draw(bad_tensor(bounds, dtypes=(torch.float32,)))
        mutation, names = f"bounds {kind}", ("bounds",)
    elif mutation == "n_select":
        args["n_select"], kind = bad_int(draw, 3, huge=False)  # (2**31 columns: a valid, endless call)
        mutation, names = f"n_select {kind}", ("n_select",)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, SELECT_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"
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
    mutation = draw(st.sampled_from(["valid", "q", "weights", "limits", "limit values", "cu_seqlens_q", "max_q",
                                     "k", "pages", "page values", "nan", "config"]))
    names = ()
    common = _common_mutation(draw, mutation, p, args, g)
    if common:
        mutation, names = common
    elif mutation == "k":
        args["k"], kind = draw(bad_tensor(p["k"], dtypes=(torch.float8_e4m3fn,)))
        mutation, names = f"k {kind}", ("k", "k_scale", "block_table")
    elif mutation == "pages":
        args["pages"], kind = draw(bad_tensor(args["pages"], dtypes=I32))
        mutation, names = f"pages {kind}", ("pages",)
    elif mutation == "page values" and args["pages"].numel():
        args["pages"].view(-1)[draw(st.integers(0, args["pages"].numel() - 1))] = draw(st.sampled_from(
            [-2, p["block_table"].shape[1], 2**31 - 1]))
        args["check_values"], names = True, ("pages",)
    elif mutation == "nan":
        _nan_values(draw, p)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, PATH_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"

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
    mutation = draw(st.sampled_from(["q", "limits", "limit values", "cu_seqlens_q", "max_q", "pmax", "n_select",
                                     "max_len", "config", "valid"]))  # (valid last: the least drawn, 3 launches)
    names = ()
    common = _common_mutation(draw, mutation, p, args, g)
    if common:
        mutation, names = common
    elif mutation == "pmax":
        args["pmax"], kind = draw(bad_tensor(pmax, dtypes=(torch.bfloat16, torch.float32)))
        mutation, names = f"pmax {kind}", ("pmax", "pmin")
    elif mutation == "n_select":
        args["n_select"], kind = bad_int(draw, 2, huge=False)
        mutation, names = f"n_select {kind}", ("n_select",)
    elif mutation == "max_len":
        args["max_len"], kind = bad_int(draw, 8, huge=False) if draw(st.booleans()) else (1, "below a limit")
        args["check_values"] = True
        mutation, names = f"max_len {kind}", ("max_len",)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, PATH_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"
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
