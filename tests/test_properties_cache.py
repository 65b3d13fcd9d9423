"""Property tests of the paged caches: ``dt.PageAllocator``, ``dt.PagedCache`` (construction, ``append``, ``release``,
``slots``), ``dt.append_tokens`` and ``dt.fp8_quantize_rows`` (:mod:`tests.property_harness`: every generated call
raises a clear error, leaving the cache as it was, or equals the reference). The defects it found are kept below as
explicit tests, each with its reproducer."""
import math

import pytest
import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.cache_reference import append_torch
from dsa_triton.attention.cache_spec import SPEC as APPEND_SPEC

from .property_harness import Case, bad_config, bad_int, bad_tensor, check, exact, generator, run_property

PAGE_SIZES = (16, 32)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- PageAllocator ----------------------------------------------------------------------------------------------
def allocator_state(allocator):
    """The free pages in the order the allocator hands them out (public API only)."""
    return allocator.peek(allocator.num_free)


@st.composite
def allocator_cases(draw):
    """An allocator after a few valid allocations and frees, then one call (maybe with bad arguments); the model is
    a list of free pages in hand-out order."""
    n = draw(st.integers(1, 8))
    allocator, held = dt.PageAllocator(n), []
    for _ in range(draw(st.integers(0, 3))):
        if held and draw(st.booleans()):
            back = held[: draw(st.integers(1, len(held)))]
            allocator.free(back)
            held = held[len(back):]
        else:
            held += allocator.allocate(draw(st.integers(0, allocator.num_free)))
    method = draw(st.sampled_from(["allocate", "peek", "free", "construct"]))
    names = ()
    if method == "construct":
        value, kind = (n, "valid") if draw(st.booleans()) else bad_int(draw, n, huge=False)
        names = () if kind == "valid" else ("num_pages",)
        args = {"num_pages": value}
        return Case("PageAllocator", f"num_pages {kind}", args, lambda: dt.PageAllocator(value), names, lambda: None,
                    lambda out, _: None if allocator_state(out) == list(range(value)) else "not every page free")
    if method in ("allocate", "peek"):
        count, kind = draw(st.integers(0, allocator.num_free)), "valid"
        if draw(st.integers(0, 2)):
            count, kind = bad_int(draw, count) if draw(st.booleans()) else (allocator.num_free + 1, "too many")
            names = ("n",)
        value = count
    else:
        kind = draw(st.sampled_from(["valid", "a free page", "twice", "outside", "float", "bool", "None", "string",
                                     "tensor"]))
        free = allocator_state(allocator)
        value = {"valid": held[:2], "a free page": held[:1] + free[:1], "twice": held[:1] * 2, "outside": [n],
                 "float": [float(p) for p in held[:1]] or [0.0], "bool": [True], "None": None, "string": "0",
                 "tensor": torch.tensor(held[:2], dtype=torch.int64)}[kind]
        names = () if kind in ("valid", "tensor") or (kind == "twice" and not held) else ("pages",)
    before = allocator_state(allocator)

    def reference():
        if method in ("allocate", "peek"):
            taken = before[:value]
            return taken, before[value:] if method == "allocate" else before
        return None, [int(p) for p in value] + before  # (freed pages are handed out first, in their order)

    def compare(out, ref):
        want_out, want_state = ref
        if method in ("allocate", "peek") and out != want_out:
            return f"returned {out}, expected {want_out}"
        state = allocator_state(allocator)
        return None if state == want_state else f"free pages {state}, expected {want_state}"

    return Case(f"PageAllocator.{method}", f"{method} {kind}", {"allocator free": before, "held": held, "arg": value},
                lambda: getattr(allocator, method)(value), names, reference, compare,
                state=lambda: allocator_state(allocator), pure=method == "peek")


def test_page_allocator():
    run_property(allocator_cases(), min_launched=0)


def test_free_none_is_named():
    allocator = dt.PageAllocator(2)
    check(Case("PageAllocator.free", "free None", {"pages": None}, lambda: allocator.free(None), ("pages",),
               state=lambda: allocator_state(allocator)))


# -- PagedCache -------------------------------------------------------------------------------------------------
def _new_cache(draw, **changes):
    kw = {"num_pages": draw(st.integers(1, 6)), "page_size": draw(st.sampled_from(PAGE_SIZES)),
          "max_seqs": draw(st.integers(1, 3)), "max_pages_per_seq": draw(st.sampled_from([None, 1, 2, 4])),
          "kv_dim": draw(st.sampled_from([0, 16, 40])), "index_dim": draw(st.sampled_from([0, 16, 32])),
          "dtype": draw(st.sampled_from(KV_DTYPES)), "device": "cpu", "poison": draw(st.booleans()),
          "summary_dtype": draw(st.sampled_from([torch.bfloat16, torch.float32]))}
    if kw["kv_dim"] + kw["index_dim"] == 0:
        kw["index_dim"] = 16
    kw.update(changes)
    return kw


def cache_state(cache):
    """Everything a raising call must leave as it was (public API only)."""
    return [cache.kv, cache.ik if cache.ik is None else cache.ik.view(torch.uint8), cache.ik_scale, cache.summaries,
            cache.block_table, cache.seq_lens, cache.lengths(), allocator_state(cache.allocator)]


@st.composite
def construct_cases(draw):
    kw = _new_cache(draw)
    mutation = draw(st.sampled_from(["valid", "num_pages", "page_size", "max_seqs", "max_pages_per_seq", "kv_dim",
                                     "index_dim", "both dims 0", "summary_dtype"]))
    names = ()
    if mutation in ("num_pages", "page_size", "max_seqs", "max_pages_per_seq", "kv_dim", "index_dim"):
        kw[mutation], kind = bad_int(draw, kw[mutation] or 1, huge=False) if draw(st.booleans()) or mutation not in (
            "page_size", "kv_dim") else ((24, "24") if mutation == "page_size" else (-16, "-16"))
        if kind == "zero" and mutation in ("kv_dim", "index_dim"):
            kind = "zero (valid: no such cache)"
        names = (mutation, "kv_dim, index_dim") if kw[mutation] != 0 or mutation not in ("kv_dim", "index_dim") \
            else ("kv_dim", "index_dim")
        mutation += f" {kind}"
    elif mutation == "both dims 0":
        kw["kv_dim"] = kw["index_dim"] = 0
        names = ("kv_dim", "index_dim")
    elif mutation == "summary_dtype":
        kw["summary_dtype"] = draw(st.sampled_from([torch.float16, torch.int32, "bfloat16"]))
        names = ("summary_dtype",)

    def compare(cache, _):
        P, n, D, DK = kw["page_size"], kw["num_pages"], kw["kv_dim"], kw["index_dim"]
        width = kw["max_pages_per_seq"] or n
        shapes = [(cache.kv, (n, P, D) if D else None, kw["dtype"]), (cache.ik, (n, P, DK) if DK else None,
                   torch.float8_e4m3fn), (cache.ik_scale, (n, P) if DK else None, torch.float32),
                  (cache.summaries, (n, 2, DK) if DK else None, kw["summary_dtype"]),
                  (cache.block_table, (kw["max_seqs"], width), torch.int32), (cache.seq_lens, (kw["max_seqs"],), torch.int32)]
        for t, shape, dtype in shapes:
            if (t is None) != (shape is None) or (t is not None and (tuple(t.shape) != shape or t.dtype != dtype)):
                return f"a cache tensor is {None if t is None else (t.dtype, tuple(t.shape))}, expected {dtype} {shape}"
        if bool((cache.block_table != -1).any()) or cache.lengths() != [0] * kw["max_seqs"]:
            return "a new cache holds pages or tokens"
        return None if allocator_state(cache.allocator) == list(range(n)) else "not every page free"

    return Case("PagedCache", mutation, kw, lambda: dt.PagedCache(**kw), names, lambda: None, compare)


def test_paged_cache_construction():
    run_property(construct_cases(), min_launched=0)


def test_integer_dtype_poisoned_is_named():
    kw = {"num_pages": 2, "page_size": 16, "kv_dim": 16, "index_dim": 16, "dtype": torch.int32, "device": "cpu",
          "poison": True}
    check(Case("PagedCache", "dtype int32, poison", kw, lambda: dt.PagedCache(**kw), ("dtype",)))


def test_unknown_device_is_named():
    kw = {"num_pages": 2, "page_size": 16, "device": "nowhere"}
    check(Case("PagedCache", "device nowhere", kw, lambda: dt.PagedCache(**kw), ("device",)))


# -- PagedCache.append --------------------------------------------------------------------------------------------------
def _filled_cache(draw, g, **changes):
    """A poisoned cache, and sometimes a first valid append (through the op: the case checks the next call)."""
    kw = _new_cache(draw, poison=True, **changes)
    cache = dt.PagedCache(**kw)
    if draw(st.booleans()):
        seqs = [s for s in range(cache.max_seqs) if draw(st.booleans())]
        capacity = cache.max_pages_per_seq * cache.page_size
        lens, pages = [], cache.allocator.num_free
        for s in seqs:
            n = min(draw(st.integers(0, 40)), capacity, pages * cache.page_size)
            lens.append(n)
            pages -= -(-n // cache.page_size)
        cache.append(seqs, lens, *_tokens(g, cache, sum(lens)), check_values=False)
    return cache


def _tokens(g, cache, n):
    kv = None if cache.kv is None else (torch.randn(n, cache.kv.shape[-1], generator=g) * 3).to(cache.kv.dtype)
    ik = None if cache.ik is None else torch.randn(n, cache.ik.shape[-1], generator=g) * \
        torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())
    return kv, ik


def append_reference(cache, seq_ids, lens, kv, index_k):
    """The cache after the append, from its state before: the allocator's next pages in order, each token at its
    slot, the touched pages' summaries recomputed (:func:`.cache_reference.append_torch`)."""
    P = cache.page_size
    tensors = [None if t is None else t.clone() for t in (cache.kv, cache.ik, cache.ik_scale, cache.summaries)]
    table, lengths, free = cache.block_table.clone(), cache.lengths(), allocator_state(cache.allocator)
    slots, pages, fill = [], [], []
    for s, n in zip(seq_ids, lens):
        start = lengths[s]
        for j in range(-(-start // P), -(-(start + n) // P)):
            table[s, j] = free.pop(0)
        pos = torch.arange(start, start + n)
        slots.append(table[s].long()[pos // P] * P + pos % P)
        for j in range(start // P, -(-(start + n) // P)):
            pages.append(int(table[s, j]))
            fill.append(min(P, start + n - j * P))
        lengths[s] = start + n
    if any(lens):
        append_torch(*tensors, kv, index_k, torch.cat(slots), torch.tensor(pages), torch.tensor(fill))
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return [tensors[0], None if tensors[1] is None else tensors[1].view(torch.uint8), tensors[2], tensors[3], table,
            seq_lens, lengths, free]


def _compare_state(cache):
    def compare(_, expected):
        got = cache_state(cache)
        names = ("kv", "ik", "ik_scale", "summaries", "block_table", "seq_lens", "lengths()", "free pages")
        for name, a, b in zip(names, got, expected):
            if isinstance(a, torch.Tensor):
                problem = exact(a, b)
                if problem:
                    return f"{name}: {problem}"
            elif a != b:
                return f"{name}: {a}, expected {b}"
        return None
    return compare


@st.composite
def append_cases(draw):
    g = generator(draw)
    cache = _filled_cache(draw, g)
    P, capacity = cache.page_size, cache.max_pages_per_seq * cache.page_size
    seq_ids = [s for s in range(cache.max_seqs) if draw(st.booleans())] or [cache.max_seqs - 1]
    room, lens = cache.allocator.num_free * P, []
    for s in seq_ids:
        have = cache.lengths()[s]
        slack = -have % P  # tokens that fit the sequence's last page
        n = min(draw(st.sampled_from([1, 5, 17, 0, 40])), capacity - have, slack + room)
        room -= max(0, -(-(n - slack) // P) * P) if n > slack else 0
        lens.append(n)
    kv, index_k = _tokens(g, cache, sum(lens))
    args = {"seq_ids": seq_ids, "lens": lens, "kv": kv, "index_k": index_k, "check_values": draw(st.booleans())}
    mutation = draw(st.sampled_from(["valid", "seq_ids", "lens", "too long", "kv", "index_k", "parts", "nan",
                                     "config"]))
    names = ()
    if mutation == "seq_ids":
        kind = draw(st.sampled_from(["twice", "outside", "negative", "float", "bool", "mismatch"]))
        args["seq_ids"] = {"twice": seq_ids[:1] * 2, "outside": [cache.max_seqs], "negative": [-1],
                           "float": [0.0], "bool": [True], "mismatch": seq_ids + [cache.max_seqs]}[kind]
        mutation, names = f"seq_ids {kind}", ("seq_ids", "lens", "kv", "index_k", "kv, index_k")
    elif mutation == "lens":
        kind = draw(st.sampled_from(["negative", "float", "bool", "string", "more entries"]))
        args["lens"] = {"negative": [-1] * len(lens), "float": [float(n) for n in lens], "bool": [True] * len(lens),
                        "string": [str(n) for n in lens], "more entries": lens + [1]}[kind]
        mutation, names = f"lens {kind}", ("lens",)
    elif mutation == "too long" and seq_ids:
        args["lens"] = [capacity + 1] + lens[1:]
        names = ("lens",)
    elif mutation in ("kv", "index_k") and args[mutation] is not None:
        args[mutation], kind = draw(bad_tensor(args[mutation], dtypes=(args[mutation].dtype,) if mutation == "kv"
                                               else (torch.float32, torch.bfloat16, torch.float16)))
        mutation, names = f"{mutation} {kind}", ("kv", "index_k", "kv, index_k", "kv_cache", "ik")
    elif mutation == "parts":
        args["kv"], args["index_k"] = (kv if cache.kv is None else None), index_k
        names = ("kv, index_k",)
    elif mutation == "nan" and sum(lens):
        target = draw(st.sampled_from([n for n in ("kv", "index_k") if args[n] is not None]))
        args[target][draw(st.integers(0, sum(lens) - 1)), 0] = draw(st.sampled_from([math.nan, math.inf]))
        names = (target,) if args["check_values"] else ()  # (unchecked: NaN in, NaN out)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, APPEND_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"

    def reference():
        return append_reference(cache, [int(s) for s in args["seq_ids"]], [int(n) for n in args["lens"]],
                                args["kv"], args["index_k"])

    return _stateful_case("PagedCache.append", mutation, args, lambda: cache.append(**args), names, reference,
                          _compare_state(cache), lambda: (args, cache_state(cache)))


def _stateful_case(op, mutation, args, call, names, reference, compare, state):
    """A case whose reference is taken from the state before the call (and only matters if the call succeeds)."""
    expected = {}

    def run():
        try:
            expected["state"] = reference()
        except Exception as error:  # (the arguments are bad: the call must raise; if not, the reference's error shows)
            expected["error"] = error
        return call()

    def after():
        if "error" in expected:
            raise expected["error"]
        return expected["state"]

    return Case(op, mutation, args, run, names, after, compare, state=state, pure=False)


def test_paged_cache_append():
    run_property(append_cases())


# -- PagedCache.release / slots -----------------------------------------------------------------------------------------
@st.composite
def release_cases(draw):
    g = generator(draw)
    cache = _filled_cache(draw, g)
    seq_id, kind = draw(st.integers(0, cache.max_seqs - 1)), "valid"
    if draw(st.integers(0, 2)):
        seq_id, kind = draw(st.sampled_from([(cache.max_seqs, "outside"), (-1, "negative"), (0.0, "float"),
                                             (True, "bool"), (None, "None"), ("0", "string")]))
    names = () if kind == "valid" else ("seq_id",)

    def reference():
        state = cache_state(cache)
        s = int(seq_id)
        pages = [int(p) for p in state[4][s, : -(-state[6][s] // cache.page_size)]]
        state[4], state[5] = state[4].clone(), state[5].clone()
        state[4][s], state[5][s], state[6][s] = -1, 0, 0
        state[7] = pages + state[7]
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in state]

    return _stateful_case("PagedCache.release", f"seq_id {kind}", {"seq_id": seq_id, "lengths": cache.lengths()},
                          lambda: cache.release(seq_id), names, reference, _compare_state(cache),
                          lambda: cache_state(cache))


def test_paged_cache_release():
    run_property(release_cases(), min_launched=0)


@st.composite
def slots_cases(draw):
    g = generator(draw)
    cache = _filled_cache(draw, g)
    seq_id = draw(st.integers(0, cache.max_seqs - 1))
    n = cache.lengths()[seq_id]
    positions = torch.randint(0, max(n, 1), (draw(st.integers(0 if n else 0, 5 if n else 0)),), generator=g)
    args, kind, names = {"seq_id": seq_id, "positions": positions}, "valid", ()
    if draw(st.integers(0, 2)):
        kind = draw(st.sampled_from(["seq_id", "past the length", "negative", "int32", "2-D"]))
        if kind == "seq_id":
            args["seq_id"], names = cache.max_seqs, ("seq_id",)
        elif kind == "past the length":
            args["positions"], names = torch.tensor([n]), ("positions",)
        elif kind == "negative":
            args["positions"], names = torch.tensor([-1]), ("positions",)
        elif kind == "int32":  # any integer dtype
            args["positions"] = positions.int()
        else:
            args["positions"] = positions.view(1, -1)

    def reference():
        table, P = cache.block_table, cache.page_size
        pos = args["positions"].long()
        return table[args["seq_id"]].long()[pos // P] * P + pos % P

    return Case("PagedCache.slots", kind, args, lambda: cache.slots(**args), names, reference, exact,
                state=lambda: (args, cache_state(cache)))


def test_paged_cache_slots():
    run_property(slots_cases(), min_launched=0, min_ok=10)


def test_slots_float_positions_rejected():
    cache = dt.PagedCache(2, 16, 1, kv_dim=16, index_dim=0, device="cpu")
    cache.append([0], [4], torch.zeros(4, 16, dtype=torch.bfloat16), None)
    positions = torch.tensor([1.7])
    check(Case("PagedCache.slots", "float positions", {"positions": positions}, lambda: cache.slots(0, positions),
               ("positions",), lambda: None, lambda out, _: f"accepted: {out.tolist()}"))


def test_slots_list_positions_named():
    cache = dt.PagedCache(2, 16, 1, kv_dim=16, index_dim=0, device="cpu")
    check(Case("PagedCache.slots", "list positions", {}, lambda: cache.slots(0, [0]), ("positions",)))


# -- append_tokens --------------------------------------------------------------------------------------------------
def _page_fill(cache) -> list[int]:
    """Tokens in each physical page (from the block table and the lengths)."""
    fill = [0] * cache.allocator.num_pages
    for s, n in enumerate(cache.lengths()):
        for j in range(-(-n // cache.page_size)):
            fill[int(cache.block_table[s, j])] = min(cache.page_size, n - j * cache.page_size)
    return fill


@st.composite
def append_tokens_cases(draw):
    g = generator(draw)
    cache = _filled_cache(draw, g)
    P, fill = cache.page_size, _page_fill(cache)
    pages = torch.randperm(len(fill), generator=g)[: draw(st.integers(0, 3))].tolist()
    items, row = [], 0
    for p in pages:  # continue the page where it ends, or write it again from slot 0
        first = fill[p] if draw(st.booleans()) else 0
        count = draw(st.integers(0, P - first))
        items.append([row, count, p, first])
        row += count
    kv, index_k = _tokens(g, cache, row)
    args = {"kv_cache": cache.kv, "ik": cache.ik, "ik_scale": cache.ik_scale, "summaries": cache.summaries,
            "kv": kv, "index_k": index_k, "items": torch.tensor(items, dtype=torch.int32).view(-1, 4),
            "check_values": draw(st.booleans())}
    mutation = draw(st.sampled_from(["valid", "items", "item values", "kv", "index_k", "cache tensor", "nan",
                                     "config"]))
    names = ()
    if mutation == "items":
        args["items"], kind = draw(bad_tensor(args["items"], dtypes=(torch.int32,)))
        mutation, names = f"items {kind}", ("items",)
    elif mutation == "item values" and items:
        bad, (i, col) = [list(it) for it in items], (draw(st.integers(0, len(items) - 1)), draw(st.integers(0, 4)))
        if col == 4:  # a page twice
            bad.append([0, 0, bad[i][2], 0])
        else:
            bad[i][col] = draw(st.sampled_from([-1, {0: row + 1, 1: P + 1, 2: len(fill), 3: P}[col]]))
        args["items"], args["check_values"] = torch.tensor(bad, dtype=torch.int32), True  # (unchecked: a promise)
        names = ("items",)
    elif mutation in ("kv", "index_k") and args[mutation] is not None:
        args[mutation], kind = draw(bad_tensor(args[mutation], dtypes=(args[mutation].dtype,) if mutation == "kv"
                                               else (torch.float32, torch.bfloat16, torch.float16)))
        mutation, names = f"{mutation} {kind}", ("kv", "index_k")
    elif mutation == "cache tensor":
        name = draw(st.sampled_from([n for n in ("kv_cache", "ik", "ik_scale", "summaries") if args[n] is not None]))
        dtypes = {"kv_cache": (args["kv_cache"].dtype if args["kv_cache"] is not None else None,),
                  "ik": (torch.float8_e4m3fn,), "ik_scale": (torch.float32,),
                  "summaries": (torch.bfloat16, torch.float32)}[name]
        args[name], kind = draw(bad_tensor(args[name], dtypes=dtypes))
        mutation, names = f"{name} {kind}", ("kv_cache", "ik", "ik_scale", "summaries", "kv", "index_k")
    elif mutation == "nan" and row:
        target = draw(st.sampled_from([n for n in ("kv", "index_k") if args[n] is not None]))
        args[target][draw(st.integers(0, row - 1)), 0] = draw(st.sampled_from([math.nan, -math.inf]))
        names = (target,) if args["check_values"] else ()  # (unchecked: NaN in, NaN out)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, APPEND_SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"

    def reference():
        tensors = [None if args[n] is None else args[n].clone() for n in ("kv_cache", "ik", "ik_scale", "summaries")]
        its = args["items"].long()
        if its.numel():
            src, count, page, first = its.unbind(1)
            slots = torch.cat([torch.arange(f, f + c) + p * P for c, p, f in zip(count.tolist(), page.tolist(),
                                                                                 first.tolist())])
            append_torch(*tensors, args["kv"], args["index_k"], slots, page, first + count)
        return tensors

    def compare(_, expected):
        got = [args[n] for n in ("kv_cache", "ik", "ik_scale", "summaries")]
        return exact([t for t in got if t is not None], [t for t in expected if t is not None])

    return _stateful_case("append_tokens", mutation, args, lambda: dt.append_tokens(**args), names, reference, compare,
                          lambda: args)


def test_append_tokens():
    run_property(append_tokens_cases())


# -- fp8_quantize_rows ----------------------------------------------------------------------------------------------
def quantize_rows_oracle(x: torch.Tensor):
    """Row by row in float64: scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, NaN for a row with a NaN or an inf."""
    rows = x.double().reshape(-1, x.shape[-1]) if x.shape[-1] else x.double().reshape(-1, 0)
    scales = []
    for row in rows:
        amax = max(row.abs().max().item() if row.numel() else 0.0, 1e-4)
        scales.append(math.nan if not math.isfinite(amax) else 2.0 ** math.ceil(math.log2(amax / 448)))
    scale = torch.tensor(scales, dtype=torch.float64).reshape(x.shape[:-1])
    return (x.double() / scale[..., None]).float().to(torch.float8_e4m3fn), scale.float()


@st.composite
def quantize_rows_cases(draw):
    g = generator(draw)
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=2))) + (draw(st.sampled_from([1, 16, 48])),)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,), generator=g).float())
    x = x.to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    if x.numel() and draw(st.booleans()):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, 0.0, 1e-6]))
    args, kind, names = {"x": x}, "valid", ()
    if draw(st.integers(0, 2)) == 0:
        args["x"], kind = draw(bad_tensor(x, dtypes=(torch.float32, torch.bfloat16, torch.float16), shape_ok=True))
        names = ("x",)
    return Case("fp8_quantize_rows", kind, args, lambda: dt.fp8_quantize_rows(**args), names,
                lambda: quantize_rows_oracle(args["x"]), exact)


def test_fp8_quantize_rows():
    run_property(quantize_rows_cases(), min_launched=0)


@pytest.mark.parametrize("x", [None, [[1.0, 2.0]]])
def test_quantize_rows_not_a_tensor_is_named(x):
    check(Case("fp8_quantize_rows", "not a tensor", {"x": x}, lambda: dt.fp8_quantize_rows(x), ("x",)))


@pytest.mark.parametrize("x", [torch.zeros(2, 0), torch.tensor(1.0)])
def test_quantize_rows_degenerate_shapes(x):
    check(Case("fp8_quantize_rows", "degenerate shape", {"x": x}, lambda: dt.fp8_quantize_rows(x), ("x",),
               lambda: None, lambda out, _: None if out[0].shape == x.shape else f"x8 of shape {tuple(out[0].shape)}"))
