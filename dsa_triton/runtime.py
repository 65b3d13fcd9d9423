"""Where kernels run: a CUDA GPU, or the Triton interpreter on the CPU.

Imported first by ``dsa_triton/__init__.py``: on a machine without a GPU it sets
``TRITON_INTERPRET=1`` before any ``@triton.jit`` is evaluated, so every kernel runs on CPU tensors.
"""
from __future__ import annotations

import ctypes
import functools
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


DEFAULT_STACK_BYTES = 1024  # the CUDA driver's per-thread stack size at context creation
CU_LIMIT_STACK_SIZE = 0


@functools.cache
def _driver():
    """The CUDA driver library (libcuda), or None without one."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def stack_bytes(device: torch.device | str | None = None) -> int | None:
    """The per-thread stack (local memory) size of ``device``'s context, or None off CUDA.

    The driver grows it to what the most demanding kernel launched so far needs (a kernel that spills) and never
    shrinks it on its own; the context keeps ``stack x the device's resident threads`` of device memory for it,
    outside PyTorch's allocator (:func:`device_memory`)."""
    driver = _driver()
    if driver is None or not torch.cuda.is_available() or torch.device(device or "cuda").type != "cuda":
        return None
    torch.cuda.synchronize(device)  # the primary context is current on this thread
    value = ctypes.c_size_t()
    if driver.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_STACK_SIZE) != 0:
        return None
    return int(value.value)


ALLOCATOR_SETTINGS = "expandable_segments:True"


def prefer_expandable_segments() -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`ALLOCATOR_SETTINGS` for this process and its children unless the user
    set it, before CUDA starts (no effect after: the allocator reads it once). For processes that allocate many
    large, short-lived problems one after another (the tuner): a day0 run on the H100 failed 8-16 GiB allocations
    with 40-44 GiB reserved but unallocated, which we read as fixed segments pinned by a few live blocks (not
    verified; expandable segments give unused pages back). Returns whether it set it."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS
    return True


def release_cached_memory(device: torch.device | str | None = None) -> None:
    """Return the caching allocator's free blocks to the device, with the cuBLAS workspaces torch keeps per stream
    (allocated from the caching allocator wherever a free block was, each can pin its segment against
    ``empty_cache``); nothing off CUDA."""
    if not torch.cuda.is_available() or torch.device(device or "cuda").type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # (torch keeps no public name for it)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def release_stack(device: torch.device | str | None = None, size: int = DEFAULT_STACK_BYTES) -> bool:
    """Shrink the context's per-thread stack back to ``size`` bytes, which frees the local memory that spilling
    kernels made the driver reserve (the next such launch grows it again); False off CUDA or when the driver
    refuses."""
    driver = _driver()
    if driver is None or not torch.cuda.is_available() or torch.device(device or "cuda").type != "cuda":
        return False
    torch.cuda.synchronize(device)
    return driver.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(size)) == 0


def device_memory(device: torch.device | str | None = None) -> dict[str, int] | None:
    """Bytes of ``device``: ``total``, ``free``, ``reserved`` by PyTorch's caching allocator, and ``outside`` it
    (``total - free - reserved``: the contexts' own memory, local memory for spilling kernels, libraries'
    workspaces, other processes); None off CUDA."""
    if not torch.cuda.is_available() or torch.device(device or "cuda").type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"total": total, "free": free, "reserved": reserved, "outside": total - free - reserved}
