"""``host_access()``: what a call reads on the host, to check that it can be captured in a CUDA graph (the ops'
opchecks, the runners' decode steps). On the CPU nothing syncs, so the reads are caught where they start: the aten
ops that read device values on the host or give data-dependent shapes (``item``, ``nonzero``, ...; ``int()``,
``float()`` and ``bool()`` of a tensor run ``_local_scalar_dense``), ``Tensor.tolist`` / ``numpy`` (no aten op on
the CPU, a device-to-host copy on the GPU) and the files the call opens or looks at."""
import builtins
import contextlib
import io
import os

import torch

from dsa_triton.bench.reports.moe_decode import AtenOpCounter

READ_FREE = {torch.ops.aten.repeat_interleave.self_int}  # an int repeat count: an expand (a tensor of counts reads)


class HostReadCounter(AtenOpCounter):
    """An :class:`AtenOpCounter` whose ``syncing()`` leaves out the overloads of :data:`READ_FREE` (counted under
    their overload's name)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READ_FREE:
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def host_access():
    """Yields ``(counter, reads)``: the aten ops the code inside runs (a :class:`HostReadCounter`; its ``syncing()``
    are host reads of device values) and the other host reads: the files it opens or looks at, and
    ``Tensor.tolist`` / ``numpy`` (no aten op on the CPU, a device-to-host copy on the GPU). Kernels run unwatched:
    the interpreter's own torch ops and reads are not the op's."""
    from triton.runtime.interpreter import InterpretedFunction
    from torch.utils._python_dispatch import _disable_current_modes

    reads = []
    real = {(m, n): getattr(m, n) for m, n in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"),
                                                (os, "listdir"), (os, "scandir"), (torch.Tensor, "tolist"),
                                                (torch.Tensor, "numpy"))}
    run = InterpretedFunction.run

    def watched(m, n):
        def call(what, *args, **kwargs):
            reads.append(f"{n} {what if isinstance(what, (str, os.PathLike)) else type(what).__name__}")
            return real[(m, n)](what, *args, **kwargs)
        return call

    def watch(on: bool):
        for (m, n), f in real.items():
            setattr(m, n, watched(m, n) if on else f)

    def kernel_run(self, *args, **kwargs):
        watch(False)
        try:
            with _disable_current_modes():
                return run(self, *args, **kwargs)
        finally:
            watch(True)

    with HostReadCounter():  # a dispatch mode's first use imports torch._dynamo: its reads, not the code's
        torch.zeros(1).add_(1)
    counter = HostReadCounter()
    InterpretedFunction.run = kernel_run
    watch(True)
    try:
        with counter:
            yield counter, reads
    finally:
        watch(False)
        InterpretedFunction.run = run
