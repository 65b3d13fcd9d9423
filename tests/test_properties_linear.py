"""Property tests of ``dt.fp8_blockwise_linear`` (:mod:`tests.property_harness`: every generated call raises a clear
error or equals the reference, :func:`~dsa_triton.linear.fp8_blockwise_linear_reference.fp8_blockwise_linear_torch`)."""
import math

import torch
from hypothesis import strategies as st

import dsa_triton as dt
from dsa_triton.linear.formats import quantize_fp8_blockwise
from dsa_triton.linear.fp8_blockwise_linear_spec import SPEC

from .property_harness import (Case, checked, config_arg, element, generator, mutate, nan_split, run_property,
                               tensor_arg)

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@st.composite
def linear_cases(draw):
    g = generator(draw)
    M, N, K = draw(st.integers(0, 4)), draw(st.sampled_from([1, 5, 32, 130])), draw(st.sampled_from([0, 1, 16, 40, 136]))
    weight, scale = quantize_fp8_blockwise(torch.randn(N, K, generator=g) * max(K, 1) ** -0.5,
                                           power_of_two=draw(st.booleans()))
    x = torch.randn(M, K, generator=g).to(draw(st.sampled_from(X_DTYPES)))
    args = {"x": x, "weight": weight, "weight_scale_inv": scale, "check_values": draw(st.booleans())}
    mutation, names = mutate(draw, args, {
        "valid": None, "x": tensor_arg("x", X_DTYPES, ("x", "weight")),
        "x values": element("x", [math.nan, math.inf, -math.inf], if_checked=True),  # (unchecked: NaN in, NaN out)
        "weight": tensor_arg("weight", (torch.float8_e4m3fn,), ("weight", "x", "weight_scale_inv")),
        "weight values": checked(element("weight", [0x7F, 0xFF])),
        "weight_scale_inv": tensor_arg("weight_scale_inv", (torch.float32,)),
        "scale values": checked(element("weight_scale_inv", [0.0, -1.0, math.nan, math.inf])),
        "config": config_arg(SPEC)})

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
