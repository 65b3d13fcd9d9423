"""Online MXFP4 -> FP8 conversion kernel against the reference: exact where blocks fit, unfit blocks counted."""
import pytest
import torch

import dsa_triton as dt
from dsa_triton import registry
from dsa_triton.moe.mxfp4_to_fp8_spec import compare_conversion
from dsa_triton.moe.formats import GROUP
from dsa_triton.moe.mxfp4_to_fp8_reference import fp8_conversion_torch, mxfp4_to_fp8_torch
from dsa_triton.moe.mxfp4_spec import random_mxfp4
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch
from tests.poison import poisoned_allocations


def dequantize_fp8(w, scale):
    """fp8 ``w[..., N, K]`` times its group scales, in float64 (exact)."""
    return w.double() * scale.double().repeat_interleave(GROUP, dim=-1)[..., : w.shape[-1]]


@pytest.mark.parametrize("lead, n, k", [((), 7, 96), ((3,), 20, 160), ((2, 2), 5, 256)])
def test_fitting_blocks_convert_exactly(lead, n, k):
    # within-group scale spread <= 12 binades < 14: every block fits
    blocks, scales = random_mxfp4((*lead, n), k, "cpu", seed=n + k, spread=6)
    with poisoned_allocations():
        w, scale, n_unfit = dt.mxfp4_to_fp8(blocks, scales)
    assert w.dtype == torch.float8_e4m3fn and w.shape == (*lead, n, k)
    assert scale.dtype == torch.float32 and scale.shape == (*lead, n, -(-k // GROUP))
    assert n_unfit == 0
    assert torch.equal(dequantize_fp8(w, scale), mxfp4_dequantize_torch(blocks, scales, torch.float64))
    ref_w, ref_scale, ref_unfit = mxfp4_to_fp8_torch(blocks, scales)
    assert ref_unfit == 0 and torch.equal(scale, ref_scale)
    assert torch.equal(w.view(torch.uint8), ref_w.view(torch.uint8))


def test_every_code_at_every_fast_path_distance_is_exact():
    # rows 2d and 2d + 1 hold all 256 byte values, every block d binades below its group's top block (d <= 11:
    # the bit-twiddling path), the top block itself first in each group
    n, kb = 24, 8
    blocks = torch.arange(256, dtype=torch.uint8).repeat(12).view(n, kb, 16)
    d = torch.arange(n) // 2
    scales = (140 - d).to(torch.uint8)[:, None].repeat(1, kb)
    scales[:, ::4] = 140
    with poisoned_allocations():
        w, scale, n_unfit = dt.mxfp4_to_fp8(blocks, scales)
    ref_w, ref_scale, ref_unfit = mxfp4_to_fp8_torch(blocks, scales)
    assert n_unfit == ref_unfit == 0 and torch.equal(scale, ref_scale)
    assert torch.equal(w.view(torch.uint8), ref_w.view(torch.uint8))  # signed zeros included


def test_unfit_blocks_are_counted_and_the_rest_stay_exact():
    blocks, scales = random_mxfp4((9,), 160, "cpu", seed=11, spread=2)  # 5 blocks per row: groups of 4 + 1
    # block 1 sits 15 binades below its group's top, where only magnitudes 0.5 and 1.5 (codes 1, 3) lose
    # bits: keep even codes (values 0, 1, 2, 4) in it, then plant odd ones in row 1
    blocks[:, 1] &= 0xEE
    scales[:, 0], scales[:, 1] = 140, 125
    blocks[0, 1] = 0x42  # row 0, block 1: magnitudes 2 and 4 only -> 2^-9 and 2^-8: fits
    blocks[1, 1] = 0x31  # row 1, block 1: 0.5 and 1.5 -> unfit
    scales[2, 2], blocks[2, 2] = 30, 0  # row 2, block 2: far below but all codes 0 -> fits
    scales[3, 3] = 100  # row 3, block 3: 40 binades below, random codes -> unfit (flushes)
    with poisoned_allocations():
        w, scale, n_unfit = dt.mxfp4_to_fp8(blocks, scales)
    ref_w, ref_scale, lost = fp8_conversion_torch(blocks, scales)
    assert not lost[0, 1] and lost[1, 1] and not lost[2, 2] and lost[3, 3]
    assert n_unfit == int(lost.sum()) > 1
    assert compare_conversion((w, scale, n_unfit), (ref_w, ref_scale, lost)) is None
    exact = mxfp4_dequantize_torch(blocks, scales, torch.float64)
    got = dequantize_fp8(w, scale)
    fits = (~lost).repeat_interleave(32, dim=-1)
    assert torch.equal(got[fits], exact[fits])
    # an unfit value is off by at most one e4m3 subnormal step (2^-9 times the group scale)
    step = scale.double().repeat_interleave(GROUP, dim=-1)[..., :160] * 2.0**-9
    assert bool(((got - exact).abs() <= step).all())


def test_converts_into_given_out_tensors():
    blocks, scales = random_mxfp4((2, 12), 96, "cpu", seed=4)
    w_out = torch.full((2, 12, 96), float("nan")).to(torch.float8_e4m3fn)
    s_out = torch.full((2, 12, 1), float("nan"))
    w, s, _ = dt.mxfp4_to_fp8(blocks, scales, out=(w_out, s_out))
    assert w is w_out and s is s_out
    assert torch.equal(dequantize_fp8(w, s), mxfp4_dequantize_torch(blocks, scales, torch.float64))


@pytest.mark.parametrize("shape", [(0, 4, 2), (3, 0, 2), (2, 4, 0)])
def test_empty_weights_convert_to_empty_outputs(shape):
    blocks, scales = torch.zeros(*shape, 16, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    w, scale, n_unfit = dt.mxfp4_to_fp8(blocks, scales)
    k = shape[-1] * 32
    assert w.shape == (*shape[:-1], k) and w.dtype == torch.float8_e4m3fn
    assert scale.shape == (*shape[:-1], -(-k // GROUP)) and n_unfit == 0


def test_bad_arguments_raise_before_launch():
    blocks, scales = random_mxfp4((4,), 64, "cpu", seed=1)
    bad = scales.clone()
    bad[3, 1] = 0xFF
    with pytest.raises(ValueError, match=r"w13_scales: block \(3, 1\)"):
        dt.mxfp4_to_fp8(blocks, bad, name="w13")
    with pytest.raises(ValueError, match=r"out\[0\]: dtype"):
        dt.mxfp4_to_fp8(blocks, scales, out=(torch.empty(4, 64), torch.empty(4, 1)))
    with pytest.raises(ValueError, match=r"out\[1\]: dimension 1 must be 1"):
        dt.mxfp4_to_fp8(blocks, scales, out=(torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.empty(4, 2)))
    with pytest.raises(ValueError, match="contiguous"):
        dt.mxfp4_to_fp8(blocks.transpose(0, 1).contiguous().transpose(0, 1), scales)


@pytest.mark.parametrize("config", [
    {}, {"BLOCK_N": 8, "GROUPS": 2, "num_warps": 4, "extra": 1}, {"BLOCK_N": 8, "GROUPS": 2, "num_warps": 0},
    {"BLOCK_N": -8, "GROUPS": 2, "num_warps": 4}, {"BLOCK_N": 8, "GROUPS": 2}, {"BLOCK_N": 0, "GROUPS": 2, "num_warps": 4},
    {"BLOCK_N": 8.0, "GROUPS": 2, "num_warps": 4}])
def test_a_config_given_by_hand_is_validated(config):
    blocks, scales = random_mxfp4((4,), 64, "cpu", seed=1)
    with pytest.raises(dt.ConfigError, match="mxfp4_to_fp8"):
        dt.mxfp4_to_fp8(blocks, scales, config=config)
    with pytest.raises(dt.ConfigError, match="mxfp4_to_fp8"):  # also with nothing to launch
        dt.mxfp4_to_fp8(blocks[:0], scales[:0], config=config)
    w, s, n = dt.mxfp4_to_fp8(blocks, scales, config={"BLOCK_N": 4, "GROUPS": 1, "num_warps": 1})
    assert torch.equal(w.view(torch.uint8), dt.mxfp4_to_fp8(blocks, scales)[0].view(torch.uint8))


def test_registry_entry_checks_out_and_catches_a_wrong_result():
    spec = registry.get("mxfp4_to_fp8")
    (shape,) = spec.bench_shapes("prefill", False)
    inputs = spec.make_inputs("prefill", shape, torch.device("cpu"), 3)
    ref = spec.reference(inputs)
    assert 0 < int(ref[2].sum()) < ref[2].numel() // 2  # realistic inputs with some unfit blocks
    for config in ({"BLOCK_N": 4, "GROUPS": 1, "num_warps": 1}, {"BLOCK_N": 8, "GROUPS": 2, "num_warps": 4},
                   spec.launch_config("prefill", shape, "cpu")):
        assert spec.compare(spec.run(inputs, config), ref) is None
    w, s, n = spec.run(inputs, config)
    assert spec.compare((w, s * 2, n), ref) is not None and spec.compare((w, s, n + 1), ref) is not None
