"""The property every public op must hold, and the generators the property tests share.

A generated :class:`Case` is one call of a public op on inputs that are either valid or made bad in one way (a
*mutation*: a dtype, a shape, a view, a value, an integer argument, a config). :func:`check` runs it and accepts
exactly two outcomes:

- a ``ValueError`` or ``TypeError`` (the registry's ``ConfigError`` is a ``ValueError``) whose message names one of
  the arguments the mutation touched, raised before any kernel launch, with every argument and every piece of
  state the case watches unchanged (bit for bit);
- a result the case's ``compare`` finds equal to its reference (the op's ``*_torch`` oracle), the call having
  changed none of its inputs unless it is an in-place op.

Anything else fails: another exception type (IndexError, RuntimeError, KeyError, ZeroDivisionError, an interpreter
error), a valid input rejected, an error that names none of the touched arguments, a launch or a state change before
the error, or a silent wrong answer. :func:`run_property` runs a strategy of cases through Hypothesis with fixed
settings (300 examples, derandomized: the same cases on every run) and checks that both outcomes occurred.

A strategy builds a valid call and hands :func:`mutate` a table of the mutations its op can suffer, by name; the
builders (:func:`tensor_arg`, :func:`int_arg`, :func:`real_arg`, :func:`choice_arg`, :func:`config_arg`,
:func:`element`, with :func:`checked` and :func:`one_of`) write the kinds every op shares once, here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections import Counter
from typing import Any, Callable

import torch
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dsa_triton  # noqa: F401  (interpreter on CPU)

EXAMPLES = int(os.environ.get("DSA_PROPERTY_EXAMPLES", "300"))  # fewer only for a quick local run
CLEAR_ERRORS = (ValueError, TypeError)  # ConfigError is a ValueError
# derandomized: the same cases on every run (CI reproduces a failure); no example database on disk
PROPERTY_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)


# -- kernel launches --------------------------------------------------------------------------------------------
class _Launches:
    count = 0


def _counted(run):
    def counted(*args, **kwargs):
        _Launches.count += 1
        return run(*args, **kwargs)
    return counted


@contextlib.contextmanager
def counting_launches():
    """Count every Triton launch (interpreter grids, and ``JITFunction.run`` on a GPU) until the block exits."""
    grid_call, jit_run = interpreter.GridExecutor.__call__, jit.JITFunction.run
    interpreter.GridExecutor.__call__, jit.JITFunction.run = _counted(grid_call), _counted(jit_run)
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, jit.JITFunction.run = grid_call, jit_run


# -- state snapshots ------------------------------------------------------------------------------------------
class _TensorSnapshot:
    """A tensor's dtype, shape, strides and bytes; equal when all of them are."""

    def __init__(self, t: torch.Tensor) -> None:
        self.meta = (t.dtype, tuple(t.shape), t.stride())
        self.data = t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)

    def __eq__(self, other) -> bool:
        return isinstance(other, _TensorSnapshot) and self.meta == other.meta and torch.equal(self.data, other.data)


def snapshot(value):
    """A deep, bit-exact copy of the tensors and plain values inside lists, tuples, dicts and dataclasses; other
    objects by identity (a case's ``state`` lists what of them matters). Compare two with ``==``."""
    if isinstance(value, torch.Tensor):
        return _TensorSnapshot(value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [snapshot(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(k, snapshot(v)) for k, v in value.items()])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, [(f.name, snapshot(getattr(value, f.name))) for f in dataclasses.fields(value)
                                       if f.compare])  # (not caches, such as ExpertSort's alignments)
    if isinstance(value, (int, float, str, bytes, bool, type(None), torch.dtype, torch.device)):
        return ("value", value)
    return ("object", id(value))


def describe(value) -> str:
    """Short text of an argument for a failure report: tensors by dtype, shape, strides and small values."""
    if isinstance(value, torch.Tensor):
        text = f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
        if not value.is_contiguous():
            text += f" strides {value.stride()}"
        if value.numel() <= 24:
            text += f" = {value.detach().float().tolist() if value.dtype.itemsize == 1 and value.is_floating_point() else value.tolist()}"
        return text
    if isinstance(value, (list, tuple)) and len(value) <= 24:
        return f"{type(value).__name__}({', '.join(describe(v) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    return repr(value) if len(repr(value)) <= 200 else repr(value)[:200] + "..."


# -- cases ---------------------------------------------------------------------------------------------------
class Case:
    """One generated call. ``names``: the arguments an error may name (empty: the call must succeed);
    ``reference()`` and ``compare(out, expected)`` judge a result; ``state()`` is what a raise must leave unchanged
    (default: every argument); ``pure``: a successful call changes no argument either; ``launch_before_error``:
    the op documents a launch ahead of this check (into buffers of its own)."""

    def __init__(self, op: str, mutation: str, args: dict, call: Callable[[], Any], names: tuple[str, ...] = (),
                 reference: Callable[[], Any] | None = None, compare: Callable[[Any, Any], str | None] | None = None,
                 state: Callable[[], Any] | None = None, pure: bool = True, launch_before_error: bool = False):
        self.op, self.mutation, self.args, self.call, self.names = op, mutation, args, call, tuple(names)
        self.reference, self.compare, self.state, self.pure = reference, compare, state, pure
        self.launch_before_error = launch_before_error

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={describe(v)}" for k, v in self.args.items())
        return f"Case({self.op} [{self.mutation}]: {args})"


def names_any(message: str, names) -> bool:
    """Whether ``message`` names one of ``names`` as a word (``k`` in "k: at most", not in "block")."""
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def check(case: Case) -> str:
    """Run ``case``; returns ``"error"`` (a clear error) or ``"ok"`` (equal to the reference); fails otherwise."""
    watched = case.state or (lambda: case.args)
    before = snapshot(watched())
    with counting_launches():
        launched = _Launches.count
        try:
            out = case.call()
        except CLEAR_ERRORS as error:
            message = f"{type(error).__name__}: {error}"
            assert case.names, f"{case!r}\nvalid input rejected: {message}"
            assert names_any(str(error), case.names), f"{case!r}\nthe error names none of {case.names}: {message}"
            assert case.launch_before_error or _Launches.count == launched, f"{case!r}\nraised after a launch: {message}"
            assert snapshot(watched()) == before, f"{case!r}\nthe raising call changed state: {message}"
            return "error"
    if case.pure:
        assert snapshot(watched()) == before, f"{case!r}\nthe call changed its inputs"
    case.launches = _Launches.count - launched
    problem = case.compare(out, case.reference())
    assert problem is None, f"{case!r}\nresult differs from the reference: {problem}"
    return "ok"


def run_property(cases, *, examples=(), min_ok: int = 20, min_launched: int = 10, min_error: int = 20) -> Counter:
    """Check every case of the strategy ``cases`` (300 generated, plus ``examples``: cases kept explicitly, found
    defects among them). Both outcomes must occur often enough that the property can fail either way: at least
    ``min_ok`` results equal to the reference (``min_launched`` of them from a kernel) and ``min_error`` errors; and
    every one of the 300 must have been generated (none cut short)."""
    tally: Counter = Counter()

    @PROPERTY_SETTINGS
    @given(case=cases)
    def prop(case):
        outcome = check(case)
        tally["cases"] += 1
        tally[outcome] += 1
        tally["launched"] += outcome == "ok" and case.launches > 0
        tally[(case.mutation.split()[0], outcome)] += 1

    for case in examples:
        prop = example(case=case)(prop)
    prop()
    assert tally["cases"] - len(examples) >= EXAMPLES, f"{tally['cases']} cases, {len(examples)} of them given"
    assert tally["ok"] >= min_ok and tally["launched"] >= min_launched and tally["error"] >= min_error, (
        f"too few of an outcome: {dict(tally)}")
    print(dict(tally))  # (shown with pytest -s: how the cases fell)
    return tally


# -- comparisons ---------------------------------------------------------------------------------------------
def nan_split(out: torch.Tensor, ref: torch.Tensor):
    """``(problem, out, ref)``: NaN and each sign of infinity must sit at the same places (NaN in, NaN out); the
    rest returned with them as 0, for a comparison of the finite values."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}", out, ref
    o, r = out.float(), ref.float()
    for name, same in (("NaN", lambda t: t.isnan()), ("+inf", lambda t: t == math.inf), ("-inf", lambda t: t == -math.inf)):
        if not torch.equal(same(o), same(r)):
            return f"{name} at {int((same(o) != same(r)).sum())} places that differ from the reference", out, ref
    return None, torch.where(o.isfinite(), o, 0.0).to(out.dtype), torch.where(r.isfinite(), r, 0.0).to(ref.dtype)


def nan_aware(compare):
    """``compare`` of single tensors, after :func:`nan_split`."""
    def compared(out, ref):
        problem, out, ref = nan_split(out, ref)
        return problem or compare(out, ref)
    return compared


def exact(out, ref) -> str | None:
    """Equal dtype, shape and bits (NaN equals NaN), for tensors or tuples of them."""
    from dsa_triton.checks import exact_mismatch

    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if len(outs) != len(refs):
        return f"{len(outs)} outputs, reference {len(refs)}"
    return exact_mismatch((f"output {i}", a, b) for i, (a, b) in enumerate(zip(outs, refs)))


def rejecting(compare):
    """``compare``, where a reference of None stands for input the op must reject: a result is a failure."""
    def compared(out, ref):
        return "accepted input it must reject" if ref is None else compare(out, ref)
    return compared


# -- mutations -----------------------------------------------------------------------------------------------
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.int8, torch.bool, torch.float8_e4m3fn)


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn or dtype == torch.float8_e4m3fn:
        return t.float().nan_to_num(0.0).clamp(-448, 448).to(dtype) if dtype == torch.float8_e4m3fn else t.float().to(dtype)
    if not dtype.is_floating_point and dtype != torch.bool:
        return t.float().nan_to_num(0.0, 0.0, 0.0).clamp(-100, 100).to(dtype)
    return t.to(dtype)


def _with_dim(t: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """``t`` with dimension ``axis`` resized to ``size`` (cut, or grown by repeating its slices)."""
    n = t.shape[axis]
    if size <= n:
        return t.narrow(axis, 0, size).clone()
    if n == 0:
        return torch.zeros(*t.shape[:axis], size, *t.shape[axis + 1:], dtype=t.dtype)
    reps = [1] * t.dim()
    reps[axis] = -(-size // n)
    return t.repeat(*reps).narrow(axis, 0, size).clone()


def strided_last(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dimension of stride 2."""
    return torch.stack([t, t], -1).select(-1, 0)


def strided_rows(t: torch.Tensor) -> torch.Tensor:
    """Same values, rows further apart than their width (the last dimension stays contiguous)."""
    if t.dim() < 2:
        return strided_last(t)
    return torch.cat([t, t], -1).narrow(-1, 0, t.shape[-1])


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, stored column-major (the last two dimensions swapped in memory)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else strided_last(t)


def offset_view(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, contiguous, at a storage offset of one element (a misaligned pointer)."""
    flat = t.reshape(-1)
    return torch.cat([flat[:1], flat])[1:].view(t.shape) if flat.numel() else t.clone()


@st.composite
def bad_tensor(draw, t: torch.Tensor, *, dtypes=(), shape_ok: bool = False):
    """``(value, kind)``: ``t`` made bad (or a view that an op may accept): another dtype (not in ``dtypes``), a
    dimension resized, one more or one less dimension, a non-contiguous or misaligned view, a list, None, a
    scalar. ``shape_ok`` leaves out the shape changes (for tensors whose shape nothing else pins)."""
    kinds = ["None", "list", "scalar", "dtype", "strided_last", "strided_rows", "transposed", "offset", "int"]
    if not shape_ok:
        kinds += ["dim", "dim", "ndim+", "ndim-"]
    kind = draw(st.sampled_from(kinds))
    if kind == "None":
        return None, kind
    if kind == "list":
        return (t.float() if t.dtype == torch.float8_e4m3fn else t).tolist(), kind
    if kind == "int":
        return 3, kind
    if kind == "scalar":
        return _convert(torch.tensor(1.0), t.dtype), kind
    if kind == "dtype":
        others = [d for d in DTYPES if d != t.dtype and d not in dtypes]
        dtype = draw(st.sampled_from(others))
        return _convert(t, dtype), f"dtype {str(dtype).replace('torch.', '')}"
    if kind == "dim":
        if t.dim() == 0:
            return t.reshape(1), kind
        axis = draw(st.integers(0, t.dim() - 1))
        n = t.shape[axis]
        size = draw(st.sampled_from(sorted({0, max(n - 1, 0), n + 1, 2 * n + 1} - {n})))
        return _with_dim(t, axis, size), f"dim {axis} -> {size}"
    if kind == "ndim+":
        return t.unsqueeze(draw(st.sampled_from([0, t.dim()]))).clone(), kind
    if kind == "ndim-":
        if t.dim() <= 1:
            return (t.reshape(-1)[:1].reshape(()) if t.numel() else torch.zeros((), dtype=t.dtype)).clone(), kind
        return t.flatten(0, 1).clone(), kind
    view = {"strided_last": strided_last, "strided_rows": strided_rows, "transposed": transposed,
            "offset": offset_view}[kind]
    return view(t), kind


def bad_int(draw, value, *, allow_none: bool = False, huge: bool = True):
    """``(value, kind)``: an integer argument made bad: a float of it, a bool, 0, negative, huge (not for sizes of
    an allocation, which may just run out of memory), None, a string, a one-element tensor."""
    options = [("float", float(value) if value is not None else 1.5), ("bool", True), ("false", False),
               ("zero", 0), ("negative", -1), ("string", str(value)),
               ("tensor", torch.tensor(value if value is not None else 1)), ("fraction", 1.5)]
    if huge:
        options.append(("huge", 2**31))
    if not allow_none:
        options.append(("None", None))
    kind, bad = draw(st.sampled_from(options))
    return bad, kind


def bad_real(draw):
    """``(value, kind)``: a real argument made bad: NaN, an infinity, a bool, a string, None, a tensor."""
    kind, bad = draw(st.sampled_from([("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("bool", True),
                                      ("string", "0.5"), ("None", None), ("tensor", torch.tensor([0.5, 0.5]))]))
    return bad, kind


def bad_config(draw, spec) -> tuple[Any, str, tuple[str, ...]]:
    """``(config, kind, names)``: a config drawn from ``spec``'s space (valid or breaking its constraint for the
    call's shape), or one made bad: an unknown, missing, mistyped (``16.0``, ``True``, a string) or out-of-space
    parameter, or not a dict at all. ``names``: what an error may name."""
    space = spec.space
    config = {k: draw(st.sampled_from(v)) for k, v in space.items()}
    kind = draw(st.sampled_from(["space", "space", "unknown", "missing", "float", "bool", "string", "outside",
                                 "list", "none-dict", "empty"]))
    key = draw(st.sampled_from(sorted(space)))
    names = (key, "config", spec.name)
    if kind == "space":
        return config, "config from the space", ("config", spec.name, *space)
    if kind == "unknown":
        config["NOT_A_PARAMETER"] = 1
        return config, "unknown parameter", ("NOT_A_PARAMETER", "config", spec.name)
    if kind == "missing":
        del config[key]
        return config, f"missing {key}", names
    if kind == "float":
        value = config[key]
        config[key] = float(value) if isinstance(value, int) and not isinstance(value, bool) else 1.5
        return config, f"{key} float", names
    if kind == "bool":
        config[key] = True
        return config, f"{key} bool", names
    if kind == "string":
        config[key] = str(config[key])
        return config, f"{key} string", names
    if kind == "outside":
        values = [v for v in space[key] if isinstance(v, int) and not isinstance(v, bool)]
        config[key] = (max(values) * 2 + 1) if values else "bogus"
        return config, f"{key} outside the space", names
    if kind == "list":
        return list(config.items()), "config as a list", ("config", spec.name)
    if kind == "none-dict":
        return 7, "config an int", ("config", spec.name)
    return {}, "empty config", ("config", spec.name, *space)


# A *mutation* makes a valid call's arguments bad in one way: ``mutation(draw, args)`` changes ``args`` in place and
# returns ``(kind, names)``, what it did and the arguments an error may name (empty: the call must still succeed),
# or None where it does not apply (the case stays valid). The builders below cover the kinds every op shares; a
# test file writes a plain function of ``(draw, args)`` only for a mutation of its own.
Mutation = Callable[[Any, dict], "tuple[str, tuple[str, ...]] | None"]


def mutate(draw, args: dict, mutations: dict[str, Mutation | None], mutation: str | None = None):
    """Apply one of ``mutations`` (drawn from its keys in their order unless ``mutation`` is given; a key of None,
    such as ``"valid"``, changes nothing) to ``args``; returns ``(label, names)``: ``("valid", ())`` where the drawn
    mutation does not apply, else ``"<key> <kind>"`` and what an error may name."""
    if mutation is None:
        mutation = draw(st.sampled_from(list(mutations)))
    apply = mutations[mutation]
    done = apply(draw, args) if apply is not None else None
    if done is None:
        return "valid", ()
    kind, names = done
    return f"{mutation} {kind}".strip(), tuple(names)


def _applies(mutation: Mutation, args: dict) -> bool:
    return all(args.get(name) is not None for name in getattr(mutation, "needs", ()))


def _needing(needs: tuple[str, ...], apply: Mutation) -> Mutation:
    """``apply``, applied only where every argument of ``needs`` is given and not None."""
    def mutation(draw, args):
        return apply(draw, args) if _applies(mutation, args) else None
    mutation.needs = needs
    return mutation


def tensor_arg(arg: str, dtypes=(), names=None, *, shape_ok: bool = False, like=None, none=None) -> Mutation:
    """``args[arg]`` made bad by :func:`bad_tensor` (``dtypes``: the valid ones). ``like(args)``: the tensor to
    start from where the argument is optional (else the mutation needs it); ``none``: the ``(value, kind)`` that
    replaces the None kind where None is valid. ``names``: default ``(arg,)``. A resized tensor turns
    ``args["check_values"]`` on where the case has it: the values of other arguments may index past its new size,
    which unchecked is a broken promise (what the kernels then read is unspecified)."""
    def apply(draw, args):
        value, kind = draw(bad_tensor(args[arg] if like is None else like(args), dtypes=dtypes, shape_ok=shape_ok))
        args[arg], kind = none if kind == "None" and none is not None else (value, kind)
        if kind.split()[0] in ("dim", "ndim+", "ndim-") and "check_values" in args:
            args["check_values"] = True
        return kind, (arg,) if names is None else names
    return apply if like is not None else _needing((arg,), apply)


def int_arg(arg: str, value=None, names=None, *, special=(), **options) -> Mutation:
    """``args[arg]`` made bad by :func:`bad_int` of ``value`` (default the argument's own; ``options``: its
    keywords), or half the time one of the ``(value, kind)`` of ``special``. ``names``: default ``(arg,)``."""
    def apply(draw, args):
        if special and draw(st.booleans()):
            args[arg], kind = draw(st.sampled_from(special))
        else:
            args[arg], kind = bad_int(draw, args[arg] if value is None else value, **options)
        return kind, (arg,) if names is None else names
    return apply


def real_arg(arg: str, names=None, *, special=()) -> Mutation:
    """``args[arg]`` made bad by :func:`bad_real`, or half the time one of the ``(value, kind)`` of ``special``."""
    def apply(draw, args):
        args[arg], kind = draw(st.sampled_from(special)) if special and draw(st.booleans()) else bad_real(draw)
        return kind, (arg,) if names is None else names
    return apply


def choice_arg(arg: str, values, names=None) -> Mutation:
    """``args[arg]`` set to one of ``values`` (of another type, unknown, out of range). ``names``: default
    ``(arg,)``."""
    def apply(draw, args):
        args[arg] = draw(st.sampled_from(values))
        return describe(args[arg])[:40], (arg,) if names is None else names
    return apply


def config_arg(spec) -> Mutation:
    """``args["config"]``: a config of :func:`bad_config` (from ``spec``'s space, or made bad)."""
    def apply(draw, args):
        args["config"], kind, names = bad_config(draw, spec)
        return kind, names
    return apply


def element(targets, values, names=None, *, if_checked: bool = False, like=None) -> Mutation:
    """One element of ``args[target]`` set to one of ``values`` (in place, so views keep their layout: the case's own
    tensor; the bytes of a one-byte float tensor). ``targets``: one name, or several to draw one from among those
    given; ``like(args)``: the tensor to start from where the one argument may be None. Not applied to an empty
    tensor. ``names``: default ``(target,)``; ``if_checked``: only with ``args["check_values"]`` on (off: NaN in,
    NaN out)."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)

    def apply(draw, args):
        live = [t for t in targets if like is not None or args.get(t) is not None]
        target = draw(st.sampled_from(live)) if len(live) > 1 else (live or [None])[0]
        t = None if target is None else (args[target] if like is None else like(args))
        if t is None or not t.numel():
            return None
        value = draw(st.sampled_from(values))
        at = torch.unravel_index(torch.tensor(draw(st.integers(0, t.numel() - 1))), t.shape)
        (t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t)[at] = value
        args[target] = t
        named = (target,) if names is None else names
        return f"{target}={value}", named if args.get("check_values") or not if_checked else ()
    return apply


def checked(mutation: Mutation, flag: str = "check_values") -> Mutation:
    """``mutation`` with ``args[flag]`` set: values the op checks only on request (unchecked, the call's promise)."""
    def apply(draw, args):
        done = mutation(draw, args)
        if done is not None:
            args[flag] = True
        return done
    return _needing(getattr(mutation, "needs", ()), apply)


def one_of(*mutations: Mutation) -> Mutation:
    """One of ``mutations`` (drawn among those that apply to the case)."""
    def apply(draw, args):
        live = [m for m in mutations if _applies(m, args)]
        return draw(st.sampled_from(live))(draw, args) if live else None
    return apply


def all_slots_free(workspace) -> bool:
    """Whether every slot of an ``FP8Workspace`` is free (a lease of all of them is granted at once)."""
    try:
        with workspace.acquire(workspace.slots, timeout=0):
            return True
    except TimeoutError:
        return False


def generator(draw) -> torch.Generator:
    """A torch generator seeded from the draw: tensors come from it (fast), their shape from Hypothesis."""
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
