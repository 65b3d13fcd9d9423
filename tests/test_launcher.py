"""dsa_triton.launcher on the CPU: its packing of kernel parameters against Triton 3.6's generated CUDA launcher
(:mod:`tests.launcher_stub`: the conversions and storage read from that launcher's C source) over random signatures
and arguments, which kernels it serves, and both launchers launching on a stand-in libcuda (a fresh interpreter)."""
import json
import random
import shutil
import subprocess
import sys

import pytest
import triton
from triton.backends.nvidia.driver import ty_to_cpp

from dsa_triton import launcher
from tests import launcher_stub
from tests.launcher_stub import (TYPES, kernel_of, metadata_of, random_signature, random_value, reference_pack,
                                 unbuilt_cuda_launcher)


def built():
    """The own launcher's module; the test is skipped on a machine without a C compiler (where it is not built)."""
    module = launcher.compiled_launcher()
    if module is None and not (shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler: hits call Triton's launcher")
    assert module is not None
    return module


def mismatches(types: dict, cases: int = 1000, seed: int = 0) -> list:
    """Random signatures and arguments (out of range in one case of five) where the module's ``pack``, given the
    codes :func:`launcher.type_codes` derives through ``types``, differs from Triton's launcher (other bytes, or an
    exception where Triton's raises none, or the reverse, or another one)."""
    module, r, found = built(), random.Random(seed), []
    for case in range(cases):
        signature = random_signature(r, r.randrange(0, 24))
        args = tuple(random_value(r, ty, out_of_range=case % 5 == 4) for ty in signature.values())
        described = module.describe(0, 4, 0, False, launcher.type_codes(signature, types))
        outcomes = []
        for pack in (lambda: module.pack(described, *args), lambda: reference_pack(signature, args)):
            try:
                outcomes.append(pack())
            except (OverflowError, TypeError) as exc:
                outcomes.append(type(exc))
        if outcomes[0] != outcomes[1]:
            found.append((signature, args, *outcomes))
    return found


def test_the_packing_equals_tritons_launcher():
    """Every scalar and pointer type, constexprs skipped, int edges (int32, int64, uint64, masks and range checks
    as Triton's format characters do them), floats (fp32 stored as 4 bytes, bf16 as the top half, fp16, fp64,
    infinities and NaN), None pointers, bools, the two scratch pointers."""
    assert not mismatches(built().TYPES)


@pytest.mark.parametrize("broken", [{"pack_fp32": "pack_fp64"}, {"int32_t": "int64_t"}, {"uint8_t": "int8_t"},
                                    {"pack_bf16": "pack_fp16"}, {"constexpr": "CUdeviceptr"},
                                    {"uint64_t": "int64_t"}])
def test_the_comparison_catches_a_broken_packer(broken):
    """The check above can fail: a type mapped to another type's conversion (fp32 packed as a double, int32 as 8
    bytes, a bool range-checked as an int8 entry, bf16 as fp16, constexprs passed, uint64 range-checked) differs."""
    types = built().TYPES
    assert mismatches({**types, **{name: types[other] for name, other in broken.items()}}, cases=100)


def test_every_scalar_type_of_triton_has_a_code():
    """Triton's C types of its scalars (ty_to_cpp's table), pointers and constexprs have codes; a tensor descriptor,
    Triton's TMA descriptor or a tuple of entries has none (the kernel keeps Triton's launcher)."""
    types = built().TYPES
    scalars = [ty for ty in ("i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64", "fp16", "bf16",
                             "fp32", "f32", "fp64") if ty_to_cpp(ty)]
    assert set(TYPES) >= set(scalars)
    codes = launcher.type_codes({f"a{i}": ty for i, ty in enumerate(scalars + ["*fp8e4nv", "constexpr"])}, types)
    assert codes is not None and len(codes) == len(scalars) + 2
    for other in ("tensordesc<fp16[16, 16]>", "nvTmaDesc", ("i32", "i32")):
        assert launcher.type_codes({"a": "i32", "b": other}, types) is None


@pytest.mark.parametrize("change", [None, "global scratch", "profile scratch", "cooperative grid", "cluster",
                                    "tensor descriptor", "tuple", "600 entries", "other triton",
                                    "not triton's launcher"])
def test_the_own_launcher_serves_only_what_it_mirrors(change, monkeypatch):
    """A descriptor for a kernel of Triton 3.6's CUDA launcher without scratch memory, clusters, a cooperative grid
    or a tensor descriptor, of at most 512 signature entries; None (Triton's launcher) for any other. Decided once
    per compiled kernel."""
    built()
    changes = {"global scratch": {"global_scratch_size": 64}, "profile scratch": {"profile_scratch_size": 64},
               "cooperative grid": {"launch_cooperative_grid": True}, "cluster": {"num_ctas": 2},
               "tensor descriptor": {"tensordesc_meta": [{}]}}.get(change, {})
    metadata = metadata_of(launch_pdl=True, **changes)
    signature = {"x": "*fp32", "n": "i32", "s": "fp32", "B": "constexpr"}
    if change == "tuple":
        signature["t"] = ("i32", "i32")
    elif change == "600 entries":
        signature.update({f"a{i}": "i32" for i in range(600)})
    run = unbuilt_cuda_launcher(metadata) if change != "not triton's launcher" else (lambda *a: None)
    kernel = kernel_of(signature, metadata, run=run)
    if change == "other triton":
        monkeypatch.setattr(triton, "__version__", "3.7.0")
    described = launcher.descriptor(kernel, ())
    assert (described is None) == (change is not None)
    monkeypatch.setattr(launcher, "_Described", lambda kernel: pytest.fail("decided twice"))
    assert launcher.descriptor(kernel, ()) == described


def test_a_tail_of_constexprs_is_not_passed():
    """Calls whose last arguments are constexprs alone get a descriptor of the entries before them (and pass no
    tail); any other tail is passed whole. Each descriptor is made once."""
    module, metadata = built(), metadata_of()
    signature = {"x": "*fp32", "n": "i32", "s": "fp32", "B": "constexpr", "C": "constexpr"}
    kernel = kernel_of(signature, metadata, run=unbuilt_cuda_launcher(metadata))
    args = (2**40, 7, 0.5, 16, 2)
    for n_tail, passed in ((0, 5), (1, 4), (2, 3), (3, 5)):
        tail = args[len(args) - n_tail:]
        described, hit_tail = launcher.descriptor(kernel, tail)
        assert hit_tail == (tail if passed == 5 else ())
        assert module.pack(described, *args[:passed]) == reference_pack(signature, args)
        assert launcher.descriptor(kernel, tail)[0] is described


def test_without_the_module_triton_launches(monkeypatch):
    """A module that cannot be built is None, with a warning saying why; no kernel is described then."""
    import triton.runtime.build

    def fail(**kwargs):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(triton.runtime.build, "compile_module_from_src", fail)
    with pytest.warns(RuntimeWarning, match="C compiler"):
        assert launcher.compiled_launcher.__wrapped__() is None
    monkeypatch.setattr(launcher, "compiled_launcher", lambda: None)
    metadata = metadata_of()
    assert launcher.descriptor(kernel_of({"x": "*fp32"}, metadata, run=unbuilt_cuda_launcher(metadata)), ()) is None


def test_the_launches_equal_tritons_on_a_stand_in_driver():
    """``tests/launcher_stub.py check`` in a fresh interpreter: Triton's CudaLauncher (its generated launcher, built
    against a stand-in libcuda) and the lean path's launcher of the same kernels launch random arguments alike:
    function, grid, block, dynamic shared memory, stream, PDL attribute, every parameter's bytes, the context
    calls, the driver's error, nothing for an empty grid; arguments out of range raise the same exception."""
    built()
    done = subprocess.run([sys.executable, launcher_stub.__file__, "check", "0"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["n_differences"] == 0, result["differences"]
    assert result["launches"] > 100 and result["refused"] > 0
