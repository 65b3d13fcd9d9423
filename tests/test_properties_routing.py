"""Property tests of MoE routing: ``dt.RoutingConfig``, ``dt.deepseek_topk``, ``dt.softmax_topk``, ``dt.route``
and ``dt.route_topk`` (:mod:`tests.property_harness`: every generated call raises a clear error or equals the
reference, :mod:`dsa_triton.moe.routing_reference`)."""
import dataclasses
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.moe.route_topk_spec import SPEC as ROUTE_SPEC
from dsa_triton.moe.routing_reference import deepseek_topk_torch, route_torch, softmax_topk_torch

from .property_harness import (Case, choice_arg, config_arg, generator, int_arg, mutate, nan_split, real_arg,
                               run_property, tensor_arg)

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def selection_keys(logits, bias, mode):
    """``[T, E]`` float64 keys the experts are chosen by (NaN as -inf): DeepSeek's corrected sigmoid scores, or
    the logits."""
    keys = logits.double().sigmoid() + (0.0 if bias is None else bias.double()) if mode == "deepseek" \
        else logits.double()
    return keys.masked_fill(keys.isnan(), -math.inf)


def routing_compare(logits, bias, mode):
    """The selected keys equal the reference's as a multiset, in descending order, no expert twice, and the ids
    equal the reference's (among equal keys the lowest expert first, in the kernel and the torch functions alike);
    the weights of each expert equal the reference's."""
    def compare(out, ref):
        (weights, ids), (ref_weights, ref_ids) = out, ref
        if ids.shape != ref_ids.shape or weights.shape != ref_weights.shape:
            return f"shapes {tuple(weights.shape)} / {tuple(ids.shape)} != reference {tuple(ref_ids.shape)}"
        if weights.dtype != torch.float32 or ids.dtype != torch.int32:
            return f"dtypes {weights.dtype} / {ids.dtype}, expected float32 / int32"
        if ids.numel() == 0:
            return None
        if bool(((ids < 0) | (ids >= logits.shape[1])).any()):
            return "ids outside [0, E)"
        if bool((ids.sort(1).values[:, 1:] == ids.sort(1).values[:, :-1]).any()):
            return "an expert chosen twice for a token"
        keys = selection_keys(logits, bias, mode)
        got, want = keys.gather(1, ids.long()), keys.gather(1, ref_ids.long())
        if not torch.equal(got.sort(1, descending=True).values, want.sort(1, descending=True).values):
            return "the chosen experts' selection keys differ from the reference's"
        if bool((got[:, 1:] > got[:, :-1]).any()):
            return "experts not in descending order of their keys"
        if not torch.equal(ids, ref_ids):
            return "ids differ (ties go to the lowest expert)"
        same_rows = (ids.sort(1).values == ref_ids.sort(1).values).all(1)
        order, ref_order = ids.long().argsort(1), ref_ids.long().argsort(1)
        w, rw = weights.gather(1, order)[same_rows], ref_weights.gather(1, ref_order)[same_rows]
        problem, w, rw = nan_split(w, rw)
        if problem:
            return f"weights: {problem}"
        bad = ~((w - rw).abs() <= 1e-5 * rw.abs() + 1e-7)
        return f"weights: {int(bad.sum())} differ from the reference" if bool(bad.any()) else None
    return compare


def _logits(draw, g, T, E):
    dtype = draw(st.sampled_from(LOGIT_DTYPES))
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    if T * E and draw(st.booleans()):  # ties, infinities, NaN (rejected with value checks on, ranked last off)
        values = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 0.5])
        special = torch.rand(T, E, generator=g) < 0.25
        logits = torch.where(special, values[torch.randint(0, 5, (T, E), generator=g)].to(dtype), logits)
    return logits


def _grouping(draw, E):
    n_group = draw(st.sampled_from([d for d in range(1, E + 1) if E % d == 0]))
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, topk_group * (E // n_group)))
    return top_k, n_group, topk_group


# -- RoutingConfig ---------------------------------------------------------------------------------------------
@st.composite
def config_cases(draw):
    fields = {"mode": draw(st.sampled_from(["deepseek", "softmax"])), "top_k": draw(st.integers(1, 8)),
              "n_group": draw(st.integers(1, 8)), "topk_group": draw(st.integers(1, 8)),
              "norm_topk_prob": draw(st.booleans()), "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5, 1]))}
    mutation, names = mutate(draw, fields, {
        "valid": None, "mode": choice_arg("mode", ["DeepSeek", "sigmoid", 3, None], ("routing.mode",)),
        **{name: int_arg(name, names=(f"routing.{name}",)) for name in ("top_k", "n_group", "topk_group")},
        "norm_topk_prob": choice_arg("norm_topk_prob", ["false", "yes", 0, 1, None, 2.0], ("routing.norm_topk_prob",)),
        "routed_scaling_factor": real_arg("routed_scaling_factor", ("routing.routed_scaling_factor",),
                                          special=((0.0, "0"), (-2.5, "negative")))})
    return _config_case(mutation, fields, names)


def _config_case(mutation, fields, names):
    def compare(out, _):
        got = dataclasses.asdict(out)
        if got != fields or any(type(got[k]) is not type(v) for k, v in fields.items()):
            return f"fields {got}, given {fields}"
        return None if len(out.plan_ints()) == 5 else "plan_ints"

    return Case("RoutingConfig", mutation, fields, lambda: dt.RoutingConfig(**fields), names, lambda: None, compare)


# found by this test: a norm_topk_prob that is not a bool ("false" normalized: a truthy string)
NORM_STRING = _config_case("norm_topk_prob", {"mode": "deepseek", "top_k": 1, "n_group": 1, "topk_group": 1,
                                              "norm_topk_prob": "false", "routed_scaling_factor": 1.0},
                           ("routing.norm_topk_prob",))


def test_routing_config():
    run_property(config_cases(), examples=[NORM_STRING], min_launched=0)


def _nonfinite_names(args) -> tuple[str, ...]:
    """What an error may name for the valid arguments ``args``: the logits or the bias where one of them holds a
    non-finite value and the values are checked."""
    bias = args.get("bias")
    nonfinite = bool((~args["logits"].isfinite()).any()) or (bias is not None and bool((~bias.isfinite()).any()))
    return ("logits", "bias") if nonfinite and args["check_values"] else ()


def _logit_mutations(E) -> dict:
    """The logits and a bias made bad (an all-zero bias where None would be valid: softmax routing takes none)."""
    return {"logits": tensor_arg("logits", LOGIT_DTYPES, ("logits", "top_k", "n_group", "bias")),
            "bias": tensor_arg("bias", LOGIT_DTYPES, like=lambda args: torch.zeros(E), none=(torch.zeros(E), "a bias"))}


# -- deepseek_topk / softmax_topk ------------------------------------------------------------------------------
@st.composite
def topk_function_cases(draw, mode):
    g = generator(draw)
    T, E = draw(st.integers(0, 3)), draw(st.sampled_from([1, 4, 6, 8, 12]))
    logits = _logits(draw, g, T, E)
    top_k, n_group, topk_group = _grouping(draw, E)
    bias = (torch.randn(E, generator=g) * 0.1).to(draw(st.sampled_from(LOGIT_DTYPES))) \
        if mode == "deepseek" and draw(st.booleans()) else None
    args = {"logits": logits, "top_k": top_k}
    if mode == "deepseek":
        args.update(bias=bias, n_group=n_group, topk_group=topk_group, norm_topk_prob=draw(st.booleans()),
                    routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    else:
        args["renormalize"] = draw(st.booleans())
    args["check_values"] = draw(st.booleans())
    nonfinite_names = _nonfinite_names(args)
    bad = _logit_mutations(E)
    mutations = {"valid": None, "logits": bad["logits"], "top_k": int_arg("top_k", special=((E + 1, "E + 1"),))}
    if mode == "deepseek":
        bias_values = [torch.full((E,), v) for v in (math.nan, math.inf, -math.inf)]
        mutations.update({"bias": bad["bias"], "bias values": choice_arg("bias", bias_values, ("bias",) if
                                                                      args["check_values"] else ())})
        mutations.update({name: int_arg(name, names=(name, "top_k"), special=((E + 1, "E + 1"), (2 * E, "2 E")))
                          for name in ("n_group", "topk_group")})
    mutation, names = mutate(draw, args, mutations)
    names += nonfinite_names  # (a clear error either way: the case has two faults)
    op = dt.deepseek_topk if mode == "deepseek" else dt.softmax_topk
    oracle = deepseek_topk_torch if mode == "deepseek" else softmax_topk_torch

    def reference():
        kw = {k: v for k, v in args.items() if k not in ("check_values", "logits", "top_k")}
        return oracle(args["logits"], **kw, top_k=args["top_k"])

    def compare(out, ref):
        return routing_compare(args["logits"], args.get("bias"), mode)(out, ref)

    return Case(f"{mode}_topk", mutation, args, lambda: op(**args), names, reference, compare)


def test_deepseek_topk():
    run_property(topk_function_cases("deepseek"), examples=[ZERO_SCORES], min_launched=0)


# found by this test: with an infinite logit, the full softmax's weights were [NaN, 0] (the oracle's and the
# kernel's: all NaN); and the oracle divided 0 by 0 (a ZeroDivisionError) where every chosen score is 0
INF_LOGIT = Case("softmax_topk", "valid: an infinite logit", {}, lambda: dt.softmax_topk(
    torch.tensor([[0.5, math.inf, 2.5]]), 2, renormalize=False, check_values=False), (),
    lambda: softmax_topk_torch(torch.tensor([[0.5, math.inf, 2.5]]), 2, renormalize=False),
    routing_compare(torch.tensor([[0.5, math.inf, 2.5]]), None, "softmax"))
ZERO_SCORES = Case("deepseek_topk", "valid: every score 0", {}, lambda: dt.deepseek_topk(
    torch.tensor([[-math.inf]]), None, 1, check_values=False), (),
    lambda: deepseek_topk_torch(torch.tensor([[-math.inf]]), None, 1),
    routing_compare(torch.tensor([[-math.inf]]), None, "deepseek"))


def test_softmax_topk():
    run_property(topk_function_cases("softmax"), examples=[INF_LOGIT], min_launched=0)


# -- route / route_topk ----------------------------------------------------------------------------------------
@st.composite
def route_cases(draw, kernel: bool):
    g = generator(draw)
    T = draw(st.integers(0, 3))
    E = draw(st.sampled_from([1, 4, 6, 8, 12, 20] + ([4100] if kernel else [])))  # 4100, top_k > 16: torch
    logits = _logits(draw, g, T, E)
    mode = draw(st.sampled_from(["deepseek", "softmax"]))
    top_k, n_group, topk_group = _grouping(draw, E) if mode == "deepseek" else (draw(st.integers(1, E)), 1, 1)
    routing = dt.RoutingConfig(mode, top_k=top_k, n_group=n_group, topk_group=topk_group,
                               norm_topk_prob=draw(st.booleans()), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    bias = (torch.randn(E, generator=g) * 0.1).to(draw(st.sampled_from(LOGIT_DTYPES))) \
        if mode == "deepseek" and draw(st.booleans()) else None
    args = {"logits": logits, "routing": routing, "bias": bias, "check_values": draw(st.booleans())}
    nonfinite_names = _nonfinite_names(args)

    def grouping(draw, args):  # top_k or n_group that the experts do not fit
        args["routing"] = dt.RoutingConfig("deepseek", top_k=draw(st.integers(1, E + 2)),
                                           n_group=draw(st.integers(1, E + 1)), topk_group=1)
        return "", ("top_k", "n_group", "topk_group")

    mutations = {"valid": None, **_logit_mutations(E),
                 "routing": choice_arg("routing", [None, dataclasses.asdict(routing), "deepseek"]),
                 "grouping": grouping}
    if kernel:
        mutations["config"] = config_arg(ROUTE_SPEC)
    mutation, names = mutate(draw, args, mutations)
    names += nonfinite_names  # (a clear error either way: the case has two faults)
    op = dt.route_topk if kernel else dt.route

    def compare(out, ref):
        return routing_compare(args["logits"], args["bias"], args["routing"].mode)(out, ref)

    return Case("route_topk" if kernel else "route", mutation, args, lambda: op(**args), names,
                lambda: route_torch(args["logits"], args["routing"], args["bias"]), compare)


# found by this test: the torch functions kept groups of equal score in torch.topk's order (the 9th of 10 tied groups
# here), not the lowest first as the kernel and the oracle do: other experts
TIED = torch.tensor([[math.inf, math.inf, float(g)] for g in range(10)]).view(1, 30)
TIED_ROUTING = dt.RoutingConfig("deepseek", top_k=3, n_group=10, topk_group=1)
GROUP_TIE = Case("route", "valid: ten groups of equal score", {}, lambda: dt.route(TIED, TIED_ROUTING, check_values=False),
                 (), lambda: route_torch(TIED, TIED_ROUTING), routing_compare(TIED, None, "deepseek"))

# found by this test: the torch functions masked the dropped groups to -inf, where a NaN expert of the kept group
# (ranked as -inf) tied with them and the lowest expert, of a dropped group, was chosen; the kernel and the oracle
# choose within the kept groups only
NAN_KEPT = torch.tensor([[-2.25, -2.30, -0.50, 0.0, 1.70, 0.0, math.nan, math.inf, 0.64, -2.53, -math.inf, 0.62]])
NAN_KEPT_ROUTING = dt.RoutingConfig("deepseek", top_k=3, n_group=4, topk_group=1)
NAN_IN_KEPT_GROUP = Case("route", "valid: a NaN expert in the kept group", {},
                         lambda: dt.route(NAN_KEPT, NAN_KEPT_ROUTING, check_values=False), (),
                         lambda: route_torch(NAN_KEPT, NAN_KEPT_ROUTING), routing_compare(NAN_KEPT, None, "deepseek"))


def test_route():
    run_property(route_cases(False), examples=[GROUP_TIE, NAN_IN_KEPT_GROUP], min_launched=0)


def test_route_topk():
    run_property(route_cases(True))
