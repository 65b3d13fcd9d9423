"""Prefill grouped GEMM (interpreter, fp16 activations) against the reference, both routes (weights converted in
registers, or through the workspace): activation quantization bit for bit, grouped products with odd expert
counts, empty experts, K and N off 128, experts split between the routes; the registers route compiles for sm_90."""
import importlib
import json

import pytest
import torch

from dsa_triton import registry
from dsa_triton.moe.mxfp4_to_fp8 import row_references
from dsa_triton.moe.mxfp4_to_fp8_reference import mxfp4_to_fp8_torch
from dsa_triton.moe.fp8_grouped_gemm import (fp8_grouped_gemm, plan_on_device, plan_stages,
                                             quantize_activations_fp8)
from dsa_triton.moe.fp8_grouped_gemm_reference import fp8_grouped_gemm_torch, quantize_rows_fp8_torch
from dsa_triton.moe.fused_moe_gemm_reference import grouped_gemm_torch
from dsa_triton.moe.mxfp4_spec import random_mxfp4
from dsa_triton.moe.workspace import FP8Workspace
from tests.poison import poisoned_allocations
from dsa_triton.bench.reports import REPORTS

CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
          "EXPERTS_PER_STAGE": 2, "IN_REGISTERS": 0, "W_SMEM": 0, "UNROLL": 1, "ROW_SCALED": 0, "OVERLAP": 1}
REGISTERS = {**CONFIG, "BLOCK_K": 128, "IN_REGISTERS": 1}
ROWS = {**CONFIG, "ROW_SCALED": 1}  # the workspace route, experts converted against their rows' references
fp8_grouped_gemm_module = importlib.import_module("dsa_triton.moe.fp8_grouped_gemm")  # (the package's name is the op)


def offsets_of(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


def problem(counts, n, k, seed, k_weights=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).half()
    blocks, scales = random_mxfp4((len(counts), n), k_weights or k, "cpu", seed, spread=3)
    return x, offsets_of(counts), blocks, scales


def check_against_reference(y, x, offsets, blocks, scales):
    ref = fp8_grouped_gemm_torch(x, offsets, blocks, scales)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert not y.isnan().any()
    err = (y.float() - ref).abs()
    assert bool((err <= ref.abs() * 2**-10 + 1e-3 * ref.abs().max()).all()), float(err.max())  # fp16 rounding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tile", [8192, 64])  # rows in registers (one read), or read twice in steps
def test_activation_quantization_matches_reference_bit_for_bit(dtype, tile, monkeypatch):
    monkeypatch.setattr(fp8_grouped_gemm_module, "QUANTIZE_TILE", tile)
    monkeypatch.setattr(fp8_grouped_gemm_module, "QUANTIZE_STEP", (4, 64))  # 160 = 2.5 steps
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 160, generator=g) * torch.exp2(torch.randint(-12, 12, (9, 1), generator=g).float())
    # row 0: amax 448 (scale 1) and exact ties: to even in the normal and the subnormal range
    x[0] = 0.0
    x[0, :10] = torch.tensor([448.0, 1.0625, 1.1875, -1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-7 + 2.0**-11, 0.0,
                              -2.0**-11, -0.0])  # the last two round to -0.0
    x[1] = 0.0  # an all-zero row
    x[2, :4] = torch.tensor([450.0, 1e-3, -1e-4, 1.0])  # amax just above 448 (in every dtype): scale 2
    x[2, 4:] = x[2, 4:].clamp(-1, 1)
    x = x.to(dtype)
    with poisoned_allocations():
        q, s = quantize_activations_fp8(x)
    ref_q, ref_s = quantize_rows_fp8_torch(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (9,)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # bit for bit: signed zeros too
    assert float(s[0]) == 1.0 and float(s[2]) == 2.0 and float(s[1]) == 2.0**-126
    assert q[0, :7].float().tolist() == [448.0, 1.0, 1.25, -1.25, 0.0, 2.0**-8, 2.0**-7]
    assert q[0, 8:10].view(torch.uint8).tolist() == [0x80, 0x80]


@pytest.mark.parametrize("tile", [8192, 128])
def test_activation_quantization_in_the_interleaved_k_order(tile, monkeypatch):
    """Quarter ``a`` of 32-block ``b`` of each 128-k group lands at ``4 a + b``: the registers route's k order."""
    monkeypatch.setattr(fp8_grouped_gemm_module, "QUANTIZE_TILE", tile)
    monkeypatch.setattr(fp8_grouped_gemm_module, "QUANTIZE_STEP", (4, 128))
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(4)).half()
    with poisoned_allocations():
        q, s = quantize_activations_fp8(x, interleaved=True)
    natural, natural_s = quantize_activations_fp8(x)
    expected = natural.view(torch.uint8).view(5, 3, 4, 8, 4).transpose(2, 3).reshape(5, 384)
    assert torch.equal(q.view(torch.uint8), expected) and torch.equal(s, natural_s)
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_activations_fp8(x[:, :160], interleaved=True)


@pytest.mark.parametrize("counts, n, k, config", [
    ([7, 0, 12, 5, 9], 48, 96, CONFIG),  # E = 5, an empty expert, K = 96 < 128, N off BLOCK_N
    ([3, 18, 0, 0, 6, 1, 11], 40, 160, {**CONFIG, "EXPERTS_PER_STAGE": 1, "GROUP_M": 4}),  # 5 stages
    ([9, 4, 13], 72, 256, {**CONFIG, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "EXPERTS_PER_STAGE": 4}),
    ([7, 0, 12, 5, 9], 48, 96, REGISTERS),
    ([3, 18, 0, 0, 6, 1, 11], 40, 160, {**REGISTERS, "GROUP_M": 4}),
    ([9, 40, 13], 72, 256, {**REGISTERS, "BLOCK_M": 32, "BLOCK_N": 64}),  # 32-row tiles and 16-row last tiles
    ([7, 0, 12, 5, 9], 48, 96, {**REGISTERS, "W_SMEM": 1}),
    ([9, 4, 13], 72, 256, {**REGISTERS, "BLOCK_M": 32, "BLOCK_N": 64, "W_SMEM": 1}),
    ([7, 0, 12, 5, 9], 48, 96, ROWS),
    ([3, 18, 0, 0, 6, 1, 11], 40, 160, {**ROWS, "EXPERTS_PER_STAGE": 1, "GROUP_M": 4}),  # ragged K, 5 stages
    ([9, 4, 13], 72, 256, {**ROWS, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128}),  # two 128-k groups a row
])
def test_grouped_gemm_matches_reference(counts, n, k, config):
    x, offsets, blocks, scales = problem(counts, n, k, seed=len(counts) + k)
    with poisoned_allocations():  # output and workspace slots start as NaN: an unwritten part shows
        workspace = FP8Workspace(2 * config["EXPERTS_PER_STAGE"], [(n, k)], "cpu")
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config, workspace=workspace)
    check_against_reference(y, x, offsets, blocks, scales)
    # and close to the product without activation quantization (e4m3 keeps 3 mantissa bits)
    exact = grouped_gemm_torch(x, offsets, blocks, scales)
    assert float((y.float() - exact).norm() / exact.norm()) < 0.05


@pytest.mark.parametrize("config", [{**REGISTERS, "BLOCK_M": 32, "BLOCK_N": 64}, {**ROWS, "BLOCK_M": 32, "BLOCK_N": 64}])
def test_experts_beyond_their_row_reference_take_group_scales(config):
    """The registers route and the row-scaled workspace route take the experts whose blocks all lie within 11
    binades of their rows' largest; the others go through the workspace with a scale per (row, 128-k group)."""
    x, offsets, blocks, scales = problem([6, 9, 5, 7], 40, 256, seed=12)
    scales[2, 5, 6] -= 12  # 12+ binades below its row's largest: expert 2 cannot be converted in registers
    scales[3, 1, 0], scales[3, 1, 1] = 130, 80  # expert 3: also an unfit block (50 below its group's top)
    blocks[3, 1, 1] |= 0x11
    ref, fits = row_references(scales)
    assert fits == [True, True, False, False] and torch.equal(ref, scales.amax(-1))
    unfit = torch.zeros(1, dtype=torch.int32)
    with poisoned_allocations():
        workspace = FP8Workspace(4, [(40, 256)], "cpu")
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config, workspace=workspace, unfit_counter=unfit)
    check_against_reference(y, x, offsets, blocks, scales)
    assert int(unfit) == mxfp4_to_fp8_torch(blocks, scales)[2] >= 1
    ref2, _ = row_references(scales)
    assert ref2 is ref  # cached per tensor
    scales[0, 0] += 1
    assert not torch.equal(row_references(scales)[0], ref)  # an in-place change is noticed


def test_byte_permute_kernels_compile_for_hopper():
    """The real compiler (sm_90, no GPU needed) takes the byte-permute inline assembly of the registers route
    (even K, plain; ragged K with W_SMEM and UNROLL) and of the conversion kernel, and the route's weights reach
    the MMA (the interpreter runs the integer twin). Launches recorded from the op, not run, with the GPU's PTX
    flag, compiled by :mod:`dsa_triton.bench.aot`."""
    from dsa_triton.bench import aot

    launches = []
    for k, config, kernels in (
            (256, {**REGISTERS, "BLOCK_M": 64, "BLOCK_N": 128}, ["_fused_gemm_kernel"]),
            (160, {**REGISTERS, "BLOCK_M": 64, "BLOCK_N": 128, "W_SMEM": 1, "UNROLL": 2}, ["_fused_gemm_kernel"]),
            (256, {**CONFIG, "BLOCK_K": 128}, ["_convert_kernel"]),  # the workspace route's conversion
            (256, {**ROWS, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128},  # row-scaled: ROW_REF, ROW_SCALED
             ["_convert_kernel", "_grouped_gemm_kernel"])):
        x, offsets, blocks, scales = problem([40, 30], 128, k, seed=k)
        with aot.record_launches(execute=False) as recorded:
            try:
                fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
            except (IndexError, RuntimeError, ValueError):  # host code read an output the skipped launch left
                pass
        for kernel in kernels:
            (launch,) = [r for r in recorded if r["kernel"] == kernel]
            flags = [launch["values"][f] for f in ("ROW_REF", "ROW_SCALED") if f in launch["values"]]
            assert flags == [bool(config["ROW_SCALED"])] * len(flags)
            launch["values"]["PTX"] = True
            launches.append({**launch, "ptx_needles": ["prmt.b32"]})
    results = aot.compile_in_subprocess(launches, info=True)
    assert [r["error"] for r in results] == [None] * 5, results
    assert [r["ptx_has"]["prmt.b32"] for r in results] == [True, True, True, True, False]
    assert [r["gmma"] > 0 for r in results] == [True, True, False, False, True]


@pytest.mark.parametrize("config", [CONFIG, REGISTERS, ROWS])
def test_k_short_of_the_padded_weights_and_rows_outside_every_expert(config):
    x, _, blocks, scales = problem([10, 10, 10], 40, 80, seed=5, k_weights=96)  # x has K = 80, weights 96
    offsets = torch.tensor([3, 9, 9, 26], dtype=torch.int32)  # rows 0..2 and 26..29 belong to no expert
    with poisoned_allocations():
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    check_against_reference(y, x, offsets, blocks, scales)
    assert not y[:3].any() and not y[26:].any()
    none = fp8_grouped_gemm(x, torch.zeros(4, dtype=torch.int32), blocks, scales, config=config)
    assert none.shape == (30, 40) and not none.any()


@pytest.mark.parametrize("config", [{**REGISTERS, "BLOCK_M": 32, "BLOCK_N": 64}, {**ROWS, "BLOCK_M": 32, "BLOCK_N": 64}])
def test_an_expert_beyond_its_row_reference_keeps_its_low_group(config):
    """An expert whose second 128-k group lies 14 binades below its first goes through the per-group route: its
    rows, which only see that group, come out right (flushed against the row's reference they would be zero)."""
    x, offsets, blocks, scales = problem([6, 9, 5, 7], 40, 256, seed=12)
    scales[2, :, 4:] = scales[2, :, :4].amin(-1, keepdim=True) - 14
    a, b = int(offsets[2]), int(offsets[3])
    x[a:b, :128] = 0
    assert row_references(scales)[1] == [True, True, False, True]
    with poisoned_allocations():
        workspace = FP8Workspace(4, [(40, 256)], "cpu")
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config, workspace=workspace)
    check_against_reference(y, x, offsets, blocks, scales)
    ref = fp8_grouped_gemm_torch(x, offsets, blocks, scales)[a:b]
    assert float((y[a:b].float() - ref).norm() / ref.norm()) < 1e-2


def test_unfit_blocks_are_counted_in_the_given_workspace():
    x, offsets, blocks, scales = problem([5, 6, 7], 24, 128, seed=9)
    scales[1, 3, 0], scales[1, 3, 1] = 130, 80  # 50 binades below the group top: flushed, counted
    blocks[1, 3, 1] |= 0x11  # make sure it holds nonzero codes
    workspace = FP8Workspace(4, [(24, 128)], "cpu")
    unfit = torch.zeros(1, dtype=torch.int32)
    y = fp8_grouped_gemm(x, offsets, blocks, scales, config=CONFIG, workspace=workspace, unfit_counter=unfit)
    assert int(unfit) == mxfp4_to_fp8_torch(blocks, scales)[2] >= 1
    check_against_reference(y, x, offsets, blocks, scales)  # one flushed block of 2^-50 weights: invisible
    assert workspace._free_run(workspace.slots) == 0  # the lease was released


@pytest.mark.parametrize("counts", [[0], [3], [2, 0, 5], [0, 0, 0]])
def test_default_config_serves_few_rows_and_one_expert(counts):
    # the default tile must respect the constraint's BLOCK_M <= max(16, bucket(M)) and stage <= bucket(E)
    x, offsets, blocks, scales = problem(counts, 24, 64, seed=len(counts) + sum(counts))
    for shape in ({"M": sum(counts), "E": len(counts), "N": 24, "K": 64},
                  {"M": 20, "E": 1, "N": 4096, "K": 7168}, {"M": 0, "E": 256, "N": 4096, "K": 7168},
                  {"M": 131072, "E": 256, "N": 4096, "K": 7168}, {"M": 300, "E": 1, "N": 4096, "K": 7168},
                  {"M": 1000, "E": 8, "N": 32768, "K": 32768}):  # row-scaled defaults; a stage under 4 GiB
        spec = registry.get("fp8_grouped_gemm")
        assert spec.is_valid(spec.default("prefill", shape), shape), shape
    with poisoned_allocations():
        y = fp8_grouped_gemm(x, offsets, blocks, scales)
    if sum(counts):
        check_against_reference(y, x, offsets, blocks, scales)
    assert y.shape == (sum(counts), 24)


def test_default_takes_the_row_scaled_route_above_256_rows_per_expert():
    x, offsets, blocks, scales = problem([300, 220], 128, 256, seed=4)
    config = registry.get("fp8_grouped_gemm").default("prefill", {"M": 520, "E": 2, "N": 128, "K": 256})
    assert (config["IN_REGISTERS"], config["ROW_SCALED"]) == (0, 1)
    with poisoned_allocations():
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    check_against_reference(y, x, offsets, blocks, scales)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "x": a["x"].float()}, "x_sorted: dtype"),
    (lambda a: {**a, "x": a["x"][:, :60]}, "x_sorted: K = 60"),
    (lambda a: {**a, "offsets": a["offsets"][:-1]}, "expert_offsets: dimension 0"),
    (lambda a: {**a, "offsets": a["offsets"].to("meta")}, "expert_offsets: expected a tensor on cpu"),
    (lambda a: {**a, "offsets": torch.tensor([0, 9, 4, 20], dtype=torch.int32)}, "expert_offsets: must be non-decreasing"),
    (lambda a: {**a, "offsets": torch.tensor([0, 9, 14, 21], dtype=torch.int32)}, r"within \[0, 20\]"),
    (lambda a: {**a, "scales": a["scales"][:2]}, "scales: dimension 0"),
    (lambda a: {**a, "blocks": a["blocks"].view(3, 16, 3, 2, 8)}, "blocks: expected 4 dimensions"),
    (lambda a: {**a, "workspace": object()}, "workspace: expected an FP8Workspace"),
    (lambda a: {**a, "config": {**CONFIG, "BLOCK_K": 256}}, "BLOCK_K=256"),
    (lambda a: {**a, "config": {**REGISTERS, "OVERLAP": 0}}, "OVERLAP are choices of the workspace route"),
])
def test_bad_arguments_raise_value_errors(change, match):
    x, offsets, blocks, scales = problem([9, 5, 6], 16, 96, seed=1)
    args = change({"x": x, "offsets": offsets, "blocks": blocks, "scales": scales, "workspace": None, "config": CONFIG})
    with pytest.raises(ValueError, match=match):
        fp8_grouped_gemm(args["x"], args["offsets"], args["blocks"], args["scales"], config=args["config"],
                         workspace=args["workspace"])


def test_registry_entry_checks_out_and_catches_a_wrong_result():
    spec = registry.get("fp8_grouped_gemm")
    (shape,) = spec.bench_shapes("prefill", False)
    inputs = spec.make_inputs("prefill", shape, torch.device("cpu"), 2)
    ref = spec.reference(inputs)
    out = spec.run(inputs, spec.launch_config("prefill", shape, "cpu"))
    assert spec.compare(out, ref) is None
    assert spec.compare(out * 1.05, ref) is not None
    exact = grouped_gemm_torch(inputs["x"], inputs["offsets"], inputs["weights"].blocks, inputs["weights"].scales)
    baseline = spec.baseline(inputs).float()  # torch._scaled_mm per expert on an FP8 copy: the same product
    assert float((baseline - exact).norm() / exact.norm()) < 0.05
    big = {"M": 32768, "E": 256, "N": 4096, "K": 7168}
    assert spec.is_valid(spec.default("prefill", big), big)
    assert "accumulator" in spec.constraint({**CONFIG, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 4}, big)
    assert "expert count" in spec.constraint({**CONFIG, "EXPERTS_PER_STAGE": 16}, shape)


def test_prefill_report_runs_both_routes_on_the_cpu(monkeypatch):
    """The moe_prefill report's CPU rows: every path runs and agrees with the bf16 baseline, with a W_SMEM=1,
    UNROLL=2 registers config as the launch config (the report's workspace-route config must drop both)."""
    spec = registry.get("fp8_grouped_gemm")
    default = spec.launch_config
    monkeypatch.setattr(spec, "launch_config", lambda *a, **k: {**default(*a, **k), "W_SMEM": 1, "UNROLL": 2})
    rows = REPORTS["moe_prefill"](torch.device("cpu"), None)
    assert [r["gemm"] for r in rows] == ["gate_up", "down"]
    for r in rows:
        assert "error" not in r and max(r["rel_err"], r["rel_err_workspace"], r["rel_err_registers"]) < 0.05, r
        assert json.loads(r["config"])["W_SMEM"] == 1 and json.loads(r["config"])["UNROLL"] == 2
        times = [r[k] for k in ("ours_us", "registers_us", "workspace_us", "convert_us", "gemm_us", "pipelined_us")]
        assert all(t > 0 for t in times), times  # NaN (a path that raised) fails too


def test_device_plan_is_the_host_plan_plus_zero_and_padding_tiles():
    offsets = torch.tensor([3, 3, 10, 30, 31, 35], dtype=torch.int32)  # rows 0-2 and 35-39 of no expert
    plan = plan_on_device(offsets, 8, 40)
    host = plan_stages(offsets.tolist(), 8, None, "cpu")
    tiles = plan.tiles.tolist()
    experts = [(host.experts[slot].item(), a, b) for slot, a, b in host.tiles.tolist()]
    assert [t for t in tiles if t[0] >= 0] == [list(t) for t in experts]
    assert [t for t in tiles if t[0] < 0 and t[2] > t[1]] == [[-1, 0, 3], [-1, 35, 40]]  # zero tiles
    assert len(tiles) == 5 + 5 + 2 and tiles[-1] == [-1, 0, 0]  # padded to cdiv(40, 8) + E + 2, empty
    # unchecked values (decreasing, past the rows) are clamped: every tile's rows lie in [0, 40)
    wild = plan_on_device(torch.tensor([5, 2, 90, -4, 41, 7], dtype=torch.int32), 8, 40).tiles
    assert int(wild[:, 1].min()) >= 0 and int(wild[:, 2].max()) <= 40 and bool((wild[:, 1] <= wild[:, 2]).all())


@pytest.mark.parametrize("k", [256, 160])  # the interleaved k order and the ragged one
def test_unchecked_call_plans_on_the_device_and_matches_the_checked_one(k, monkeypatch):
    x, offsets, blocks, scales = problem([6, 0, 13, 5], 40, k, seed=k)
    x = torch.cat([torch.randn(3, k).half(), x, torch.randn(5, k).half()])  # rows of no expert at both ends
    offsets = offsets + 3
    config = {**REGISTERS, "BLOCK_M": 16, "BLOCK_N": 32}
    with poisoned_allocations():
        checked = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    row_references(scales)  # the weights' one sync (cached since the checked call): not the call's
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("the unchecked call read a tensor on the host"))
    with poisoned_allocations():
        unchecked = fp8_grouped_gemm(x, offsets, blocks, scales, config=config, check_values=False)
    monkeypatch.undo()
    assert torch.equal(unchecked, checked)
    assert not unchecked[:3].any() and not unchecked[-5:].any()
    check_against_reference(unchecked[3:-5], x[3:-5], offsets - 3, blocks, scales)


def test_unchecked_call_with_an_unfit_expert_plans_on_the_host(monkeypatch):
    x, offsets, blocks, scales = problem([6, 9, 5], 40, 256, seed=4)
    scales[1, 3, 0] -= 12  # expert 1 cannot take the registers route: the workspace route needs host offsets
    reads, read = [], fp8_grouped_gemm_module._host_offsets
    monkeypatch.setattr(fp8_grouped_gemm_module, "_host_offsets", lambda *a, **kw: reads.append(1) or read(*a, **kw))
    with poisoned_allocations():
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config={**REGISTERS, "BLOCK_M": 16, "BLOCK_N": 32},
                             check_values=False)
    assert reads == [1]  # read once, for both routes' plans
    check_against_reference(y, x, offsets, blocks, scales)


@pytest.mark.parametrize("config", [CONFIG, REGISTERS, ROWS])
def test_offsets_are_read_on_the_host_after_the_quantization_is_launched(config, monkeypatch):
    """The checked call enqueues the activation quantization before it reads the offsets (on the GPU from a side
    stream, behind the offsets' producers only), so the quantization runs while the host plans the tiles."""
    calls = []
    quantize, read = fp8_grouped_gemm_module.quantize_activations_fp8, fp8_grouped_gemm_module._host_offsets
    monkeypatch.setattr(fp8_grouped_gemm_module, "quantize_activations_fp8",
                        lambda *a, **kw: calls.append("quantize") or quantize(*a, **kw))
    monkeypatch.setattr(fp8_grouped_gemm_module, "_host_offsets", lambda *a, **kw: calls.append("read") or read(*a, **kw))
    x, offsets, blocks, scales = problem([5, 0, 11], 40, 256, seed=6)
    with poisoned_allocations():
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    assert calls == ["quantize", "read"]
    check_against_reference(y, x, offsets, blocks, scales)


@pytest.mark.parametrize("config", [CONFIG, REGISTERS, ROWS])
@pytest.mark.parametrize("whole_row", [False, True])  # one block (the per-group route), or a row that still fits
def test_a_nan_scale_is_rejected_when_checked_and_gives_nan_unchecked(config, whole_row):
    """E8M0 0xFF is NaN: the checked call names the block; the unchecked one (no scan) turns the weight row's
    outputs to NaN for the rows of its expert instead of a finite number, and leaves every other output as it was."""
    x, offsets, blocks, scales = problem([6, 9, 5], 40, 160, seed=21)
    clean = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    if whole_row:
        scales[1, 3] = 0xFF
    else:
        scales[1, 3, 2] = 0xFF
    with pytest.raises(ValueError, match=r"scales: block \(1, 3, [02]\) \(k (0|64)\.\..*0xFF"):
        fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    with poisoned_allocations():
        y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config, check_values=False)
    expected = torch.zeros_like(y, dtype=torch.bool)
    expected[6:15, 3] = True
    assert torch.equal(y.isnan(), expected)
    assert torch.equal(y[~expected], clean[~expected])


@pytest.mark.parametrize("tile", [8192, 64])  # one pass, or two
def test_a_non_finite_activation_row_quantizes_to_a_nan_scale(tile, monkeypatch):
    monkeypatch.setattr(fp8_grouped_gemm_module, "QUANTIZE_TILE", tile)
    monkeypatch.setattr(fp8_grouped_gemm_module, "QUANTIZE_STEP", (4, 64))
    x = torch.randn(6, 160, generator=torch.Generator().manual_seed(8)).half()
    x[1, 100], x[3, 7], x[4, 159] = float("nan"), float("inf"), -float("inf")
    q, s = quantize_activations_fp8(x)
    ref_q, ref_s = quantize_rows_fp8_torch(x)
    bad = torch.tensor([False, True, False, True, True, False])
    assert torch.equal(s.isnan(), bad) and torch.equal(ref_s.isnan(), bad)
    assert torch.equal(s[~bad], ref_s[~bad]) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert not q[bad].view(torch.uint8).any()  # the row's elements are 0, its scale NaN


@pytest.mark.parametrize("config", [CONFIG, REGISTERS, ROWS])
def test_a_nan_activation_gives_a_nan_output_row(config):
    x, offsets, blocks, scales = problem([6, 9, 5], 40, 160, seed=22)
    clean = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    x[7, 33] = float("nan")
    y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config)
    assert bool(y[7].isnan().all()) and not y[torch.arange(20) != 7].isnan().any()
    assert torch.equal(y[torch.arange(20) != 7], clean[torch.arange(20) != 7])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled code only: the interpreter takes no PTX path")
@pytest.mark.parametrize("k", [96, 160, 256])
def test_registers_route_default_is_right_on_the_gpu_at_ragged_k(k):
    """Issue 19: at K = 96 and 160 (not a multiple of 128) the registers route's default config (64-wide N tiles,
    2 stages) gave wrong sums on the H200 while the interpreter passed: the converted words were reread as bytes
    by a packed inline ``mov`` whose grouping of registers the compiler's layout did not keep."""
    spec = registry.get("fp8_grouped_gemm")
    shape = {"M": 40, "E": 5, "N": 48, "K": k}
    inputs = spec.make_inputs("prefill", shape, torch.device("cuda"), 0)
    config = spec.default("prefill", shape)
    assert config["IN_REGISTERS"] == 1
    assert spec.compare(spec.run(inputs, config), spec.reference(inputs)) is None
