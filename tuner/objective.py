"""What one trial does: check a config against the reference, then time it with the shared harness.

An :class:`Evaluator` holds one problem (kernel, phase, exact shape, device): the reference output of a
fresh random input set and rotated input sets for timing. Every check runs on a new copy of the same
inputs (``make_inputs`` with the same seed) and compares with the reference computed once; a kernel whose
``make_inputs`` turns out not to be deterministic in its seed gets the reference recomputed per check.
A config that breaks the constraint is rejected without running; one that raises or disagrees with the
reference is penalised; neither is ever timed or stored. Each failure carries its cause (:func:`failure_cause`):
``wrong result``, ``out of memory``, ``compile error`` or ``launch error``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dsa_triton.bench.harness import error_text, graph_time_or_nan, rotation, timed_us
from dsa_triton.registry import ConfigError, KernelSpec

PENALTY_US = 1e12  # the objective value of an invalid, failing or wrong config (minimised)
CHECK_SEED = 1234
# errors after which the CUDA context is unusable: the process has to end (the journal keeps the culprit)
FATAL_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address",
                     "illegal instruction", "device-side assert")


# the causes of a failed evaluation
WRONG, OOM, COMPILE, LAUNCH = "wrong result", "out of memory", "compile error", "launch error"
# frames of Triton's compiler: an exception that passed through one was raised while compiling or lowering
COMPILER_FRAMES = (("triton/compiler/compiler.py", "compile"), ("triton/compiler/code_generator.py", ""))


class DeviceLost(RuntimeError):
    """A config broke the CUDA context; nothing more can run in this process."""


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _in_compiler(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        if any(path.endswith(file) and name in ("", code.co_name) for file, name in COMPILER_FRAMES):
            return True
        tb = tb.tb_next
    return False


def failure_cause(exc: BaseException) -> str:
    """Why running a config raised: ``out of memory`` (``torch.OutOfMemoryError`` or a CUDA out-of-memory error),
    ``compile error`` (Triton's ``CompilationError``, a ptxas error, a kernel over the SM's shared memory or threads,
    or any exception raised inside Triton's compiler), else ``launch error``. The whole chain counts."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    chain = _chain(exc)
    if any(isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower().replace("_", " ")
           for e in chain):
        return OOM
    if any(isinstance(e, (CompilationError, PTXASError, OutOfResources)) or _in_compiler(e) for e in chain):
        return COMPILE
    return LAUNCH


@dataclass(frozen=True)
class Outcome:
    """``status``: ok (timed), invalid (constraint), error (raised), wrong (disagrees with the reference),
    fatal (raised and broke the CUDA context); ``cause``: why a run config failed (:func:`failure_cause`, or
    ``wrong result``), empty when it passed or was not run."""

    status: str
    us: float = math.nan
    detail: str = ""
    cause: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def value(self) -> float:
        """The objective: microseconds when ok, else the penalty."""
        return self.us if self.ok else PENALTY_US


def dtypes_text(inputs: dict[str, Any]) -> str:
    """``"idx=int32,q=bfloat16"``: the dtype of each tensor input, by name."""
    return ",".join(f"{k}={str(v.dtype).replace('torch.', '')}" for k, v in sorted(inputs.items())
                    if isinstance(v, torch.Tensor))


def same_inputs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bitwise equal tensors (NaN poison included) and equal plain values; other objects are trusted."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
        elif isinstance(x, (int, float, str)) and x != y and x == x:
            return False
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Evaluator:
    """Checks and times configs of ``spec`` on one exact ``shape``.

    ``warmup_ms`` / ``rep_ms`` are the timing budget of a trial (``time_us``); :meth:`time` takes others
    for the final measurements. ``rotate=False`` makes no timing input sets (an evaluator that only checks).

    Times are CUDA-graph replays when the kernel's call captures, else eager: the first timed config decides
    (``timing``: None until then, then "graph" or "eager"), and every later time of the evaluator, the baseline's
    included, is taken the same way. A later config whose call does not capture (another path that syncs) turns
    the evaluator eager for good: it is timed eagerly, not penalised, and the finalists, default and baseline
    of the record are all re-timed after the search, so a record never mixes graph and eager times (the search
    itself may then have ranked some graph times against eager ones, which favours the capturing configs).
    """

    def __init__(self, spec: KernelSpec, phase: str, shape: dict[str, int], device: torch.device | str,
                 warmup_ms: float = 10, rep_ms: float = 40, rotate: bool = True):
        self.spec, self.phase, self.shape = spec, phase, dict(shape)
        self.device = torch.device(device)
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.timing: str | None = None
        self.key = spec.shape_key(phase, self.shape)
        check_inputs = spec.make_inputs(phase, self.shape, self.device, CHECK_SEED)
        self.dtypes = dtypes_text(check_inputs)
        self.expected = spec.reference(check_inputs)
        if not same_inputs(check_inputs, spec.make_inputs(phase, self.shape, self.device, CHECK_SEED)):
            self.expected = None  # not reproducible: a reference per check
        del check_inputs
        cost = spec.cost(phase, self.shape)
        self.sets = rotation(lambda i: spec.make_inputs(phase, self.shape, self.device, CHECK_SEED + 1 + i),
                             cost.bytes, self.device) if rotate else []

    def check(self, config: dict[str, Any]) -> Outcome | None:
        """None when ``config`` is valid and agrees with the reference; else the failing outcome."""
        try:
            self.spec.validate(config, self.shape)
        except ConfigError as exc:
            return Outcome("invalid", detail=str(exc))
        try:
            inputs = self.spec.make_inputs(self.phase, self.shape, self.device, CHECK_SEED)
            out = self.spec.run(inputs, config)
            _sync(self.device)
            error = self.spec.compare(out, self.spec.reference(inputs) if self.expected is None else self.expected)
        except Exception as exc:  # a config that does not compile or launch is penalised
            return self._failure(exc)
        return Outcome("wrong", detail=str(error)[:300], cause=WRONG) if error else None

    def evaluate(self, config: dict[str, Any]) -> Outcome:
        """Check, then time with the trial budget."""
        failed = self.check(config)
        if failed is not None:
            return failed
        try:
            return Outcome("ok", self.time(config, self.warmup_ms, self.rep_ms))
        except Exception as exc:
            return self._failure(exc)

    def _failure(self, exc: Exception) -> Outcome:
        fatal = self.device.type == "cuda" and any(m in str(exc) for m in FATAL_CUDA_ERRORS)
        return Outcome("fatal" if fatal else "error", detail=error_text(exc),
                       cause=failure_cause(exc))

    def time(self, config: dict[str, Any], warmup_ms: float = 25, rep_ms: float = 100) -> float:
        """Median microseconds of the kernel with ``config`` over the rotated input sets (see ``timing``)."""
        mode = "eager" if self.timing == "eager" else "auto"  # auto: a call that does not capture is timed eagerly
        us, self.timing = timed_us(lambda s: self.spec.run(s, config), self.sets, self.device, mode,
                                   warmup_ms=warmup_ms, rep_ms=rep_ms)
        return us

    def time_all(self, configs: list[dict[str, Any]], warmup_ms: float = 25, rep_ms: float = 100) -> list[float]:
        """:meth:`time` of each config, all in one mode: again, eagerly, if one of them turned the evaluator eager."""
        times, modes = [], set()
        for config in configs:
            times.append(self.time(config, warmup_ms, rep_ms))
            modes.add(self.timing)
        if len(modes) > 1:  # graph first, then a config that does not capture: the evaluator is eager now
            times = [self.time(c, warmup_ms, rep_ms) for c in configs]
        return times

    def time_baseline(self, warmup_ms: float = 25, rep_ms: float = 100) -> float:
        """Median microseconds of what a user would run instead, timed as the kernel was (NaN when the kernel
        names none, or when the kernel was graph-timed and the baseline does not capture)."""
        if self.spec.baseline is None:
            return math.nan
        if self.timing == "graph":
            return graph_time_or_nan(self.spec.baseline, self.sets, self.device, warmup_ms=warmup_ms, rep_ms=rep_ms)
        return timed_us(self.spec.baseline, self.sets, self.device, self.timing or "auto",
                        warmup_ms=warmup_ms, rep_ms=rep_ms)[0]
