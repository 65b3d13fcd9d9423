"""Property tests of the MXFP4 ops and the FP8 workspace: ``dt.mxfp4_quantize``, ``dt.mxfp4_dequantize``,
``dt.mxfp4_to_fp8``, ``dt.FP8Workspace`` (:mod:`tests.property_harness`: every generated call raises a clear error
or equals the reference)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch
from dsa_triton.moe.mxfp4_spec import DEQUANTIZE, QUANTIZE
from dsa_triton.moe.mxfp4_to_fp8_reference import fp8_conversion_torch
from dsa_triton.moe.mxfp4_to_fp8_spec import SPEC as CONVERT
from dsa_triton.moe.mxfp4_to_fp8_spec import compare_conversion

from .property_harness import (Case, all_slots_free, bad_tensor, choice_arg, config_arg, element, exact, generator,
                               int_arg, mutate, real_arg, run_property, tensor_arg)

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
    lead, n, kb = _lead(draw), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(WEIGHT_DTYPES))
    top = 12 if dtype == torch.float16 else 40  # finite in the dtype
    w = torch.randn(*lead, n, 32 * kb, generator=g) * torch.exp2(torch.randint(-30, top, (*lead, n, 1), generator=g))
    w = w.to(dtype)
    if w.numel() and draw(st.booleans()):  # exact ties of E2M1, zeros, negative zeros
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.0, 6.0, 7.0]) * 2.0 ** draw(st.integers(-9, 9))
        flat = w.view(-1)
        flat[: ties.numel()] = ties[: flat.numel()].to(w.dtype)
    args = {"w": w}

    def short_k(draw, args):  # K not a multiple of 32
        args["w"] = w[..., : draw(st.integers(1, 31))].clone()
        return "", ("w",)

    mutation, names = mutate(draw, args, {
        "valid": None, "w": tensor_arg("w", WEIGHT_DTYPES), "w values": element("w", [math.nan, math.inf, -math.inf]),
        "K": short_k, "config": config_arg(QUANTIZE)})
    return Case("mxfp4_quantize", mutation, args, lambda: dt.mxfp4_quantize(**args), names,
                lambda: mxfp4_quantize_torch(args["w"]), exact)


def test_mxfp4_quantize():
    run_property(quantize_cases())


# -- mxfp4_dequantize ----------------------------------------------------------------------------------------
@st.composite
def dequantize_cases(draw):
    g = generator(draw)
    lead, n, kb = _lead(draw), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    blocks, scales = _mxfp4(draw, g, lead, n, kb)
    args = {"blocks": blocks, "scales": scales, "dtype": draw(st.sampled_from(WEIGHT_DTYPES))}
    if draw(st.booleans()):
        args["name"] = "gate_up"
    label = args.get("name", "mxfp4")
    mutation, names = mutate(draw, args, {
        "valid": None, "blocks": tensor_arg("blocks", (torch.uint8,), (f"{label}_blocks", f"{label}_scales")),
        "scales": tensor_arg("scales", (torch.uint8,), (f"{label}_scales",)),
        "nan scale": element("scales", [0xFF], (f"{label}_scales",)),
        "dtype": choice_arg("dtype", [torch.int32, torch.float64, torch.uint8, torch.float8_e4m3fn, "float32", None]),
        "name": choice_arg("name", [3, None, ""], ()),  # any label: errors only read it
        "config": config_arg(DEQUANTIZE)})
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
    args = {"blocks": blocks, "scales": scales}
    k, groups = 32 * kb, -(-kb // 4)
    if draw(st.booleans()) or mutation in ("out", "out part"):
        w = torch.full((*lead, n, k), 1.0).to(torch.float8_e4m3fn)
        s = torch.full((*lead, n, groups), -1.0)
        if draw(st.booleans()):
            s = s.transpose(-1, -2).contiguous().transpose(-1, -2)  # group-major, as workspace leases are
        args["out"] = (w, s)
    def out_part(draw, args):  # one of the two given tensors made bad
        part, out = draw(st.integers(0, 1)), list(args["out"])
        out[part], kind = draw(bad_tensor(out[part], dtypes=(out[part].dtype,)))
        args["out"] = tuple(out)
        return f"[{part}] {kind}", (f"out[{part}]", "out")

    out = args.get("out", ())
    mutation, names = mutate(draw, args, {
        "valid": None, "blocks": tensor_arg("blocks", (torch.uint8,), ("mxfp4_blocks", "mxfp4_scales")),
        "scales": tensor_arg("scales", (torch.uint8,), ("mxfp4_scales", "mxfp4_blocks")),
        "nan scale": element("scales", [0xFF], ("mxfp4_scales",)),
        "out": choice_arg("out", [None, out[:1], list(out), out * 2, out[0] if out else None]),
        "out part": out_part, "config": config_arg(CONVERT)}, mutation)

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
    slots = draw(st.integers(1, 4))
    shapes = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=3))
    count = draw(st.integers(1, slots))
    timeout = draw(st.sampled_from([None, 0, 0.5]))
    n, k = draw(st.sampled_from(shapes))
    if draw(st.booleans()):
        n, k = draw(st.integers(1, n)), draw(st.integers(1, k))
    args = {"slots": slots, "shapes": shapes, "device": "cpu", "count": count, "timeout": timeout, "n": n, "k": k}
    bad_timeout = real_arg("timeout", special=((-1, "negative"),))

    def wait(draw, args):
        kind, names = bad_timeout(draw, args)
        return kind, () if kind in ("inf", "None") else names  # no limit: a valid wait (the slots are free)

    def views(draw, args):  # views too large, empty, negative or not integers
        args["n"], args["k"] = draw(st.sampled_from([(n * 1000, k), (0, k), (-1, k), (n, -k), (n + 0.5, k), (None, k),
                                                     (n, 1 << 40)]))
        return "", ("n", "k", "views")

    mutation, names = mutate(draw, args, {
        "valid": None, "slots": int_arg("slots"),
        "shapes": choice_arg("shapes", [[], [(4, 0)], [(4.0, 32)], [(True, 32)], [(4, 32, 1)], [4, 32], None,
                                        [(-4, 32)], [(4, "32")]]),
        "device": choice_arg("device", ["nowhere", 3.5, None, "cuda:99"]),
        "count": int_arg("count", special=((slots + 1, "too many"),)), "timeout": wait, "views": views})
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
