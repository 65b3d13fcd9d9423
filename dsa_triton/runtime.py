"""Where kernels run: a CUDA GPU, or the Triton interpreter on the CPU.

Imported first by ``dsa_triton/__init__.py``: on a machine without a GPU it sets
``TRITON_INTERPRET=1`` before any ``@triton.jit`` is evaluated, so every kernel runs on CPU tensors.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_device() -> torch.device:
    """The device ops and benchmarks use by default: ``cuda`` unless the interpreter is on."""
    return torch.device("cpu" if interpreting() or not torch.cuda.is_available() else "cuda")


def device_name(device: torch.device | str | None = None) -> str:
    """A short, file-name-safe device name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``, CPU -> ``"cpu-interpreter"``."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return "cpu-interpreter"
    return torch.cuda.get_device_name(device).lower().replace(" ", "-")


def environment() -> dict[str, str]:
    """Device, library versions and interpreter state, for results files and ``dsa-tune env``."""
    import triton

    info = {
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpreter": str(interpreting()),
        "cuda": str(torch.version.cuda),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["sms"] = str(props.multi_processor_count)
        info["memory_gib"] = f"{props.total_memory / 2**30:.0f}"
    return info
