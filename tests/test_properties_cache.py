"""Property tests of the paged caches: ``dt.PageAllocator``, ``dt.PagedCache`` (construction, ``append``, ``release``,
``slots``), ``dt.append_tokens`` and ``dt.fp8_quantize_rows`` (:mod:`tests.property_harness`: every generated call
raises a clear error, leaving the cache as it was, or equals the reference)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.attention.append_tokens_reference import append_torch
from dsa_triton.attention.append_tokens_spec import SPEC as APPEND_SPEC

from .property_harness import (Case, checked, choice_arg, config_arg, element, exact, generator, int_arg, mutate,
                               one_of, rejecting, run_property, tensor_arg)

PAGE_SIZES = (16, 32)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # of latent rows, new keys, rows to quantize
INTEGERS = (torch.int32, torch.int64, torch.uint8, torch.int8)


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
    if method == "construct":
        args = {"num_pages": n}
        mutation, names = mutate(draw, args, {"valid": None, "num_pages": int_arg("num_pages")})
        value = args["num_pages"]
        return Case("PageAllocator", mutation, args, lambda: dt.PageAllocator(value), names, lambda: None,
                    lambda out, _: None if allocator_state(out) == list(range(value)) else "not every page free")
    if method in ("allocate", "peek"):
        args = {"n": draw(st.integers(0, allocator.num_free))}
        mutation, names = mutate(draw, args, {"valid": None, "n": int_arg("n", special=((allocator.num_free + 1,
                                                                                         "too many"),))})
        value = args["n"]
    else:
        free = allocator_state(allocator)
        args = {"pages": held[:2]}
        mutation, names = mutate(draw, args, {
            "valid": None, "tensor": choice_arg("pages", [torch.tensor(held[:2], dtype=torch.int64)], names=()),
            "pages": choice_arg("pages", [held[:1] + free[:1], held[:1] * 2, [n], [float(p) for p in held[:1]] or [0.0],
                                          [True], None, "0", {0}, torch.tensor(held[:2], dtype=torch.float32)])})
        value = args["pages"]
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

    return Case(f"PageAllocator.{method}", mutation, {"allocator free": before, "held": held, "arg": value},
                lambda: getattr(allocator, method)(value), names, reference, compare,
                state=lambda: allocator_state(allocator), pure=method == "peek")


def _free_none():
    """Found by this test: ``free(None)`` iterated None before any check (a TypeError naming nothing)."""
    allocator = dt.PageAllocator(2)
    return Case("PageAllocator.free", "free None", {"pages": None}, lambda: allocator.free(None), ("pages",),
                lambda: None, lambda out, _: "accepted None", state=lambda: allocator_state(allocator))


def test_page_allocator():
    run_property(allocator_cases(), examples=[_free_none()], min_launched=0)


# -- PagedCache -------------------------------------------------------------------------------------------------
def _new_cache(draw, **changes):
    kw = {"num_pages": draw(st.integers(1, 6)), "page_size": draw(st.sampled_from(PAGE_SIZES)),
          "max_seqs": draw(st.integers(1, 3)), "max_pages_per_seq": draw(st.sampled_from([None, 1, 2, 4])),
          "kv_dim": draw(st.sampled_from([0, 16, 40])), "index_dim": draw(st.sampled_from([0, 16, 32])),
          "dtype": draw(st.sampled_from(FLOATS)), "device": "cpu", "poison": draw(st.booleans()),
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

    def both_dims_zero(draw, args):
        args["kv_dim"] = args["index_dim"] = 0
        return "", ("kv_dim", "index_dim")

    mutation, names = mutate(draw, kw, {
        "valid": None, "num_pages": int_arg("num_pages"),
        "page_size": int_arg("page_size", special=((24, "24"),)),
        "max_seqs": int_arg("max_seqs"),
        "max_pages_per_seq": int_arg("max_pages_per_seq", kw["max_pages_per_seq"] or 1),
        "kv_dim": int_arg("kv_dim", kw["kv_dim"] or 1, special=((-16, "-16"),)),  # (0: no such cache)
        "index_dim": int_arg("index_dim", kw["index_dim"] or 1),
        "both dims 0": both_dims_zero,
        "summary_dtype": choice_arg("summary_dtype", [torch.float16, torch.int32, "bfloat16"]),
        "dtype": choice_arg("dtype", [torch.int32, torch.uint8, torch.float64, torch.float8_e4m3fn, "bfloat16"]),
        "device": choice_arg("device", ["nowhere", 3.5, "cuda:99"])})
    return _construct_case(mutation, kw, names)


def _construct_case(mutation, kw, names):
    def compare(cache, _):
        if kw["dtype"] not in FLOATS or str(cache.device) != str(kw["device"]):
            return f"a cache of {cache.device} accepted for dtype {kw['dtype']!r}, device {kw['device']!r}"
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


# found by this test: an integer dtype with poison=True raised a RuntimeError from filling NaN into it, and a device
# name torch does not know a RuntimeError from torch.device, neither naming the argument
INT_POISONED = _construct_case("dtype int32, poison", {"num_pages": 2, "page_size": 16, "kv_dim": 16, "index_dim": 16,
                                                       "dtype": torch.int32, "device": "cpu", "poison": True},
                               ("dtype",))
UNKNOWN_DEVICE = _construct_case("device nowhere", {"num_pages": 2, "page_size": 16, "dtype": torch.bfloat16,
                                                    "device": "nowhere"}, ("device",))


def test_paged_cache_construction():
    run_property(construct_cases(), examples=[INT_POISONED, UNKNOWN_DEVICE], min_launched=0)


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
    slot, the touched pages' summaries recomputed (:func:`.append_tokens_reference.append_torch`)."""
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
    tensor_names = ("kv", "index_k", "kv, index_k", "kv_cache", "ik")

    def parts(draw, args):  # the part the cache does not hold, or not the one it does
        args["kv"], args["index_k"] = (kv if cache.kv is None else None), index_k
        return "", ("kv, index_k",)

    mutation, names = mutate(draw, args, {
        "valid": None,
        "seq_ids": choice_arg("seq_ids", [seq_ids[:1] * 2, [cache.max_seqs], [-1], [0.0], [True], None,
                                          seq_ids + [cache.max_seqs]], ("seq_ids", "lens", *tensor_names[:3])),
        "lens": choice_arg("lens", [[-1] * len(lens), [float(n) for n in lens], [True] * len(lens),
                                    [str(n) for n in lens], lens + [1], None]),
        "too long": choice_arg("lens", [[capacity + 1] + lens[1:]]),
        "kv": tensor_arg("kv", () if kv is None else (kv.dtype,), tensor_names),
        "index_k": tensor_arg("index_k", FLOATS, tensor_names),
        "parts": parts,
        "nan": element(("kv", "index_k"), [math.nan, math.inf], if_checked=True),  # (unchecked: NaN in, NaN out)
        "config": config_arg(APPEND_SPEC)})

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
    args = {"seq_id": draw(st.integers(0, cache.max_seqs - 1))}
    mutation, names = mutate(draw, args, {"valid": None, "seq_id": _seq_id_arg(cache)})
    seq_id = args["seq_id"]

    def reference():
        state = cache_state(cache)
        s = int(seq_id)
        pages = [int(p) for p in state[4][s, : -(-state[6][s] // cache.page_size)]]
        state[4], state[5] = state[4].clone(), state[5].clone()
        state[4][s], state[5][s], state[6][s] = -1, 0, 0
        state[7] = pages + state[7]
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in state]

    return _stateful_case("PagedCache.release", mutation, {"seq_id": seq_id, "lengths": cache.lengths()},
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
    args = {"seq_id": seq_id, "positions": positions}
    mutation, names = mutate(draw, args, {
        "valid": None, "seq_id": _seq_id_arg(cache),
        "positions": tensor_arg("positions", INTEGERS),  # (any integer dtype, shape and layout)
        "outside": choice_arg("positions", [torch.tensor([n]), torch.tensor([-1])])})
    return _slots_case(cache, mutation, args, names)


def _slots_case(cache, mutation, args, names):
    def reference():
        table, P = cache.block_table, cache.page_size
        pos = args["positions"]
        if pos.is_floating_point() or pos.dtype == torch.bool:
            return None  # (not an index: the call must raise)
        return table[args["seq_id"]].long()[pos.long() // P] * P + pos.long() % P

    return Case("PagedCache.slots", mutation, args, lambda: cache.slots(**args), names, reference,
                rejecting(exact),
                state=lambda: (args, cache_state(cache)))


def _seq_id_arg(cache):
    """A sequence id made bad: outside ``[0, max_seqs)``, or not an integer."""
    return int_arg("seq_id", special=((cache.max_seqs, "outside"),))


def test_paged_cache_slots():
    run_property(slots_cases(), examples=[FLOAT_POSITIONS, LIST_POSITIONS], min_launched=0, min_ok=10)


def _four_tokens():
    cache = dt.PagedCache(2, 16, 1, kv_dim=16, index_dim=0, device="cpu")
    cache.append([0], [4], torch.zeros(4, 16, dtype=torch.bfloat16), None)
    return cache


# found by this test: float positions were truncated to integers (1.7 read slot 1's: a silent wrong answer), and a
# list of positions raised an AttributeError
FLOAT_POSITIONS = _slots_case(_four_tokens(), "float positions", {"seq_id": 0, "positions": torch.tensor([1.7])},
                              ("positions",))
LIST_POSITIONS = _slots_case(_four_tokens(), "list positions", {"seq_id": 0, "positions": [1]}, ("positions",))


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

    def item_values(draw, args):  # an item's rows, count, page or first slot out of range, or a page twice
        if not items:
            return None
        bad, (i, col) = [list(it) for it in items], (draw(st.integers(0, len(items) - 1)), draw(st.integers(0, 4)))
        if col == 4:
            bad.append([0, 0, bad[i][2], 0])
        else:
            bad[i][col] = draw(st.sampled_from([-1, {0: row + 1, 1: P + 1, 2: len(fill), 3: P}[col]]))
        args["items"] = torch.tensor(bad, dtype=torch.int32)
        return f"column {col}", ("items",)

    cache_names = ("kv_cache", "ik", "ik_scale", "summaries", "kv", "index_k")
    mutation, names = mutate(draw, args, {
        "valid": None, "items": tensor_arg("items", (torch.int32,)),
        "item values": checked(item_values),  # (unchecked: a promise)
        "kv": tensor_arg("kv", () if kv is None else (kv.dtype,), ("kv", "index_k")),
        "index_k": tensor_arg("index_k", FLOATS, ("kv", "index_k")),
        "cache tensor": one_of(*[tensor_arg(name, dtypes, cache_names) for name, dtypes in (
            ("kv_cache", () if cache.kv is None else (cache.kv.dtype,)), ("ik", (torch.float8_e4m3fn,)),
            ("ik_scale", (torch.float32,)), ("summaries", (torch.bfloat16, torch.float32)))]),
        "nan": element(("kv", "index_k"), [math.nan, -math.inf], if_checked=True),  # (unchecked: NaN in, NaN out)
        "config": config_arg(APPEND_SPEC)})

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
    """Row by row in float64: scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, NaN for a row with a NaN or an inf;
    None for what is not rows of floating-point values (the op must reject it)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return None
    rows = x.double().reshape(math.prod(x.shape[:-1]), x.shape[-1])
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
    args = {"x": x}
    mutation, names = mutate(draw, args, {"valid": None, "x": tensor_arg("x", FLOATS)})
    return _quantize_rows_case(mutation, args["x"], names)  # (a float64, fp8, strided or empty row: valid too)


def _quantize_rows_case(mutation, x, names):
    return Case("fp8_quantize_rows", mutation, {"x": x}, lambda: dt.fp8_quantize_rows(x), names,
                lambda: quantize_rows_oracle(x), rejecting(exact))


# found by this test: a list or None raised an AttributeError, rows of no value an IndexError (amax over an empty
# dimension), and a 0-d tensor came back as one row of one value
DEGENERATE_ROWS = [_quantize_rows_case(kind, x, ("x",)) for kind, x in (
    ("None", None), ("list", [[1.0, 2.0]]), ("rows of 0 values", torch.zeros(2, 0)), ("0-d", torch.tensor(1.0)))]


def test_fp8_quantize_rows():
    run_property(quantize_rows_cases(), examples=DEGENERATE_ROWS, min_launched=0)
