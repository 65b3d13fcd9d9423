"""dsa_triton.launch on the CPU: the lean path's key against Triton's own cache key (Triton's binder, built for the
CUDA backend without a GPU), hits and misses with a stand-in compiled kernel, and the interpreter's fallback. CPU
tensors that say they are on a CUDA device (:class:`CudaTensor`) stand in for CUDA tensors: the lean path keeps no
fast key of any other. The compiled hit takes no subclass (it hands those to the Python hit function), so its own
tests set ``FAST_DEVICE`` to the CPU's type, where plain CPU tensors are the ones a hit launches by address, and run
the same calls through the Python functions alone, the reference."""
import copy
import itertools
import random

import pytest
import torch
import triton.language as tl
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

import dsa_triton as dt
from dsa_triton import launch as lean
from dsa_triton.plans import cached
from dsa_triton import launch_hit
from dsa_triton.attention.topk_indices_kernels import topk_select_kernel

GLOBAL_LIMIT = tl.constexpr(4)  # a global the kernel below reads


def kernel_body(x_ptr, y_ptr, n, stride, flag, scale, maybe, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
    tl.static_assert(GLOBAL_LIMIT > 0)


def jit_kernel() -> JITFunction:
    """A compiled-mode JITFunction (the interpreter's ``triton.jit`` gives an InterpretedFunction)."""
    return JITFunction(kernel_body)


def triton_key(fn: JITFunction, args: tuple, meta: dict) -> str:
    """Triton's own kernel-cache key of a launch (``JITFunction.run``: binder, then ``compute_cache_key``)."""
    binder = create_function_from_signature(fn.signature, fn.params, CUDABackend)
    meta = dict(meta, debug=False, instrumentation_mode="")
    _, specialization, options = binder(*args, **meta)
    return compute_cache_key({}, specialization, options)


def lean_key(fn: JITFunction, args: tuple, meta: dict):
    return lean.LeanKernel(fn).layout_functions(args, meta).key(args, meta, 0)


def fast_key(fn: JITFunction, args: tuple, meta: dict):
    """The fast key of a launch from the layout functions of one LeanKernel of ``fn`` (the tokens of keyword values
    are a layout's own)."""
    state = fn.__dict__.setdefault("_test_lean", lean.LeanKernel(fn))
    state.key(args, meta, 0)  # (builds the call's layout first)
    for layout in state.layouts:
        try:
            return layout.fast_key(args, meta, 0)[0]
        except Exception:  # another layout's
            continue


class CudaTensor(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (its slices and conversions too)."""
    is_cuda = True


def cuda_empty(n: int) -> CudaTensor:
    return torch.empty(n).as_subclass(CudaTensor)


BASE = cuda_empty(64)
BASE_ARGS = (BASE, BASE, 32, 17, True, 0.5, None)
INTS = [0, 1, 2, 15, 16, 17, -16, -1, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63,
        2**64 - 16]


def random_launch(r: random.Random) -> tuple[tuple, dict]:
    """A base launch with one or two of its arguments changed (so that many launches share a key)."""
    args = [BASE, BASE, 32, 17, True, 0.5, None]
    meta = {"BLOCK": 16, "num_warps": 4}
    for _ in range(r.randrange(1, 3)):
        field = r.randrange(9)
        if field == 0:
            args[0] = BASE[r.randrange(0, 8):]  # 16-byte aligned or not
        elif field == 1:
            args[1] = BASE.to(r.choice([torch.float16, torch.int32, torch.float32]))[r.choice([0, 0, 2, 4]):]
        elif field in (2, 3):
            args[field] = r.choice(INTS)
        elif field == 4:
            args[4] = r.random() < 0.5
        elif field == 5:
            args[5] = r.choice([0.5, -0.0, 3.0])
        elif field == 6:
            meta["BLOCK"] = r.choice([16, 32, True, 1])
        elif field == 7:
            meta["num_warps"] = r.choice([4, 8])
        else:
            meta["MODE"] = r.choice([2, 3])
    return tuple(args), meta


def coarser_than_triton(key_of, pairs=400, seed=0) -> list:
    """Pairs of launches whose keys under ``key_of`` agree while Triton's differ (a stale specialization)."""
    fn, r = jit_kernel(), random.Random(seed)
    launches = [random_launch(r) for _ in range(pairs)]
    by_key = {}
    for args, meta in launches:
        by_key.setdefault(key_of(fn, args, meta), set()).add(triton_key(fn, args, meta))
    return [k for k, keys in by_key.items() if len(keys) > 1]


@pytest.mark.parametrize("key_of", [lean_key, fast_key])
def test_equal_lean_keys_mean_equal_triton_keys(key_of):
    assert not coarser_than_triton(key_of)


def test_the_comparison_catches_a_key_blind_to_alignment():
    """The check above can fail: a key that ignores the addresses' alignment maps differing Triton keys together."""
    def blind(fn, args, meta):
        return tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args), tuple(meta.items())
    assert coarser_than_triton(blind)


@pytest.mark.parametrize("change", ["alignment", "dtype", "int one", "int 16", "int range", "constexpr",
                                    "constexpr type", "num_warps", "bool", "none"])
def test_each_specialized_property_changes_the_key(change):
    fn = jit_kernel()
    args = [BASE, BASE, 32, 17, True, 0.5, None]
    meta = {"BLOCK": 16, "num_warps": 4}
    changed, meta2 = list(args), dict(meta)
    if change == "alignment":
        changed[0] = BASE[1:]
    elif change == "dtype":
        changed[1] = BASE.half()
    elif change == "int one":
        changed[3] = 1
    elif change == "int 16":
        changed[2] = 33
    elif change == "int range":
        changed[2] = 2**32
    elif change == "constexpr":
        meta2["BLOCK"] = 32
    elif change == "constexpr type":
        meta2["BLOCK"] = 16.0
    elif change == "num_warps":
        meta2["num_warps"] = 8
    elif change == "bool":
        changed[4] = 1
    elif change == "none":
        changed[6] = BASE
    for which in ("fast_key", "key"):
        key_of = getattr(lean.LeanKernel(fn).layout_functions(tuple(args), meta), which)
        before = key_of(tuple(args), meta, 0)
        try:
            after = key_of(tuple(changed), meta2, 0)
        except Exception:  # another layout: this layout's function refuses it (a new layout gets its own)
            other = lean.LeanKernel(fn).layout_functions(tuple(changed), meta2)
            after = getattr(other, which)(tuple(changed), meta2, 0)
        if which == "fast_key":  # (the key, not the arguments handed back)
            before, after = before[0], after[0]
        assert before != after
    assert triton_key(fn, tuple(args), meta) != triton_key(fn, tuple(changed), meta2)


def test_a_key_does_not_move_with_what_triton_ignores():
    """Addresses 16 bytes apart, ints of one class, floats: one key (so a repeated call hits)."""
    fn = jit_kernel()
    meta = {"BLOCK": 16, "num_warps": 4}
    a = (BASE, BASE, 32, 17, True, 0.5, None)
    b = (BASE[4:], BASE[8:], 48, 19, False, -3.0, None)
    key_of = lean.LeanKernel(fn).layout_functions(a, meta).key
    assert key_of(a, meta, 0) == key_of(b, meta, 0)
    assert key_of(a, meta, 0) != key_of(a, meta, 1)  # another device


def test_the_fast_key_holds_ints_by_value_and_hands_back_addresses():
    fn = jit_kernel()
    meta = {"BLOCK": 16, "num_warps": 4}
    a = (BASE, BASE[4:], 32, 17, True, 0.5, None)
    fast_of = lean.LeanKernel(fn).layout_functions(a, meta).fast_key
    key, launched = fast_of(a, meta, 0)
    assert launched == (BASE.data_ptr(), BASE[4:].data_ptr(), 32, 17, True, 0.5, None)
    assert key == fast_of((BASE[8:],) + a[1:], meta, 0)[0]  # addresses 16 bytes apart
    assert key != fast_of(a[:2] + (48,) + a[3:], meta, 0)[0]  # an int of the same class, another value


def test_the_fast_key_tells_which_pointer_is_misaligned():
    """All aligned: one 0 for every address; else each address's residue (the same bits of one address or another
    are two keys, as they are for Triton)."""
    fn = jit_kernel()
    meta = {"BLOCK": 16}
    fast_of = lean.LeanKernel(fn).layout_functions(BASE_ARGS, meta).fast_key
    pairs = ((BASE, BASE[4:]), (BASE[1:], BASE), (BASE, BASE[1:]), (BASE[1:], BASE[1:]), (BASE[2:], BASE[1:]))
    keys = {fast_of((x, y) + BASE_ARGS[2:], meta, 0)[0] for x, y in pairs}
    assert len(keys) == len(pairs)
    assert len({triton_key(fn, (x, y) + BASE_ARGS[2:], meta) for x, y in pairs[:4]}) == 4


def test_keyword_values_are_keyed_by_value_and_type_whatever_object_holds_them():
    """The fast key holds a token of the keyword values and types: the last call's while each value is the same
    object, else the token of an equal part (equal values of one type, in other objects: one token)."""
    fn = jit_kernel()
    layout = lean.LeanKernel(fn).layout_functions(BASE_ARGS, {"BLOCK": 16, "MODE": 2})
    key = lambda block, mode: layout.fast_key(BASE_ARGS, {"BLOCK": block, "MODE": mode}, 0)[0]  # noqa: E731
    big = 2**40
    assert key(16, big) == key(16, big) == key(16, int(str(big))) == key(16, big + 0)
    assert len({key(16, big), key(16, 2), key(True, 2), key(1, 2), key(1.0, 2), key(16, big)}) == 5
    assert key(16, 2) != key(2, 16)  # (by name)
    assert key(16, 2) == layout.fast_key(BASE_ARGS, {"MODE": 2, "BLOCK": 16}, 0)[0]  # (in any order)


def test_a_new_token_is_never_one_handed_out_before(monkeypatch):
    monkeypatch.setattr(lean, "MAX_FAST_ENTRIES", 2)
    tokens = {}
    handed = [lean._meta_token(tokens, (value, int)) for value in range(6)]
    assert len(set(handed)) == 6 and len(tokens) <= 2
    assert lean._meta_token(tokens, (5, int)) == handed[5]


def test_a_tensor_not_on_a_cuda_device_is_of_no_fast_layout():
    """The fast key refuses a CPU tensor (its call takes Triton's path, whose launcher checks the pointer); the key
    takes it as it takes a CUDA tensor."""
    fn = jit_kernel()
    meta = {"BLOCK": 16}
    host = (torch.empty(64),) + BASE_ARGS[1:]
    layout = lean.LeanKernel(fn).layout_functions(BASE_ARGS, meta)
    with pytest.raises(lean._Mismatch):
        layout.fast_key(host, meta, 0)
    assert layout.key(host, meta, 0) == layout.key(BASE_ARGS, meta, 0)


def test_a_fast_key_function_refuses_another_layout():
    """Another kind at a position (a bool for an int, a tensor for None, an int for a float) or another keyword set:
    another layout, whose own functions key it."""
    fn = jit_kernel()
    meta = {"BLOCK": 16}
    fast_of = lean.LeanKernel(fn).layout_functions(BASE_ARGS, meta).fast_key
    for i, other in ((2, True), (6, BASE), (5, 1)):
        changed = BASE_ARGS[:i] + (other,) + BASE_ARGS[i + 1:]
        with pytest.raises(lean._Mismatch):
            fast_of(changed, meta, 0)
    for other in ({}, {"MODE": 16}, {"BLOCK": 16, "MODE": 2}):
        with pytest.raises(Exception):
            fast_of(BASE_ARGS, other, 0)


def built_hit():
    """The compiled hit; the test is skipped on a machine without a C++ compiler (where it is not built)."""
    module = launch_hit.compiled_hit()
    if module is None and launch_hit.compiler() is None:
        pytest.skip("no C++ compiler: the lean path hits through Python")
    assert module is not None
    return module


def plain(value):
    """A tensor as a plain torch.Tensor viewing its memory (a Parameter for one address in three); other values as
    they are."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.as_subclass(torch.Tensor)
    return torch.nn.Parameter(value, requires_grad=False) if value.data_ptr() % 3 == 0 else value


def test_without_the_compiled_hit_the_python_functions_hit(monkeypatch):
    """A module that cannot be built (no compiler, a failed build) is None, with a warning saying why; the layouts'
    hits are then their Python functions."""
    def fail():
        raise RuntimeError("no C++ compiler (set CXX)")

    monkeypatch.setattr(launch_hit, "_load", fail)
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        assert launch_hit.compiled_hit.__wrapped__() is None
    monkeypatch.setattr(lean, "compiled_hit", lambda: None)
    layout = lean.LeanKernel(jit_kernel()).layout_functions(BASE_ARGS, {"BLOCK": 16})
    assert layout.hit is layout.scope["hit"]


class FakeCompiled:
    """Stands in for Triton's CompiledKernel: its ``run`` records the launches it is given."""

    def __init__(self, launcher=None):
        self.function, self.packed_metadata = 11, (4, 1, 0)
        self.calls = []
        self.run = launcher or (lambda *a: self.calls.append(a))


class CudaLauncherLike:
    """Triton's CUDA launcher's attributes: no scratch memory, the C ``launch`` function."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.direct, self.wrapped = [], []
        self.launch = lambda *a: self.direct.append(a)

    def __call__(self, *a):
        self.wrapped.append(a)


@pytest.fixture(params=["python", "compiled"])
def hits(request, monkeypatch):
    """How a layout hits: through its Python function alone, or through the compiled hit first."""
    if request.param == "python":
        monkeypatch.setattr(lean, "compiled_hit", lambda: None)
    else:
        built_hit()
    return request.param


@pytest.fixture
def fake_triton(monkeypatch, hits):
    """A JITFunction whose Triton launch is recorded and returns a FakeCompiled; the CUDA queries stubbed. Each test
    of it runs with either hit (:func:`hits`)."""
    return faked(monkeypatch)


def faked(monkeypatch) -> tuple:
    """``(fn, compiled, through_triton)``: a JITFunction whose Triton launch is recorded (``through_triton``) and
    returns ``compiled``, a FakeCompiled; the CUDA queries stubbed."""
    fn = jit_kernel()
    compiled = FakeCompiled()
    through_triton = []

    def run(*args, grid, warmup, **kwargs):
        through_triton.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(fn, "run", run)
    monkeypatch.setattr(lean, "_device", lambda: 0)
    monkeypatch.setattr(lean, "_stream", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # (Triton keeps a deep copy of the value it compiled with)
    fn.used_global_vals = {("GLOBAL_LIMIT", id(globals())): (copy.deepcopy(GLOBAL_LIMIT), globals())}
    return fn, compiled, through_triton


def test_a_repeated_launch_calls_the_compiled_kernel(fake_triton):
    fn, compiled, through_triton = fake_triton
    x, y = cuda_empty(32), cuda_empty(32)
    returned = lean.launch_with(fn, (3, 2), {"BLOCK": 16, "num_warps": 4}, x, y, 48, 17, True, 0.5, None)
    assert returned is compiled and len(through_triton) == 1 and not compiled.calls
    x2 = cuda_empty(32)
    for _ in range(2):
        lean.launch_with(fn, (5,), {"BLOCK": 16, "num_warps": 4}, x2, y, 64, 33, False, 2.0, None)
    assert len(through_triton) == 1
    # Triton's argument order: grid, stream, function, metadata, launch metadata and hooks (none), then every
    # parameter in signature order, constexprs (given and default) included; the first launch of a fast key with
    # the tensors (the launcher checks their pointers), the next with their addresses
    head = (5, 1, 1, 1234, 11, (4, 1, 0), None, None, None)
    assert compiled.calls == [head + (x2, y, 64, 33, False, 2.0, None, 16, 2),
                              head + (x2.data_ptr(), y.data_ptr(), 64, 33, False, 2.0, None, 16, 2)]


def set_a_hook_or_global(change: str, fn, m: pytest.MonkeyPatch) -> None:
    """For ``change`` "launch hook", "pre-run hook" or "global changed": set a launch hook, a pre-run hook of ``fn`` or
    a new value of the global ``fn`` reads (through ``m``, undone with it); nothing for any other ``change``."""
    if change == "launch hook":
        m.setattr(lean.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    elif change == "pre-run hook":
        m.setattr(fn, "pre_run_hooks", [lambda *a, **k: None])
    elif change == "global changed":
        m.setitem(globals(), "GLOBAL_LIMIT", tl.constexpr(5))


@pytest.mark.parametrize("change", ["misaligned", "int one", "new constexpr", "callable grid", "launch hook",
                                    "pre-run hook", "global changed", "float keyword"])
def test_anything_the_key_or_the_fast_path_cannot_vouch_for_takes_tritons_path(fake_triton, change, monkeypatch):
    fn, compiled, through_triton = fake_triton
    args = (cuda_empty(32), cuda_empty(32), 48, 17, True, 0.5, None)
    meta = dict(BLOCK=16, num_warps=4)
    grid = (3,)
    if change == "float keyword":
        meta["SCALE"] = 0.5  # (a keyword Triton takes as an option here: only its effect on caching matters)
    lean.launch_with(fn, grid, meta, *args)
    if change == "misaligned":
        args = (cuda_empty(33)[1:],) + args[1:]
    elif change == "int one":
        args = args[:2] + (1,) + args[3:]
    elif change == "new constexpr":
        meta["BLOCK"] = 32
    elif change == "callable grid":
        grid = lambda meta: (3,)  # noqa: E731
    set_a_hook_or_global(change, fn, monkeypatch)
    lean.launch_with(fn, grid, meta, *args)
    assert len(through_triton) == 2 and not compiled.calls


# FAST_DEVICE -> (a tensor a hit launches by address, a tensor on another device) of n elements: CudaTensor with a
# CPU tensor, or plain CPU tensors (which the compiled hit reads itself) with a meta tensor
STAND_INS = {"cuda": (cuda_empty, lambda n: torch.empty(n)),
             "cpu": (lambda n: torch.empty(n), lambda n: torch.empty(n, device="meta"))}


@pytest.mark.parametrize("fast_device", STAND_INS)
@pytest.mark.parametrize("change", ["other device", "dtype", "alignment", "int value", "keyword type"])
def test_a_call_that_differs_never_launches_through_another_calls_fast_entry(fake_triton, change, fast_device,
                                                                              monkeypatch):
    """After a call has hit, one that differs in a tensor's device (a CPU tensor where CUDA ones hit), dtype or
    alignment, or in a keyword's type, takes Triton's path (another device each time: no fast key is kept of it); an
    int of the same class but another value launches once with the tensors (checked by the launcher, from the class
    key's entry), then hits its own fast key."""
    fn, compiled, through_triton = fake_triton
    monkeypatch.setattr(lean, "FAST_DEVICE", fast_device)
    empty, elsewhere = STAND_INS[fast_device]
    x, y = empty(32), empty(32)
    meta = {"BLOCK": 1}
    for _ in range(3):
        lean.launch_with(fn, (1,), meta, x, y, 48, 17, True, 0.5, None)
    assert len(through_triton) == 1 and compiled.calls[-1][9:11] == (x.data_ptr(), y.data_ptr())
    args = [x, y, 48, 17, True, 0.5, None]
    if change == "other device":
        args[1] = elsewhere(32)
    elif change == "dtype":
        args[1] = y.half()
    elif change == "alignment":
        args[1] = empty(33)[1:]
    elif change == "int value":
        args[2] = 64  # (divisible by 16, as 48 is)
    else:
        meta["BLOCK"] = True  # (equal to 1, and of one hash)
    launched = len(compiled.calls)
    for _ in range(3):
        lean.launch_with(fn, (1,), meta, *args)
    if change == "other device":
        assert len(through_triton) == 4 and len(compiled.calls) == launched
    elif change == "int value":
        assert len(through_triton) == 1 and compiled.calls[launched][9:12] == (x, y, 64)
        assert compiled.calls[-1][9:12] == (x.data_ptr(), y.data_ptr(), 64)
    else:
        assert len(through_triton) == 2 and compiled.calls[launched][9:11] == tuple(args[:2])


def test_a_global_rebound_to_an_equal_value_keeps_the_lean_path(fake_triton, monkeypatch):
    fn, compiled, through_triton = fake_triton
    x = cuda_empty(32)
    call = lambda: lean.launch_with(fn, (1,), {"BLOCK": 16}, x, x, 48, 17, True, 0.5, None)  # noqa: E731
    call()
    monkeypatch.setitem(globals(), "GLOBAL_LIMIT", tl.constexpr(4))  # another object, the same value
    call()
    call()
    assert len(through_triton) == 1 and len(compiled.calls) == 2
    monkeypatch.setitem(globals(), "GLOBAL_LIMIT", tl.constexpr(6))
    call()
    assert len(through_triton) == 2


def test_a_second_layout_gets_its_own_key_function(fake_triton):
    fn, compiled, through_triton = fake_triton
    x = cuda_empty(32)
    lean.launch_with(fn, (1,), {"BLOCK": 16}, x, x, 48, 17, True, 0.5, None)
    lean.launch_with(fn, (1,), {"BLOCK": 16}, x, x, 48, 17, True, 0.5, x)  # a tensor where None was
    lean.launch_with(fn, (1,), {"BLOCK": 16}, x, x, 48, 17, True, 0.5, x)
    lean.launch_with(fn, (1,), {"BLOCK": 16}, x, x, 48, 17, True, 0.5, None)
    assert len(through_triton) == 2 and len(compiled.calls) == 2
    assert len(fn._dsa_lean.layouts) == 2


def test_the_cuda_launcher_is_called_without_its_python_wrapper(monkeypatch, fake_triton):
    fn, compiled, through_triton = fake_triton
    launcher = CudaLauncherLike()
    compiled.run = launcher
    x = cuda_empty(32)
    for _ in range(3):
        lean.launch_with(fn, (2, 3, 4), {"BLOCK": 16}, x, x, 48, 17, True, 0.5, None)
    assert not launcher.wrapped
    # what CudaLauncher.__call__ passes its C function: cooperative grid, PDL, the two scratch buffers (none)
    head = (2, 3, 4, 1234, 11, False, True, None, None, (4, 1, 0), None, None, None)
    assert launcher.direct == [head + (x, x, 48, 17, True, 0.5, None, 16, 2),
                               head + (x.data_ptr(), x.data_ptr(), 48, 17, True, 0.5, None, 16, 2)]


@pytest.mark.parametrize("fast_device", STAND_INS)
@pytest.mark.parametrize("own", [True, False])
def test_a_hit_calls_the_own_launcher_with_the_parameters_tritons_would_pass(monkeypatch, fake_triton, hits, own,
                                                                             fast_device):
    """With Triton's CUDA launcher (the kernel's signature from Triton's binder), a hit calls the own launcher
    (:mod:`dsa_triton.launcher`; DSA_OWN_LAUNCHER=0: Triton's C function) with the addresses and without the tail of
    constexprs, and packs the parameters Triton's generated launcher would pass; a miss still calls Triton's, with
    the tensors and every argument. (With plain CPU tensors the compiled hit launches them, with CudaTensors the
    Python function.)"""
    from types import SimpleNamespace

    from dsa_triton import launcher
    from tests.launcher_stub import metadata_of, reference_pack, unbuilt_cuda_launcher

    fn, compiled, through_triton = fake_triton
    module = launcher.compiled_launcher()
    if module is None:
        pytest.skip("the own launcher is not built here")
    own_calls, triton_calls = [], []
    monkeypatch.setattr(launcher, "ENABLED", own)
    monkeypatch.setattr(launcher, "compiled_launcher", lambda: SimpleNamespace(
        describe=module.describe, TYPES=module.TYPES, launch=lambda *a: own_calls.append(a)))
    monkeypatch.setattr(lean, "FAST_DEVICE", fast_device)
    x, y = STAND_INS[fast_device][0](32), STAND_INS[fast_device][0](32)
    args, meta = (x, y, 48, 17, True, 0.5, None), {"BLOCK": 16}
    _, specialization, _ = create_function_from_signature(fn.signature, fn.params, CUDABackend)(*args, **meta)
    compiled.src = SimpleNamespace(signature={p.name: s[0] for p, s in zip(fn.params, specialization)})
    compiled.metadata = metadata_of(launch_pdl=True)
    compiled.run = unbuilt_cuda_launcher(compiled.metadata, launch=lambda *a: triton_calls.append(a))
    for _ in range(4):
        lean.launch_with(fn, (3, 2), meta, *args)
    launched = (x.data_ptr(), y.data_ptr(), 48, 17, True, 0.5, None, 16, 2)
    assert len(through_triton) == 1 and triton_calls[0][13:] == (*args, 16, 2)  # (the miss: the tensors)
    assert {type(key) for key in fn._dsa_lean.fast} == {bytes if (hits, fast_device) == ("compiled", "cpu") else tuple}
    if not own:
        assert not own_calls and len(triton_calls) == 3 and triton_calls[-1][13:] == launched
        return
    assert len(triton_calls) == 1 and len(own_calls) == 2
    grid_x, grid_y, grid_z, stream, described, *rest = own_calls[-1]
    assert (grid_x, grid_y, grid_z, stream, tuple(rest)) == (3, 2, 1, 1234, launched[:-2])  # (no constexpr tail)
    assert module.pack(described, *rest) == reference_pack(compiled.src.signature, launched)


def test_launch_with_takes_the_keywords_in_a_dict_it_leaves_alone(fake_triton):
    fn, compiled, through_triton = fake_triton
    x = cuda_empty(32)
    meta = {"BLOCK": 16, "num_warps": 4}
    for _ in range(3):
        assert lean.launch_with(fn, (1,), meta, x, x, 48, 17, True, 0.5, None) is compiled
    assert len(through_triton) == 1 and compiled.calls[-1][9] == x.data_ptr()
    assert meta == {"BLOCK": 16, "num_warps": 4}


def test_the_cache_of_a_kernel_is_bounded(fake_triton, monkeypatch):
    fn, compiled, through_triton = fake_triton
    monkeypatch.setattr(lean, "MAX_ENTRIES", 3)
    monkeypatch.setattr(lean, "MAX_FAST_ENTRIES", 3)
    x = cuda_empty(32)
    for block in itertools.islice(itertools.cycle([16, 32, 64, 128]), 8):
        lean.launch_with(fn, (1,), {"BLOCK": block}, x, x, 48, 17, True, 0.5, None)
    for n in range(40, 48):  # one entry, many fast keys
        lean.launch_with(fn, (1,), {"BLOCK": 16}, x, x, n, 17, True, 0.5, None)
    assert len(fn._dsa_lean.entries) <= 3 and len(fn._dsa_lean.fast) <= 3


def test_the_interpreter_takes_tritons_path_unchanged(monkeypatch):
    """Under TRITON_INTERPRET=1 kernels are InterpretedFunctions: launch_with() is kernel[grid](...), and an op's
    launches reach the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(topk_select_kernel, InterpretedFunction) and not isinstance(topk_select_kernel, JITFunction)
    seen = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        seen.append(self.fn.__name__)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    h = torch.randn(3, 8)
    y = dt.swiglu(h)
    assert seen == ["_swiglu_kernel"]
    torch.testing.assert_close(y, torch.nn.functional.silu(h[:, :4]) * h[:, 4:])

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: ("stub", grid, a, k)

    assert lean.launch_with(Stub(), (2,), {"X": 3}, 1) == ("stub", (2,), (1,), {"X": 3})


def test_a_cached_meta_is_one_dict_per_value_and_type():
    build = cached(lambda flag, n: {"FLAG": flag, "N": n})
    assert build(True, 4) is build(True, 4) and build(True, 4) == {"FLAG": True, "N": 4}
    assert build(1, 4) is not build(True, 4) and type(build(1, 4)["FLAG"]) is int  # 1 == True, another constexpr
    assert build(True, 8)["N"] == 8


def test_a_repeated_op_call_launches_with_the_keyword_dicts_of_the_first(monkeypatch):
    """Every registered op but the load-time MXFP4 ones launches through ``launch_with``, and a repeated call (the
    same shapes and config) hands it the very dicts of the first call: none is built per call."""
    import sys

    from dsa_triton import registry

    seen = []

    def recording(kernel, grid, meta, *args):
        seen.append(("launch_with", meta))
        return lean.launch_with(kernel, grid, meta, *args)

    for name, module in list(sys.modules.items()):
        if name.startswith("dsa_triton.") and module is not lean:
            if getattr(module, "launch_with", None) is lean.launch_with:
                monkeypatch.setattr(module, "launch_with", recording)
    device = torch.device("cpu")
    for spec in registry.kernels():
        for phase in spec.phases:
            shapes = spec.bench_shapes(phase, False)
            if not shapes:
                continue
            shape = shapes[0]
            inputs, config = spec.make_inputs(phase, shape, device, 0), spec.launch_config(phase, shape, device)
            calls = []
            for _ in range(2):
                seen.clear()
                spec.run(inputs, config)
                calls.append(list(seen))
            first, second = calls
            assert first and len(first) == len(second), spec.name
            if spec.name in ("mxfp4_quantize", "mxfp4_dequantize"):  # load-time ops
                continue
            assert all(how == "launch_with" for how, _ in first), spec.name
            assert all(a is b for (_, a), (_, b) in zip(first, second)), spec.name


def lean_calls(monkeypatch, steps: list, compiled: bool) -> tuple[list, list]:
    """Each step of ``steps`` run on a new :func:`faked` kernel whose Triton launch returns a FakeCompiled per Triton
    cache key (as Triton returns one compiled kernel per specialization): ``(grid, args, meta)`` is launched with ``launch_with``, a function of ``(fn, monkeypatch)`` changes something
    first. Per launch: which compiled kernel it returned (their number), what reached Triton's launch, and which
    compiled kernel's run was given what (a tensor as its address: a miss passes the tensors, which the launcher
    reads so); then the kinds of the fast keys kept (bytes: the compiled hit's, tuple: the Python function's).
    Through the compiled hit first (``compiled``), else the Python functions alone (the reference)."""
    def seen(value):
        if isinstance(value, torch.Tensor):
            return value.data_ptr()
        if isinstance(value, (tuple, list)):
            return type(value)(seen(v) for v in value)
        return {k: seen(v) for k, v in value.items()} if isinstance(value, dict) else value

    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(lean, "compiled_hit", lambda: None)
        fn, _, _ = faked(m)
        kernels, through_triton, runs = {}, [], []

        def run(*args, grid, warmup, **kwargs):
            through_triton.append((grid, args, kwargs))
            number = len(kernels)
            return kernels.setdefault(triton_key(fn, args, kwargs), FakeCompiled(lambda *a: runs.append((number, a))))

        m.setattr(fn, "run", run)
        made = []
        for step in steps:
            if callable(step):
                step(fn, m)
                continue
            triton_before, runs_before = len(through_triton), len(runs)
            returned = lean.launch_with(fn, step[0], step[2], *step[1])
            made.append(seen((list(kernels.values()).index(returned), through_triton[triton_before:], runs[runs_before:])))
        return made, sorted(type(key).__name__ for key in fn._dsa_lean.fast)


def random_steps(r: random.Random, n: int) -> list:
    """Launches as :func:`random_launch` makes them, with plain tensors and parameters (a subclass now and then), a
    grid of 1 to 3 sizes (a list now and then), keyword dicts kept or new, an equal big keyword value in another
    object now and then."""
    kept = {"BLOCK": 16, "num_warps": 4}
    steps = []
    for _ in range(n):
        args, meta = random_launch(r)
        args = tuple(plain(a) for a in args)
        if meta == kept and r.random() < 0.5:
            meta = kept
        elif r.random() < 0.1:
            meta["MODE"] = int(str(2**40))
        if r.random() < 0.05:
            args = (args[0].as_subclass(CudaTensor),) + args[1:]
        grid = r.choice([(1,), (2, 3), (4, 5, 6), (7,)]) if r.random() < 0.95 else [1]
        steps.append((grid, args, meta))
    return steps


def test_the_compiled_hit_launches_as_the_python_functions(monkeypatch):
    """Over random launches (FAST_DEVICE the CPU's, so that plain CPU tensors are launched by address): the same
    launches reach Triton and the compiled kernel's run (the same entry, the same arguments: addresses on a hit,
    the tensors on a miss) through the compiled hit as through the Python functions alone; the compiled hit kept
    most fast keys (the calls it declines, the Python function keys)."""
    built_hit()
    monkeypatch.setattr(lean, "FAST_DEVICE", "cpu")
    steps = random_steps(random.Random(2), 400)
    made, kinds = lean_calls(monkeypatch, steps, True)
    reference, reference_kinds = lean_calls(monkeypatch, steps, False)
    assert made == reference
    assert set(reference_kinds) == {"tuple"} and kinds.count("bytes") > kinds.count("tuple") > 0
    assert sum(bool(runs) and not triton for _, triton, runs in made) > 300 and len({k for k, _, _ in made}) > 20


def test_the_compiled_hit_takes_every_plain_call(monkeypatch):
    """Plain tensors of FAST_DEVICE's type, ints within int64, bools, floats, None, any keyword values: every fast
    key is the compiled hit's (the Python function kept none, so it launched nothing), and repeated calls hit."""
    built_hit()
    monkeypatch.setattr(lean, "FAST_DEVICE", "cpu")
    x, y = torch.empty(32), torch.empty(33)
    variants = [((x, y, 48, 17, True, 0.5, None), {"BLOCK": 16}), ((x, y[1:], -2**63, 1, False, -0.0, None),
                {"BLOCK": 16}), ((x, x.half(), 0, 2**63 - 1, True, 3.0, None), {"BLOCK": 2**40, "MODE": 3})]
    steps = [((3,), args, dict(meta)) for args, meta in variants * 3]
    made, kinds = lean_calls(monkeypatch, steps, True)
    assert set(kinds) == {"bytes"} and len(kinds) == 3
    assert all(not triton and runs[0][1][9] == x.data_ptr() for _, triton, runs in made[6:])


@pytest.mark.parametrize("change", ["subclass", "function mode", "big int", "list grid", "instrumentation mode",
                                    "launch hook", "pre-run hook", "global changed", "float keyword"])
def test_what_the_compiled_hit_cannot_vouch_for_goes_to_the_python_path(monkeypatch, change):
    """After the compiled hit has hit, a call with a tensor subclass, a call while a torch function mode is on, an
    int past int64, a list grid or Triton's instrumentation mode set is handed to the Python function; with a launch
    hook or a pre-run hook set or a global changed, the compiled hit takes Triton's path (lean.miss) as the Python
    function does; a float keyword's call (another layout) takes Triton's path. Each launches as the Python
    functions alone do."""
    from torch.overrides import TorchFunctionMode

    built_hit()
    monkeypatch.setattr(lean, "FAST_DEVICE", "cpu")
    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, mode = torch.empty(32), Passing()
    args, meta = (x, x, 48, 17, True, 0.5, None), {"BLOCK": 16}
    changed, grid = args, (2,)
    if change == "subclass":
        changed = (x.as_subclass(CudaTensor),) + args[1:]
    elif change == "big int":
        changed = args[:2] + (2**63,) + args[3:]
    elif change == "float keyword":
        meta = dict(meta, SCALE=0.5)
    elif change == "list grid":
        grid = [2]

    def make(fn, m):
        set_a_hook_or_global(change, fn, m)
        if change == "instrumentation mode":
            m.setattr(lean.knobs.compilation, "instrumentation_mode", "consan")
        elif change == "function mode":
            mode.__enter__()

    def undo(fn, m):
        if change == "function mode":
            mode.__exit__(None, None, None)

    steps = [((2,), args, {"BLOCK": 16})] * 3 + [make] + [(grid, changed, meta)] * 2 + [undo]
    made, kinds = lean_calls(monkeypatch, steps, True)
    assert made == lean_calls(monkeypatch, steps, False)[0]
    assert made[2] == (0, [], [(0, (2, 1, 1, 1234, 11, (4, 1, 0), None, None, None, x.data_ptr(), x.data_ptr(), 48,
                                        17, True, 0.5, None, 16, 2))])
    assert made[3][1] or "tuple" in kinds  # (Triton's path, or the Python function keyed the call)


def test_a_layout_without_tensors_hits(fake_triton):
    fn, compiled, through_triton = fake_triton
    for _ in range(3):
        lean.launch_with(fn, (1,), {"BLOCK": 16}, None, None, 48, 17, True, 0.5, None)
    assert len(through_triton) == 1 and len(compiled.calls) == 2 and compiled.calls[-1][9:11] == (None, None)
