"""The shared FP8 workspace: one allocation of expert slots that the online MXFP4 -> FP8 conversion writes
and the prefill grouped GEMM reads, reused by every layer instead of an offline FP8 copy of all experts.

A slot holds one expert's weight matrix (up to the largest ``[N, K]`` it was sized for) in e4m3 plus its
fp32 scales ``[N, ceil(K/128)]``. :meth:`FP8Workspace.acquire` leases a run of adjacent slots under a
lock (threads wait for a free run); on CUDA the lease also orders the GPU work: the acquiring stream
waits for the event the previous holder recorded at release, so a slot is never overwritten while a
kernel of an earlier lease still reads it. :func:`shared_workspace` keeps one per device, grown to the
peak of the largest grouped GEMM asked of it.
"""
from __future__ import annotations

import contextlib
import numbers
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ..checks import check_device
from ..hostmath import cdiv
from .formats import n_groups
from .formats import BLOCK

ALIGN = 256  # slot starts aligned to 256 bytes (16-byte vector loads, TMA-friendly)


@dataclass(frozen=True)
class WorkspaceLease:
    """Slots ``first .. first + count - 1`` of ``workspace``, held until the ``acquire`` block exits."""

    workspace: "FP8Workspace"
    first: int
    count: int

    def views(self, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w float8_e4m3fn [count, n, k], scale fp32 [count, n, ceil(k/128)])`` over the leased slots.

        The scales are stored group-major (strides ``(slot, 1, n)``): a GEMM tile reads one group's scales
        of consecutive rows as one coalesced vector."""
        ws = self.workspace
        n, k = _whole("n", n), _whole("k", k)
        if n * k > ws.slot_elems or n * n_groups(k) > ws.slot_scales:
            raise ValueError(f"views: an [{n}, {k}] matrix does not fit a slot sized for {ws.shapes}")
        rows = slice(self.first, self.first + self.count)
        return (ws.weights[rows, : n * k].view(self.count, n, k),
                ws.scales[rows, : n * n_groups(k)].view(self.count, n_groups(k), n).transpose(1, 2))


class FP8Workspace:
    """``slots`` expert slots, each big enough for every ``(N, K)`` in ``shapes``, on ``device``.

    A ``slots`` or a shape that is not an integer in ``[1, 2^31 - 1]``, or a device this machine does not have, raises
    a ValueError naming it before anything is allocated."""

    def __init__(self, slots: int, shapes: Iterable[tuple[int, int]], device: torch.device | str):
        self.slots = _whole("slots", slots)
        try:
            pairs = [tuple(shape) for shape in shapes]
            self.shapes = tuple(sorted({(_whole("n", n), _whole("k", k)) for n, k in pairs}))
        except (TypeError, ValueError):
            raise ValueError(f"shapes: expected (N, K) pairs of integers in [1, 2^31 - 1], got {shapes!r}") from None
        if not self.shapes:
            raise ValueError("shapes: needs at least one (N, K) pair")
        self.device = check_device("device", device)
        self.slot_elems = cdiv(max(n * k for n, k in self.shapes), ALIGN) * ALIGN
        self.slot_scales = cdiv(max(n * n_groups(k) for n, k in self.shapes), ALIGN // 4) * (ALIGN // 4)
        self.weights = torch.empty(self.slots, self.slot_elems, dtype=torch.float8_e4m3fn, device=self.device)
        self.scales = torch.empty(self.slots, self.slot_scales, dtype=torch.float32, device=self.device)
        self._busy = [False] * self.slots
        self._released: list[torch.cuda.Event | None] = [None] * self.slots
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * self.weights.element_size() + self.scales.numel() * self.scales.element_size()

    def holds(self, count: int, n: int, k: int) -> bool:
        """Whether ``count`` slots of ``[n, k]`` matrices fit this workspace."""
        return count <= self.slots and n * k <= self.slot_elems and n * n_groups(k) <= self.slot_scales

    def _free_run(self, count: int) -> int | None:
        run = 0
        for i, busy in enumerate(self._busy):
            run = 0 if busy else run + 1
            if run == count:
                return i - count + 1
        return None

    @contextlib.contextmanager
    def acquire(self, count: int = 1, timeout: float | None = None) -> Iterator[WorkspaceLease]:
        """Lease ``count`` adjacent slots (waiting up to ``timeout`` seconds for them; ``TimeoutError`` after).
        A ``count`` that is not an integer in ``1..slots`` or a negative ``timeout`` raises ``ValueError`` before
        anything is taken.

        On CUDA the current stream first waits for the GPU work of the slots' previous holders, and the
        release records where this holder's work ends on the current stream.
        """
        if not _is_whole(count) or not 0 < count <= self.slots:
            raise ValueError(f"count: must be an integer in 1..{self.slots}, got {count!r}")
        if timeout is not None and (not isinstance(timeout, numbers.Real) or isinstance(timeout, bool)
                                    or not timeout >= 0):
            raise ValueError(f"timeout: must be None or a number of seconds >= 0, got {timeout!r}")
        with self._cond:
            if not self._cond.wait_for(lambda: self._free_run(count) is not None, timeout):
                raise TimeoutError(f"acquire: no {count} adjacent free slots within {timeout} s")
            first = self._free_run(count)
            for i in range(first, first + count):
                self._busy[i] = True
            pending = [e for e in self._released[first:first + count] if e is not None]
        try:
            if self.device.type == "cuda":
                stream = torch.cuda.current_stream(self.device)
                for event in pending:
                    stream.wait_event(event)
            yield WorkspaceLease(self, first, count)
        finally:
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            with self._cond:
                for i in range(first, first + count):
                    self._busy[i] = False
                    self._released[i] = event
                self._cond.notify_all()

    def report(self, experts: int, shapes: Iterable[tuple[int, int]], layers: int) -> dict[str, float]:
        """Bytes of this workspace next to copies of ``experts`` experts x ``shapes`` ((N, K) per matrix) x ``layers``."""
        shapes = list(shapes)
        per_layer = lambda bytes_of: experts * sum(bytes_of(n, k) for n, k in shapes)
        offline_fp8 = layers * per_layer(lambda n, k: n * k + 4 * n * n_groups(k))
        return {
            "workspace_bytes": self.nbytes,
            "mxfp4_bytes": layers * per_layer(lambda n, k: n * k // 2 + n * k // BLOCK),
            "offline_fp8_bytes": offline_fp8,
            "bf16_bytes": layers * per_layer(lambda n, k: 2 * n * k),
            "workspace_fraction_of_offline_fp8": self.nbytes / offline_fp8,
        }


def _is_whole(value) -> bool:
    """An integer proper (numpy's too), not a bool: a float count of slots can never be met."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _whole(name: str, value) -> int:
    """A positive integer up to 2^31 - 1 (the kernels' int32 sizes), checked before anything is allocated."""
    if not _is_whole(value) or not 0 < value < 2**31:
        raise ValueError(f"{name}: must be an integer in [1, {2**31 - 1}], got {value!r}")
    return int(value)


_shared: dict[str, FP8Workspace] = {}
_shared_lock = threading.Lock()


def shared_workspace(device: torch.device | str, slots: int, n: int, k: int) -> FP8Workspace:
    """The process-wide workspace of ``device``, holding at least ``slots`` slots of ``[n, k]``.

    Every layer's prefill GEMM asks here, so the one allocation ends up sized for the largest request
    (slots and matrix); when a request needs more, a larger one replaces it (leases of the old one stay
    valid until they end, then it is freed).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _shared_lock:
        ws = _shared.get(str(device))
        if ws is None or not ws.holds(slots, n, k):
            old_slots, old_shapes = (ws.slots, ws.shapes) if ws is not None else (0, ())
            ws = FP8Workspace(max(slots, old_slots), (*old_shapes, (n, k)), device)
            _shared[str(device)] = ws
        return ws


def release_shared_workspaces() -> None:
    """Drop the process-wide workspaces (:func:`shared_workspace`): leases in flight keep theirs until they end, the
    next request allocates anew (a bench or tuner between jobs: the largest request so far no longer holds memory)."""
    with _shared_lock:
        _shared.clear()
