"""Toy kernels for the tuner and database tests: real (tiny) Triton kernels with a config space.

- ``toy_axpy``: out = alpha * x + y over a [T, D] fp32 tensor, config BLOCK x num_warps, BLOCK < 32 * num_warps
  invalid; a public op :func:`axpy` that launches with ``spec.launch_config`` and records how many programs ran.
- ``toy_buggy``: the same kernel launched wrongly for some configs: BLOCK=64 drops the tail (wrong result
  when T*D is not a multiple of 64) and BLOCK=32 with num_warps=2 raises, so penalisation can be tested.

The tests in this file prove the toys themselves are honest (the reference agrees with the right configs).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

import dsa_triton  # noqa: F401  (first: turns the interpreter on before triton is imported)
import triton
import triton.language as tl
import tuning_db
from dsa_triton import registry
from dsa_triton.registry import Cost, KernelSpec
from dsa_triton.runtime import default_device


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, programs_ptr, alpha, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)
    if pid == 0:
        tl.store(programs_ptr, tl.num_programs(0))


def launch(inputs: dict, config: dict, drop_tail: bool = False) -> torch.Tensor:
    """Run the kernel; ``drop_tail`` launches n // BLOCK programs (the deliberate bug)."""
    x, y = inputs["x"], inputs["y"]
    out = torch.full_like(x, float("nan"))
    n, block = x.numel(), config["BLOCK"]
    grid = (n // block if drop_tail else triton.cdiv(n, block),)
    _axpy_kernel[grid](x, y, out, inputs["programs"], inputs["alpha"], n, BLOCK=block, num_warps=config["num_warps"])
    return out


def make_inputs(phase: str, shape: dict, device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    t, d = shape["T"], shape["D"]
    return {"x": torch.randn(t, d, generator=g).to(device), "y": torch.randn(t, d, generator=g).to(device),
            "alpha": float(torch.rand((), generator=g)) + 0.5,
            "programs": torch.full((1,), -2, dtype=torch.int32, device=device)}


def reference(inputs: dict) -> torch.Tensor:
    return inputs["alpha"] * inputs["x"] + inputs["y"]


def compare(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    if out.shape != ref.shape or not torch.allclose(out, ref, atol=1e-5, rtol=1e-5, equal_nan=False):
        return f"max error {(out - ref).abs().nan_to_num(float('inf')).max().item():.3g}"
    return None


def buggy_run(inputs: dict, config: dict) -> torch.Tensor:
    if config == {"BLOCK": 32, "num_warps": 2}:
        raise RuntimeError("toy_buggy: this config does not launch")
    return launch(inputs, config, drop_tail=config["BLOCK"] == 64)


def toy_spec(name: str = "toy_axpy", run=launch, space=None, bench=((3, 40),)) -> KernelSpec:
    """A [T, D] axpy spec; ``bench``: (T, D) pairs of the tiny bench shapes."""
    return KernelSpec.of(
        name=name,
        phases=("decode", "prefill"),
        space=space or {"BLOCK": (16, 32, 64, 128), "num_warps": (1, 2, 4)},
        default=lambda phase, shape: {"BLOCK": 32, "num_warps": 1},
        fixed_dims=("D",),
        bucketed_dims=("T",),
        make_inputs=make_inputs,
        run=run,
        reference=reference,
        compare=compare,
        cost=lambda phase, shape: Cost(bytes=12.0 * shape["T"] * shape["D"]),
        bench_shapes=lambda phase, gpu: [{"T": t, "D": d} for t, d in bench],
        constraint=lambda config, shape: (None if config["BLOCK"] >= 16 * config["num_warps"]
                                          else "BLOCK must be at least 16 x num_warps"),
        baseline=reference,
        baseline_name="torch",
        model_dims=lambda m: [{"D": m.qk}],  # a model's latent cache row
        count_roles={"T": "tokens"},
    )


def buggy_spec() -> KernelSpec:
    return toy_spec("toy_buggy", run=buggy_run, space={"BLOCK": (16, 32, 64), "num_warps": (1, 2)})


def axpy(x: torch.Tensor, y: torch.Tensor, alpha: float, config: dict | None = None) -> tuple[torch.Tensor, int]:
    """The toy public op: out [T, D] = alpha * x + y, launched with the database's config; also the programs run."""
    spec = registry.get("toy_axpy")
    shape = {"T": x.shape[0], "D": x.shape[1]}
    config = config or spec.launch_config("decode", shape, x.device)
    inputs = {"x": x, "y": y, "alpha": alpha, "programs": torch.full((1,), -2, dtype=torch.int32, device=x.device)}
    out = spec.run(inputs, config)
    return out, int(inputs["programs"].item())


@contextlib.contextmanager
def registered(*specs: KernelSpec) -> Iterator[tuple[KernelSpec, ...]]:
    for spec in specs:
        registry.register(spec)
    try:
        yield specs
    finally:
        for spec in specs:
            registry.unregister(spec.name)


@contextlib.contextmanager
def database(folder) -> Iterator[tuning_db.Database]:
    """Make the database in ``folder`` the one ops read for the duration; the default one after."""
    try:
        yield registry.use_database(folder)
    finally:
        registry.use_database()


DEVICE = default_device()


@pytest.mark.parametrize("config", [{"BLOCK": 16, "num_warps": 1}, {"BLOCK": 128, "num_warps": 4}])
def test_toy_axpy_matches_reference(config):
    inputs = make_inputs("decode", {"T": 3, "D": 40}, DEVICE, 7)
    assert compare(launch(inputs, config), reference(inputs)) is None
    assert inputs["programs"].item() == triton.cdiv(120, config["BLOCK"])


def test_toy_buggy_is_wrong_where_intended():
    inputs = make_inputs("decode", {"T": 3, "D": 40}, DEVICE, 7)
    assert compare(buggy_run(inputs, {"BLOCK": 32, "num_warps": 1}), reference(inputs)) is None
    assert compare(buggy_run(inputs, {"BLOCK": 64, "num_warps": 1}), reference(inputs)) is not None
    with pytest.raises(RuntimeError):
        buggy_run(inputs, {"BLOCK": 32, "num_warps": 2})
