"""Property tests of the MXFP4 ops and the FP8 workspace: ``dt.mxfp4_quantize``, ``dt.mxfp4_dequantize``,
``dt.mxfp4_to_fp8``, ``dt.FP8Workspace`` (:mod:`tests.property_harness`: every generated call raises a clear error
or equals the reference)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch
from dsa_triton.moe.mxfp4_spec import DEQUANTIZE, QUANTIZE, random_mxfp4
from dsa_triton.moe.mxfp4_to_fp8_reference import fp8_conversion_torch
from dsa_triton.moe.mxfp4_to_fp8_spec import SPEC as CONVERT
from dsa_triton.moe.mxfp4_to_fp8_spec import compare_conversion

from .property_harness import Case, all_slots_free, bad_config, bad_int, bad_real, bad_tensor, exact, generator, run_property

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _lead(draw) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, 2), max_size=2)))


def _mxfp4(draw, g, lead, n, kb):
    blocks = torch.randint(0, 256, (*lead, n, kb, 16), generator=g, dtype=torch.uint8)
    base = draw(st.sampled_from([127, 120, 60, 200]))
    spread = draw(st.sampled_from([0, 2, 20]))
    scales = (base + torch.randint(-spread, spread + 1, (*lead, n, kb), generator=g)).clamp(0, 254).to(torch.uint8)
    return blocks, scales


# -- mxfp4_quantize ------------------------------------------------------------------------------------------
@st.composite
def quantize_cases(draw):
    g = generator(draw)
    mutation = draw(st.sampled_from(["valid", "w", "w values", "K", "config"]))
    lead, n, kb = _lead(draw), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(WEIGHT_DTYPES))
    top = 12 if dtype == torch.float16 else 40  # finite in the dtype
    w = torch.randn(*lead, n, 32 * kb, generator=g) * torch.exp2(torch.randint(-30, top, (*lead, n, 1), generator=g))
    w = w.to(dtype)
    if w.numel() and draw(st.booleans()):  # exact ties of E2M1, zeros, negative zeros
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.0, 6.0, 7.0]) * 2.0 ** draw(st.integers(-9, 9))
        flat = w.view(-1)
        flat[: ties.numel()] = ties[: flat.numel()].to(w.dtype)
    args, names = {"w": w}, ()
    if mutation == "w":
        args["w"], kind = draw(bad_tensor(w, dtypes=WEIGHT_DTYPES))
        mutation, names = f"w {kind}", ("w",)
    elif mutation == "w values" and w.numel():
        w.view(-1)[draw(st.integers(0, w.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        names = ("w",)
    elif mutation == "K":
        args["w"] = w[..., : draw(st.integers(1, 31))].clone()
        names = ("w",)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, QUANTIZE)
        mutation += f" {kind}"
    else:
        mutation = "valid"
    return Case("mxfp4_quantize", mutation, args, lambda: dt.mxfp4_quantize(**args), names,
                lambda: mxfp4_quantize_torch(args["w"]), exact)


def test_mxfp4_quantize():
    run_property(quantize_cases())


# -- mxfp4_dequantize ----------------------------------------------------------------------------------------
@st.composite
def dequantize_cases(draw):
    g = generator(draw)
    mutation = draw(st.sampled_from(["valid", "blocks", "scales", "nan scale", "dtype", "name", "config"]))
    lead, n, kb = _lead(draw), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    blocks, scales = _mxfp4(draw, g, lead, n, kb)
    args = {"blocks": blocks, "scales": scales, "dtype": draw(st.sampled_from(WEIGHT_DTYPES))}
    names = ()
    if draw(st.booleans()):
        args["name"] = "gate_up"
    label = args.get("name", "mxfp4")
    if mutation == "blocks":
        args["blocks"], kind = draw(bad_tensor(blocks, dtypes=(torch.uint8,)))
        mutation, names = f"blocks {kind}", (f"{label}_blocks", f"{label}_scales")
    elif mutation == "scales":
        args["scales"], kind = draw(bad_tensor(scales, dtypes=(torch.uint8,)))
        mutation, names = f"scales {kind}", (f"{label}_scales",)
    elif mutation == "nan scale" and scales.numel():
        scales.view(-1)[draw(st.integers(0, scales.numel() - 1))] = 0xFF
        names = (f"{label}_scales",)
    elif mutation == "dtype":
        args["dtype"] = draw(st.sampled_from([torch.int32, torch.float64, torch.uint8, torch.float8_e4m3fn,
                                              "float32", None]))
        names = ("dtype",)
    elif mutation == "name":
        args["name"] = draw(st.sampled_from([3, None, ""]))
        mutation = f"name {args['name']!r}"  # any label: errors only read it
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, DEQUANTIZE)
        mutation += f" {kind}"
    else:
        mutation = "valid"
    return _dequantize_case(mutation, args, names)


def _dequantize_case(mutation, args, names):
    return Case("mxfp4_dequantize", mutation, args, lambda: dt.mxfp4_dequantize(**args), names,
                lambda: mxfp4_dequantize_torch(args["blocks"], args["scales"], args["dtype"]), exact)


# found by this test: a config that is not a dict raised a TypeError from dict() that named nothing
CONFIG_INT = _dequantize_case("config an int", {"blocks": torch.zeros(1, 1, 16, dtype=torch.uint8),
                                                "scales": torch.full((1, 1), 127, dtype=torch.uint8),
                                                "dtype": torch.float32, "config": 7}, ("config",))


def test_mxfp4_dequantize():
    run_property(dequantize_cases(), examples=[CONFIG_INT])


# -- mxfp4_to_fp8 --------------------------------------------------------------------------------------------
@st.composite
def conversion_cases(draw):
    g = generator(draw)
    mutation = draw(st.sampled_from(["valid", "blocks", "scales", "nan scale", "out", "out part", "config"]))
    lead, n, kb = _lead(draw), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    blocks, scales = _mxfp4(draw, g, lead, n, kb)
    if scales.numel() and draw(st.booleans()):  # blocks far below their group's top: unfit, counted
        low = torch.rand(scales.shape, generator=g) < 0.3
        scales = torch.where(low, scales.int() - 30, scales.int()).clamp(0, 254).to(torch.uint8)
    args, names = {"blocks": blocks, "scales": scales}, ()
    k, groups = 32 * kb, -(-kb // 4)
    if draw(st.booleans()) or mutation in ("out", "out part"):
        w = torch.full((*lead, n, k), 1.0).to(torch.float8_e4m3fn)
        s = torch.full((*lead, n, groups), -1.0)
        if draw(st.booleans()):
            s = s.transpose(-1, -2).contiguous().transpose(-1, -2)  # group-major, as workspace leases are
        args["out"] = (w, s)
    if mutation == "blocks":
        args["blocks"], kind = draw(bad_tensor(blocks, dtypes=(torch.uint8,)))
        mutation, names = f"blocks {kind}", ("mxfp4_blocks", "mxfp4_scales")
    elif mutation == "scales":
        args["scales"], kind = draw(bad_tensor(scales, dtypes=(torch.uint8,)))
        mutation, names = f"scales {kind}", ("mxfp4_scales", "mxfp4_blocks")
    elif mutation == "nan scale" and scales.numel():
        scales.view(-1)[draw(st.integers(0, scales.numel() - 1))] = 0xFF
        names = ("mxfp4_scales",)
    elif mutation == "out":
        args["out"], kind = draw(st.sampled_from([(None, "None"), (args["out"][:1], "one tensor"),
                                                  (list(args["out"]), "a list"), (args["out"] * 2, "four"),
                                                  (args["out"][0], "a tensor")]))
        mutation, names = f"out {kind}", ("out",)
    elif mutation == "out part":
        part = draw(st.integers(0, 1))
        bad, kind = draw(bad_tensor(args["out"][part], dtypes=(args["out"][part].dtype,)))
        args["out"] = (bad, args["out"][1]) if part == 0 else (args["out"][0], bad)
        mutation, names = f"out[{part}] {kind}", (f"out[{part}]", "out")
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, CONVERT)
        mutation += f" {kind}"
    else:
        mutation = "valid"

    def compare(out, expected):
        if isinstance(args.get("out"), (tuple, list)) and (out[0] is not args["out"][0] or out[1] is not args["out"][1]):
            return "out: given tensors, others returned"
        return compare_conversion(out, expected)

    given = isinstance(args.get("out"), (tuple, list))
    return Case("mxfp4_to_fp8", mutation, args, lambda: dt.mxfp4_to_fp8(**args), names,
                lambda: fp8_conversion_torch(args["blocks"], args["scales"]), compare, pure=not given)


def test_mxfp4_to_fp8():
    run_property(conversion_cases())


# -- FP8Workspace ---------------------------------------------------------------------------------------------
@st.composite
def workspace_cases(draw):
    """Construct (maybe with bad arguments), then lease (maybe badly) and take views (maybe too large)."""
    mutation = draw(st.sampled_from(["valid", "slots", "shapes", "device", "count", "timeout", "views"]))
    slots = draw(st.integers(1, 4))
    shapes = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=3))
    count = draw(st.integers(1, slots))
    timeout = draw(st.sampled_from([None, 0, 0.5]))
    n, k = draw(st.sampled_from(shapes))
    if draw(st.booleans()):
        n, k = draw(st.integers(1, n)), draw(st.integers(1, k))
    args = {"slots": slots, "shapes": shapes, "device": "cpu", "count": count, "timeout": timeout, "n": n, "k": k}
    names = ()
    if mutation == "slots":
        args["slots"], kind = bad_int(draw, slots, huge=False)
        mutation, names = f"slots {kind}", ("slots",)
    elif mutation == "shapes":
        args["shapes"], kind = draw(st.sampled_from([
            ([], "empty"), ([(4, 0)], "a zero"), ([(4.0, 32)], "a float"), ([(True, 32)], "a bool"),
            ([(4, 32, 1)], "a triple"), ([4, 32], "not pairs"), (None, "None"), ([(-4, 32)], "negative"),
            ([(4, "32")], "a string")]))
        mutation, names = f"shapes {kind}", ("shapes",)
    elif mutation == "device":
        args["device"] = draw(st.sampled_from(["nowhere", 3.5, None]))
        names = ("device",)
    elif mutation == "count":
        args["count"], kind = draw(st.sampled_from([(0, "0"), (slots + 1, "too many"), (1.0, "float"),
                                                    (True, "bool"), (None, "None"), ("1", "string")]))
        mutation, names = f"count {kind}", ("count",)
    elif mutation == "timeout":
        args["timeout"], kind = bad_real(draw) if draw(st.booleans()) else (-1, "negative")
        mutation, names = f"timeout {kind}", ("timeout",)
        if kind in ("inf", "None"):  # no limit: a valid wait (the slots are free)
            names = ()
    elif mutation == "views":
        args["n"], args["k"] = draw(st.sampled_from([(n * 1000, k), (0, k), (-1, k), (n, -k), (n + 0.5, k),
                                                     (None, k), (n, 1 << 40)]))
        names = ("n", "k", "views")
    else:
        mutation = "valid"
    return _workspace_case(mutation, args, names)


def _workspace_case(mutation, args, names):
    state = {}

    def call():
        ws = dt.FP8Workspace(args["slots"], args["shapes"], args["device"])
        state["ws"] = ws
        with ws.acquire(args["count"], args["timeout"]) as lease:
            assert not all_slots_free(ws)  # leased while inside
            w, s = lease.views(args["n"], args["k"])
            return ws, lease.first, lease.count, w, s

    def reference():
        return None

    def compare(out, _):
        ws, first, leased, w, s = out
        want = tuple(sorted(set(args["shapes"])))
        if ws.slots != args["slots"] or ws.shapes != want:
            return f"slots {ws.slots}, shapes {ws.shapes}; expected {args['slots']}, {want}"
        if leased != args["count"] or not 0 <= first <= ws.slots - leased:
            return f"lease of slots {first}..{first + leased - 1}, asked for {args['count']}"
        n, k = args["n"], args["k"]
        if w.shape != (leased, n, k) or w.dtype != torch.float8_e4m3fn or s.shape != (leased, n, -(-k // 128)):
            return f"views {tuple(w.shape)}, {tuple(s.shape)} for [{n}, {k}]"
        return None if all_slots_free(ws) else "slots still busy after the lease ended"

    def watched():  # a raise inside the lease must still release it
        return [state.get("ws") is None or all_slots_free(state["ws"])]

    return Case("FP8Workspace", mutation, args, call, names, reference, compare, state=watched)


# found by this test: a device name torch does not know (RuntimeError) and a negative views size (wrong views)
_WORKSPACE = {"slots": 1, "shapes": [(1, 1)], "device": "cpu", "count": 1, "timeout": None, "n": 1, "k": 1}
BAD_DEVICE = _workspace_case("device", {**_WORKSPACE, "device": "nowhere"}, ("device",))
NEGATIVE_VIEW = _workspace_case("views", {**_WORKSPACE, "n": -1}, ("n", "k", "views"))


def test_fp8_workspace():
    run_property(workspace_cases(), examples=[BAD_DEVICE, NEGATIVE_VIEW], min_launched=0)
