"""MXFP4 quantize / dequantize kernels against the reference (interpreter), and the reference against the spec."""
import pytest
import torch

import dsa_triton as dt
from dsa_triton import registry
from dsa_triton.moe.formats import e2m1_lut, pad_k, validate_mxfp4
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch
from tests.poison import poisoned_allocations


def magnitudes(shape, seed, dtype):
    """Fresh random weights whose rows span the dtype's range: tiny (subnormal), ordinary and huge rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    lo, hi = {torch.float32: (-140, 120), torch.bfloat16: (-130, 120), torch.float16: (-20, 12)}[dtype]
    exps = torch.randint(lo, hi, (*shape[:-1], 1), generator=g).float()
    w = (w * torch.exp2(exps)).to(dtype)
    w[..., 0, :32] = 0  # an all-zero block
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_reference_bit_for_bit(dtype):
    w = magnitudes((3, 9, 96), seed=dtype.itemsize, dtype=dtype)
    with poisoned_allocations():
        blocks, scales = dt.mxfp4_quantize(w)
    ref_blocks, ref_scales = mxfp4_quantize_torch(w)
    assert blocks.shape == (3, 9, 3, 16) and scales.shape == (3, 9, 3)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(blocks, ref_blocks)
    assert int(scales.min()) == 0 and int(scales.max()) - int(scales[scales > 0].min()) > 25  # a real spread


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_matches_reference_over_every_code_and_scale(dtype):
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (2, 13, 5, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (2, 13, 5), generator=g, dtype=torch.uint8)
    scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    with poisoned_allocations():
        out = dt.mxfp4_dequantize(blocks, scales, dtype)
    ref = mxfp4_dequantize_torch(blocks, scales, dtype)
    assert out.dtype == dtype and out.shape == (2, 13, 160)
    assert not out.isnan().any()
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    assert torch.equal(out.view(bits), ref.view(bits))  # bit for bit: signed zeros, infs and subnormals too


def test_reference_follows_the_spec_on_ties_and_saturation():
    # amax 7 -> shared exponent floor(log2 7) - 2 = 0, so the values are their own scaled values
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -6.0, -0.1, 0.3, 0.0] + [0.0] * 20)
    blocks, scales = mxfp4_quantize_torch(row[None])
    assert int(scales) == 127
    codes = torch.stack([blocks[0, 0] & 0xF, blocks[0, 0] >> 4], -1).flatten()[:12]
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 15, 8, 1, 0]
    assert e2m1_lut()[codes.long()].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -6, -0.0, 0.5, 0]
    w = torch.tensor([[96.0] + [1.0] * 31])  # 2^6 * 1.5: exponent 6 - 2 = 4 -> scale byte 131
    assert int(mxfp4_quantize_torch(w)[1]) == 131
    assert torch.equal(mxfp4_dequantize_torch(*mxfp4_quantize_torch(w))[0, :2], torch.tensor([96.0, 0.0]))


def test_round_trip_error_is_within_the_format():
    w = magnitudes((4, 64), seed=3, dtype=torch.float32)
    back = dt.mxfp4_dequantize(*dt.mxfp4_quantize(w))
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    err = (back - w).unflatten(-1, (-1, 32)).abs()
    assert bool((err <= amax / 4 + 1e-45).all())  # half of the widest step (4 -> 6) at scale amax / 4..8


def test_nan_scale_rejected_naming_tensor_and_block():
    blocks = torch.randint(0, 256, (3, 4, 2, 16), dtype=torch.uint8)
    scales = torch.full((3, 4, 2), 120, dtype=torch.uint8)
    scales[2, 1, 1] = 0xFF
    with pytest.raises(ValueError, match=r"layers\.7\.w13_scales: block \(2, 1, 1\) \(k 32\.\.63\)"):
        validate_mxfp4("layers.7.w13", blocks, scales)
    with pytest.raises(ValueError, match=r"w2_scales: block \(2, 1, 1\)"):
        dt.mxfp4_dequantize(blocks, scales, name="w2")


@pytest.mark.parametrize("blocks, scales, match", [
    (torch.zeros(4, 2, 16, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), "w_blocks: dtype"),
    (torch.zeros(4, 2, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), r"w_blocks: expected shape"),
    (torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), r"w_scales: shape must be \(4, 2\)"),
    (torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float32), "w_scales: dtype"),
])
def test_bad_layouts_rejected(blocks, scales, match):
    with pytest.raises(ValueError, match=match):
        dt.mxfp4_dequantize(blocks, scales, name="w")


def test_quantize_rejects_bad_input_and_pad_k_fixes_k():
    with pytest.raises(ValueError, match="multiple of 32"):
        dt.mxfp4_quantize(torch.randn(3, 40))
    with pytest.raises(ValueError, match="NaN or inf"):
        dt.mxfp4_quantize(torch.tensor([[float("inf")] + [0.0] * 31]))
    with pytest.raises(ValueError, match="w: dtype"):
        dt.mxfp4_quantize(torch.randn(3, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        dt.mxfp4_dequantize(*dt.mxfp4_quantize(torch.randn(2, 32)), torch.int32)
    w = torch.randn(3, 40)
    blocks, scales = dt.mxfp4_quantize(pad_k(w))
    assert blocks.shape == (3, 2, 16)
    assert torch.equal(dt.mxfp4_dequantize(blocks, scales)[:, 40:], torch.zeros(3, 24))


@pytest.mark.parametrize("name", ["mxfp4_quantize", "mxfp4_dequantize"])
def test_registry_entry_checks_out_on_its_cpu_shapes(name):
    spec = registry.get(name)
    for phase in spec.phases:
        for shape in spec.bench_shapes(phase, False):
            inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 5)
            config = spec.launch_config(phase, shape, "cpu")
            assert spec.compare(spec.run(inputs, config), spec.reference(inputs)) is None
            broken = {"w": inputs["w"] * 3} if "w" in inputs else {**inputs, "scales": inputs["scales"] + 1}
            assert spec.compare(spec.run(broken, config), spec.reference(inputs)) is not None


BAD_CONFIGS = [{}, {"BLOCK_B": 16, "num_warps": 2, "extra": 1}, {"BLOCK_B": 16, "num_warps": 0},
               {"BLOCK_B": -1, "num_warps": 2}, {"BLOCK_B": 16}, {"BLOCK_B": 0, "num_warps": 2},
               {"BLOCK_B": 16.0, "num_warps": 2}, {"BLOCK_B": True, "num_warps": 2}]


@pytest.mark.parametrize("config", BAD_CONFIGS)
def test_a_config_given_by_hand_is_validated(config):
    w = torch.randn(4, 64)
    blocks, scales = dt.mxfp4_quantize(w)
    with pytest.raises(dt.ConfigError, match="mxfp4_quantize"):
        dt.mxfp4_quantize(w, config=config)
    with pytest.raises(dt.ConfigError, match="mxfp4_dequantize"):
        dt.mxfp4_dequantize(blocks, scales, config=config)
    with pytest.raises(dt.ConfigError, match="mxfp4_quantize"):  # also with nothing to launch
        dt.mxfp4_quantize(torch.randn(0, 64), config=config)
    good = {"BLOCK_B": 8, "num_warps": 1}
    assert torch.equal(dt.mxfp4_dequantize(*dt.mxfp4_quantize(w, config=good), config=good),
                       dt.mxfp4_dequantize(blocks, scales))
