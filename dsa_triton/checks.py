"""Argument checks shared by every op: a ``ValueError`` naming the argument, raised before launch."""
from __future__ import annotations

from typing import Iterable

import torch

from .runtime import interpreting


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
    contiguous_last: bool = True,
) -> torch.Tensor:
    """Validate ``t`` and return it.

    ``shape`` entries of ``None`` are free. ``contiguous_last`` requires stride 1 on the last dimension,
    which every kernel here assumes for vector loads.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            names = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise ValueError(f"{name}: dtype must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None and ndim is None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: dimension {axis} must be {want}, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous_last and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    return t


def check_out(out: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              contiguous: bool = True) -> torch.Tensor:
    """A caller's preallocated output: exactly the ``shape``, ``dtype`` and ``device`` the op would allocate, and
    contiguous (``contiguous=False``: the last dimension only, for kernels that take the row stride); a
    ``ValueError`` naming ``out`` otherwise. It must not overlap the op's inputs (not checked)."""
    check_tensor("out", out, dtype=dtype, shape=tuple(shape), device=device)
    if contiguous and not out.is_contiguous():
        raise ValueError(f"out: must be contiguous, got strides {out.stride()}")
    return out


def exact_mismatch(outputs) -> str | None:
    """None when every ``(name, got, expected)`` of ``outputs`` agrees in dtype, shape and value (NaN equals NaN),
    else what differs first: the ``compare`` of kernels whose result must be bit-exact."""
    for name, got, expected in outputs:
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return f"{name}: {got.dtype}{tuple(got.shape)} vs reference {expected.dtype}{tuple(expected.shape)}"
        if got.is_floating_point():
            got, expected = got.float(), expected.float()  # fp8 has no comparison ops on every device
            same = (got == expected) | (got.isnan() & expected.isnan())
        else:
            same = got == expected
        if not bool(same.all()):
            return f"{name}: {int((~same).sum())} of {got.numel()} elements differ from the reference"
    return None


def check_kernel_device(name: str, t: torch.Tensor) -> torch.device:
    """Kernels run on CUDA tensors, or on CPU tensors when the Triton interpreter is on."""
    if t.device.type == "cuda":
        return t.device
    if t.device.type == "cpu" and interpreting():
        return t.device
    raise ValueError(
        f"{name}: tensors on {t.device} need a CUDA device or TRITON_INTERPRET=1 (the Triton interpreter)"
    )


def check_device(name: str, device: object) -> torch.device:
    """``device`` (a ``torch.device`` or what ``torch.device()`` takes) as a ``torch.device`` this machine has;
    a ValueError naming ``name`` for anything else: not a device, a name torch does not know, a CUDA device
    without CUDA or past the last GPU."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name}: expected a torch.device or a device name, got {device!r}") from None
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{name}: {device} is not available ({torch.cuda.device_count()} CUDA devices)")
    return device


def check_positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return value


INT32_MAX = 2**31 - 1  # the kernels hold positions, slots, pages, columns and counts in int32


def check_int32(name: str, value, low: int = 1, high: int = INT32_MAX) -> int:
    """``value``, an ``int`` (not a bool) in ``[low, high]``; else a ``ValueError`` naming ``name``. Sizes that
    size an allocation or an int32 index are checked so before anything is allocated."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")
    return value
