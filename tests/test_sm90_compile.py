"""Every kernel lowers for the H200 (sm_90) with the configs the CPU bench shapes launch, compiled by Triton's
bundled ptxas in a process without the interpreter (:mod:`dsa_triton.bench.aot`): GPU lowering errors caught on a
machine without a GPU. Each shape's default config runs in the interpreter; two other valid configs per shape
are only recorded (their launches skipped, so an op whose host code reads a kernel's output may stop early:
the default run recorded its later kernels)."""
import json
import random

import pytest
import torch

from dsa_triton import registry
from dsa_triton.bench import aot

CPU = torch.device("cpu")


def bench_cases():
    for spec in registry.kernels():
        for phase in spec.phases:
            for shape in spec.bench_shapes(phase, False):
                yield spec, phase, shape


def other_configs(spec, shape, default, count=2, tries=200):
    """Up to ``count`` valid configs other than ``default``, drawn at random (fixed seed) from the space."""
    rng, found = random.Random(f"{spec.name}{shape}"), []
    for _ in range(tries):
        config = {name: rng.choice(values) for name, values in spec.space.items()}
        if config != default and config not in found and spec.is_valid(config, shape):
            found.append(config)
            if len(found) == count:
                break
    return found


@pytest.fixture(scope="module")
def launches():
    with aot.record_launches() as ran:
        for spec, phase, shape in bench_cases():
            spec.run(spec.make_inputs(phase, shape, CPU, 0), spec.launch_config(phase, shape, CPU))
    with aot.record_launches(execute=False) as recorded:
        for spec, phase, shape in bench_cases():
            for config in other_configs(spec, shape, spec.launch_config(phase, shape, CPU)):
                try:
                    spec.run(spec.make_inputs(phase, shape, CPU, 0), config)
                except (IndexError, RuntimeError, ValueError):  # host code read an output the skipped launch left
                    pass
    unique = {json.dumps(r, sort_keys=True, default=str): r for r in ran + recorded}
    return list(unique.values())


@pytest.fixture(scope="module")
def compiled(launches):
    return aot.compile_in_subprocess(launches)


def test_every_launched_kernel_compiles_for_sm90(launches, compiled):
    kernels = {(r["module"], r["kernel"]) for r in launches}
    assert len(kernels) >= 16, sorted(kernels)
    assert len(compiled) == len(launches)
    failed = [r for r in compiled if r["error"]]
    assert not failed, json.dumps(failed, indent=1)[:4000]


def test_the_own_launcher_passes_every_compiled_kernels_parameters(compiled):
    """The lean path's own launcher (dsa_triton.launcher) takes every kernel's signature and passes as many
    parameters, each of the size, as the kernel's PTX entry declares (the scratch pointers included)."""
    if {r["launcher"] for r in compiled} == {"not built"}:
        pytest.skip("no C compiler: hits call Triton's launcher")
    wrong = [r for r in compiled if not r["error"] and r["launcher"]]
    assert not wrong, json.dumps(wrong, indent=1)[:4000]


def test_a_kernel_that_cannot_lower_is_reported(launches):
    """The check can fail: a block size that is not a power of two does not lower."""
    record = next(r for r in launches if r["kernel"] == "_select_pages_kernel")
    broken = {**record, "values": {**record["values"], "TILE": 100}}
    (result,) = aot.compile_in_subprocess([broken])
    assert result["error"] is not None


def test_ptxas_reports_the_registers_routes_serialized_wgmma():
    """``info`` gives registers, spills, advisories and wgmma counts. The registers route of the prefill GEMM at
    64 x 128 / 4 warps: software-pipelined (3 stages) ptxas serializes its wgmmas (advisory C7515, a wait after
    each of the 8), unpipelined (1 stage) or with the k loop unrolled twice (UNROLL=2) they go back to back (on the
    H200 both were slower: 7233 and 8951 us vs 5243 at gate_up T=4096, w-smem-probe-...-1050)."""
    from dsa_triton.moe.fp8_grouped_gemm import fp8_grouped_gemm
    from dsa_triton.moe.mxfp4_spec import random_mxfp4

    x = torch.randn(64, 7168).bfloat16()  # the gate_up K: a long pipelined loop (at K = 256 nothing serializes)
    blocks, scales = random_mxfp4((1, 128), 7168, "cpu", 0)
    config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
              "EXPERTS_PER_STAGE": 1, "IN_REGISTERS": 1, "W_SMEM": 0, "UNROLL": 1,
              "ROW_SCALED": 0, "OVERLAP": 1}
    with aot.record_launches(execute=False) as recorded:
        fp8_grouped_gemm(x, torch.tensor([0, 64], dtype=torch.int32), blocks, scales, config=config)
    (route,) = [r for r in recorded if r["kernel"] == "_fused_gemm_kernel"]
    route["values"].update(PTX=True, n_mtiles=512)  # the GPU's conversion (inline PTX) and a real tile count
    unrolled = {**route, "values": {**route["values"], "UNROLL": 2}}
    pipelined, unpipelined, unrolled = aot.compile_in_subprocess([route, {**route, "num_stages": 1}, unrolled],
                                                                 info=True)
    assert pipelined["error"] is None and unpipelined["error"] is None and unrolled["error"] is None
    assert any("C7515" in a or "serialized" in a for a in pipelined["advisories"]), pipelined
    # 8 wgmma a k-step in each of the two tile sizes (BLOCK_M, and BLOCK_M / 2 for an expert's last rows)
    assert pipelined["arrive"] == pipelined["gmma"] == 16
    assert unpipelined["advisories"] == [] and unpipelined["arrive"] == 2 and unpipelined["gmma"] == 16
    assert pipelined["spill_bytes"] == 0 and 100 < pipelined["registers"] <= 255
    # unrolled twice, still 3 stages: no advisory, eight wgmmas per ARRIVE (24 with the peeled copies)
    assert unrolled["advisories"] == [] and unrolled["gmma"] >= 8 * unrolled["arrive"], unrolled
