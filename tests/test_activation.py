"""SwiGLU (interpreter) against its torch reference, in rows and class-major, and the class-major layout."""
import pytest
import torch

from dsa_triton.moe.activation import swiglu
from dsa_triton.moe.formats import class_major, row_major
from dsa_triton.moe.activation_reference import swiglu_torch
from tests.poison import poisoned_allocations


def test_reference_is_silu_of_the_first_half_times_the_second():
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).half()
    expected = torch.nn.functional.silu(h[:, :4].float()) * h[:, 4:].float()
    torch.testing.assert_close(swiglu_torch(h).float(), expected, rtol=1e-3, atol=1e-3)


def test_class_major_layout_and_its_inverse():
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    xc = class_major(x)
    assert xc.shape == (3, 4, 3) and xc.is_contiguous()
    for c in range(4):
        assert torch.equal(xc[:, c, :], x[:, c::4])
    assert torch.equal(row_major(xc), x)


@pytest.mark.parametrize("rows, inter, h_dtype, out_dtype, class_major_out", [
    (3, 40, torch.float32, torch.float16, True),  # the fused path: fp32 gate_up output -> class-major fp16
    (2, 1100, torch.float32, torch.bfloat16, True),  # two programs a row, the second partly masked
    (2, 1100, torch.bfloat16, None, False),
    (4, 37, torch.float16, torch.float32, False),  # I not a multiple of 4 (rows only)
    (1, 8, torch.float32, None, False),
])
def test_swiglu_matches_reference(rows, inter, h_dtype, out_dtype, class_major_out):
    h = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3).to(h_dtype)
    with poisoned_allocations():
        y = swiglu(h, out_dtype, class_major=class_major_out)
    ref = swiglu_torch(h, out_dtype, class_major_out)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    else:  # one rounding of an fp32 value that may differ in its last bit
        torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-5)


def test_swiglu_of_strided_rows():
    h = torch.randn(3, 2 * 16 + 5, generator=torch.Generator().manual_seed(2))[:, :32]  # rows 37 apart
    torch.testing.assert_close(swiglu(h, class_major=True), swiglu_torch(h, None, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda h: swiglu(h[0]), "dimensions"),
    (lambda h: swiglu(h[:, :7]), "even"),
    (lambda h: swiglu(h[:, :12], class_major=True), "multiple of 4"),
    (lambda h: swiglu(h.int()), "dtype"),
    (lambda h: swiglu(h, torch.int32), "dtype"),
    (lambda h: swiglu(h.t()), "stride|contiguous"),
])
def test_swiglu_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(4, 16))
