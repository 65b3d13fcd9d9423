"""Property tests of ``dt.fp8_blockwise_linear`` (:mod:`tests.property_harness`: every generated call raises a clear
error or equals the reference, :func:`~dsa_triton.linear.fp8_linear_reference.fp8_blockwise_linear_torch`)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.linear.fp8_linear_reference import quantize_fp8_blockwise
from dsa_triton.linear.fp8_linear_spec import SPEC

from .property_harness import Case, bad_config, bad_tensor, generator, nan_split, run_property

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@st.composite
def linear_cases(draw):
    g = generator(draw)
    M, N, K = draw(st.integers(0, 4)), draw(st.sampled_from([1, 5, 32, 130])), draw(st.sampled_from([0, 1, 16, 40, 136]))
    weight, scale = quantize_fp8_blockwise(torch.randn(N, K, generator=g) * max(K, 1) ** -0.5,
                                           power_of_two=draw(st.booleans()))
    x = torch.randn(M, K, generator=g).to(draw(st.sampled_from(X_DTYPES)))
    args = {"x": x, "weight": weight, "weight_scale_inv": scale, "check_values": draw(st.booleans())}
    mutation = draw(st.sampled_from(["valid", "x", "x values", "weight", "weight values", "weight_scale_inv",
                                     "scale values", "config"]))
    names = ()
    if mutation == "x":
        args["x"], kind = draw(bad_tensor(x, dtypes=X_DTYPES))
        mutation, names = f"x {kind}", ("x", "weight")
    elif mutation == "x values" and x.numel():
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        names = ("x",) if args["check_values"] else ()  # (unchecked: NaN in, NaN out)
    elif mutation == "weight":
        args["weight"], kind = draw(bad_tensor(weight, dtypes=(torch.float8_e4m3fn,)))
        mutation, names = f"weight {kind}", ("weight", "x", "weight_scale_inv")
    elif mutation == "weight values" and weight.numel():
        weight.view(torch.uint8).view(-1)[draw(st.integers(0, weight.numel() - 1))] = draw(st.sampled_from([0x7F, 0xFF]))
        args["check_values"], names = True, ("weight",)
    elif mutation == "weight_scale_inv":
        args["weight_scale_inv"], kind = draw(bad_tensor(scale, dtypes=(torch.float32,)))
        mutation, names = f"weight_scale_inv {kind}", ("weight_scale_inv",)
    elif mutation == "scale values" and scale.numel():
        scale.view(-1)[draw(st.integers(0, scale.numel() - 1))] = draw(st.sampled_from([0.0, -1.0, math.nan, math.inf]))
        args["check_values"], names = True, ("weight_scale_inv",)
    elif mutation == "config":
        args["config"], kind, names = bad_config(draw, SPEC)
        mutation += f" {kind}"
    else:
        mutation = "valid"

    def reference():
        return SPEC.reference({k: args[k] for k in ("x", "weight", "weight_scale_inv")})

    def compare(out, ref):
        expected, bound = ref
        problem, out, expected = nan_split(out, expected)
        return problem or SPEC.compare(out, (expected, bound.nan_to_num(0.0)))

    return Case("fp8_blockwise_linear", mutation, args, lambda: dt.fp8_blockwise_linear(**args), names, reference,
                compare)


def test_fp8_blockwise_linear():
    run_property(linear_cases())
