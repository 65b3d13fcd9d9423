"""Blockwise-FP8 linear (Triton interpreter) against its PyTorch reference: fresh random inputs, outputs poisoned
with NaN, sizes that are not multiples of 128 or of any tile, every activation dtype, and bad inputs."""
import pytest
import torch

import dsa_triton as dt
from dsa_triton import registry
from dsa_triton.linear.formats import dequantize_fp8_blockwise, quantize_fp8_blockwise
from dsa_triton.linear.fp8_blockwise_linear_reference import fp8_blockwise_linear_torch

from .poison import poisoned_allocations

SPEC = registry.get("fp8_blockwise_linear")
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2}


@pytest.fixture(autouse=True)
def poisoned_buffers():
    with poisoned_allocations():
        yield


def problem(M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[N // 2:, K // 3:] *= 50  # blocks of very different scales
    weight, scale = quantize_fp8_blockwise(w)
    return torch.randn(M, K, generator=g).to(dtype), weight, scale


def check(y, x, weight, scale):
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0]) and not y.isnan().any()
    assert SPEC.compare(y, SPEC.reference({"x": x, "weight": weight, "weight_scale_inv": scale})) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K", [(1, 130, 200), (37, 257, 129), (5, 7, 300)])
def test_matches_reference(M, N, K, dtype):
    x, weight, scale = problem(M, N, K, dtype, seed=M * N + K)
    check(dt.fp8_blockwise_linear(x, weight, scale), x, weight, scale)
    check(dt.fp8_blockwise_linear(x, weight, scale, config=SMALL, check_values=False), x, weight, scale)


def test_grouped_tile_order_covers_every_tile():
    """More row tiles than GROUP_M and a ragged last group: every output tile is written once."""
    x, weight, scale = problem(150, 100, 64, torch.float16, seed=3)
    check(dt.fp8_blockwise_linear(x, weight, scale, config={**SMALL, "GROUP_M": 8}), x, weight, scale)


def test_reference_round_trip_and_power_of_two_scales():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 130, generator=g)
    weight, scale = quantize_fp8_blockwise(w, power_of_two=True)
    assert scale.shape == (2, 2) and bool((torch.frexp(scale).mantissa == 0.5).all())
    deq = dequantize_fp8_blockwise(weight, scale)
    torch.testing.assert_close(deq, w, rtol=2 ** -3, atol=0)  # e4m3: 3 mantissa bits
    assert torch.equal(deq.bfloat16().float(), deq)  # power-of-two scales: exact in bf16
    x = torch.randn(4, 130, generator=g)
    torch.testing.assert_close(fp8_blockwise_linear_torch(x, weight, scale), x @ deq.t())


def test_empty_rows():
    x, weight, scale = problem(0, 40, 50, torch.float16, seed=1)
    assert dt.fp8_blockwise_linear(x, weight, scale).shape == (0, 40)


def test_bad_inputs_name_the_argument():
    x, weight, scale = problem(4, 130, 200, torch.float16, seed=2)
    cases = [
        ((x.int(), weight, scale), "x: dtype"),
        ((x, weight.float(), scale), "weight: dtype"),
        ((x[:, :100], weight, scale), "x: dimension 1 must be K = 200"),
        ((x, weight, scale[:1]), "weight_scale_inv: dimension 0 must be 2"),
        ((x, weight, scale.half()), "weight_scale_inv: dtype"),
        ((x.t().contiguous().t(), weight, scale), "x: the last dimension must be contiguous"),
        ((x, weight, -scale), "weight_scale_inv: every scale must be finite and > 0"),
        ((x.masked_fill(x > 1, float("inf")), weight, scale), "x: holds a non-finite value"),
    ]
    nan_weight = weight.clone()
    nan_weight.view(torch.uint8)[3, 7] = 0xFF
    cases.append(((x, nan_weight, scale), "weight: holds an e4m3 NaN"))
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            dt.fp8_blockwise_linear(*args)
    with pytest.raises(ValueError, match="BLOCK_M"):
        dt.fp8_blockwise_linear(x, weight, scale, config={**SMALL, "BLOCK_M": 24})


def test_registry_entry():
    """Fresh random inputs per seed; the default and a small config pass the spec's own comparison."""
    for phase in SPEC.phases:
        shape = SPEC.bench_shapes(phase, False)[0]
        a, b = (SPEC.make_inputs(phase, shape, torch.device("cpu"), seed) for seed in (0, 1))
        assert not torch.equal(a["x"], b["x"])
        for config in (SPEC.launch_config(phase, shape, "cpu"), SMALL):
            assert SPEC.compare(SPEC.run(a, config), SPEC.reference(a)) is None
