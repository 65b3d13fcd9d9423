"""Expert sort, block alignment and the fused MXFP4 grouped GEMM (interpreter) against their references."""
import itertools

import pytest
import torch

from dsa_triton import ConfigError, registry
from dsa_triton.moe import fused_moe_gemm as fused_module
from dsa_triton.moe.fused_moe_gemm import fused_moe_gemm
from dsa_triton.moe.fused_moe_gemm_spec import SPEC
from dsa_triton.moe.formats import class_major
from dsa_triton.moe.fused_moe_gemm_reference import fused_moe_gemm_torch
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch
from dsa_triton.moe.permute import combine_rows, max_padded_rows, sort_by_expert
from dsa_triton.moe.sort_and_align_spec import random_routing
from tests.poison import poisoned_allocations

CPU = torch.device("cpu")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def routing(tokens, experts, top_k, seed):
    return random_routing(tokens, experts, top_k, CPU, gen(seed))


def experts_mxfp4(experts, n, k, seed):
    w = torch.randn(experts, n, k, generator=gen(seed)) * 0.05
    return mxfp4_quantize_torch(w)


# -- permutation ----------------------------------------------------------------------------------
def test_sort_by_expert_matches_a_direct_construction():
    weights, ids = routing(6, 7, 3, seed=1)
    sort = sort_by_expert(ids, weights, 7)
    slots = sorted(range(18), key=lambda s: (int(ids.view(-1)[s]), s))
    assert sort.sorted_slot.tolist() == slots
    assert sort.sorted_token.tolist() == [s // 3 for s in slots]
    assert sort.sorted_expert.tolist() == [int(ids.view(-1)[s]) for s in slots]
    assert torch.equal(sort.slot_weight, weights.view(-1))
    counts = torch.bincount(ids.view(-1).long(), minlength=7)
    assert sort.expert_offsets.tolist() == [0] + counts.cumsum(0).tolist()
    assert torch.equal(sort.sorted_slot[sort.slot_row.long()], torch.arange(18, dtype=torch.int32))


def test_sizes_past_int32_raise_naming_them():
    """num_experts and block_m size the offsets and the padded rows (int32): past 2^31 - 1 a ValueError names them
    before anything is allocated (it was an allocation RuntimeError or a ZeroDivisionError)."""
    from dsa_triton.moe.sort_and_align import sort_and_align

    weights, ids = routing(2, 5, 2, seed=1)
    for call in (lambda: sort_by_expert(ids, weights, 2**40), lambda: sort_and_align(ids, weights, 2**31, 8)):
        with pytest.raises(ValueError, match="^num_experts: must be"):
            call()
    for call in (lambda: sort_by_expert(ids, weights, 5).aligned(2**40),
                 lambda: sort_and_align(ids, weights, 5, 2**31)):
        with pytest.raises(ValueError, match="^block_m: must be"):
            call()


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_block_alignment_pads_each_expert_and_marks_padding(block_m):
    experts = 9
    weights, ids = routing(5, experts, 2, seed=block_m)  # 10 routes over 9 experts: some get none
    sort = sort_by_expert(ids, weights, experts)
    a = sort.aligned(block_m)
    assert a is sort.aligned(block_m)  # cached
    assert a.padded_rows.numel() == max_padded_rows(10, experts, block_m) == a.num_blocks * block_m
    rows = a.padded_rows.view(-1, block_m)
    real = a.padded_rows[a.padded_rows >= 0]
    assert sorted(real.tolist()) == list(range(10))  # every sorted row exactly once
    offsets = sort.expert_offsets.tolist()
    for b, e in enumerate(a.block_expert.tolist()):
        if e < 0:
            assert (rows[b] == -1).all()
            assert (a.block_expert[b:] == -1).all()
            continue
        got = rows[b][rows[b] >= 0].tolist()
        assert got and all(offsets[e] <= r < offsets[e + 1] for r in got)
        assert rows[b].tolist() == got + [-1] * (block_m - len(got))  # padding only at the block's end
    used = set(a.block_expert.tolist()) - {-1}
    assert used == {e for e in range(experts) if offsets[e + 1] > offsets[e]}


def test_combine_rows_weights_and_sums_each_tokens_rows():
    weights, ids = routing(4, 5, 2, seed=3)
    sort = sort_by_expert(ids, weights, 5)
    y = torch.randn(8, 6, generator=gen(4))
    expected = torch.stack([sum(weights[t, j] * y[int(sort.slot_row[t * 2 + j])] for j in range(2)) for t in range(4)])
    torch.testing.assert_close(combine_rows(y, sort), expected)


@pytest.mark.parametrize("call, match", [
    (lambda ids, w: sort_by_expert(ids.float(), w, 5), "topk_ids"),
    (lambda ids, w: sort_by_expert(ids[0], w, 5), "topk_ids"),
    (lambda ids, w: sort_by_expert(ids + 5, w, 5), "topk_ids"),
    (lambda ids, w: sort_by_expert(ids - 1, w, 5), "topk_ids"),
    (lambda ids, w: sort_by_expert(ids, w[:, :1], 5), "topk_weights"),
    (lambda ids, w: sort_by_expert(ids, w, 0), "num_experts"),
])
def test_sort_bad_inputs(call, match):
    w, ids = routing(3, 5, 2, seed=0)
    with pytest.raises(ValueError, match=match):
        call(ids, w)


# -- the fused GEMM ----------------------------------------------------------------------------------
def cfg(bm, bn, bk, split=1, warps=2, stages=2, x_copy=1):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "num_stages": stages,
            "X_COPY": x_copy}


@pytest.mark.parametrize("tokens, experts, top_k, n, k, gather, dtype, config", [
    (1, 5, 2, 40, 96, True, torch.float16, cfg(8, 32, 64)),        # T=1; 3 of 5 experts idle; K = 3 groups, ragged tile
    (1, 7, 3, 40, 96, True, torch.float16, cfg(16, 16, 128, warps=2)),  # K < BLOCK_K, N not a multiple of 16
    (4, 7, 3, 48, 160, True, torch.float16, cfg(8, 32, 64, split=2)),  # K = 5 x 32, split-K atomics
    (4, 7, 3, 48, 160, True, torch.bfloat16, cfg(8, 32, 64, stages=1, warps=2)),  # bf16 (fp32 dots in the interpreter)
    (5, 5, 2, 24, 64, False, torch.float16, cfg(16, 32, 64, warps=4)),  # down-GEMM form (sorted rows)
    (3, 5, 2, 24, 256, False, torch.bfloat16, cfg(16, 32, 128, split=2, warps=4)),  # bf16 with split-K atomics
    (6, 5, 3, 33, 96, False, torch.float16, cfg(32, 32, 128, warps=4)),  # N = 33, 32-row blocks
    # activations read in place (X_COPY=0): gathered tokens with ragged K, sorted rows with split-K, bf16
    (1, 5, 2, 40, 96, True, torch.float16, cfg(8, 32, 64, x_copy=0)),
    (3, 5, 2, 24, 256, False, torch.bfloat16, cfg(16, 32, 128, split=2, warps=4, x_copy=0)),
    (6, 5, 3, 33, 96, False, torch.float16, cfg(32, 32, 128, warps=4, x_copy=0)),
])
def test_fused_gemm_matches_reference(tokens, experts, top_k, n, k, gather, dtype, config):
    weights, ids = routing(tokens, experts, top_k, seed=tokens + experts)
    sort = sort_by_expert(ids, weights, experts)
    blocks, scales = experts_mxfp4(experts, n, k, seed=n + k)
    x = torch.randn(tokens if gather else tokens * top_k, k, generator=gen(k)).to(dtype)
    with poisoned_allocations():
        y = fused_moe_gemm(x, sort, blocks, scales, gather_tokens=gather, config=config)
    ref = fused_moe_gemm_torch(x, sort, blocks, scales, gather)
    assert y.dtype == dtype and y.shape == (tokens * top_k, n)
    assert torch.isfinite(y).all()
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("gather, config", [
    (False, cfg(8, 32, 64, split=2, x_copy=0)),  # the layer's down GEMM; X_COPY has no effect on class-major rows
    (True, cfg(16, 16, 128, warps=2)),  # gathered tokens, K < BLOCK_K
])
def test_fused_gemm_reads_class_major_activations(gather, config):
    weights, ids = routing(3, 5, 2, seed=11)
    sort = sort_by_expert(ids, weights, 5)
    blocks, scales = experts_mxfp4(5, 24, 96, seed=12)
    x = torch.randn(3 if gather else 6, 96, generator=gen(13)).half()
    with poisoned_allocations():
        y = fused_moe_gemm(class_major(x), sort, blocks, scales, gather_tokens=gather, config=config)
    ref = fused_moe_gemm_torch(x, sort, blocks, scales, gather)  # from the rows themselves
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="x: dimension 2"):
        fused_moe_gemm(class_major(x)[:, :, :-1], sort, blocks, scales, gather_tokens=gather, config=config)
    with pytest.raises(ValueError, match="x: class-major rows"):
        padded = torch.randn(x.shape[0], 4, 24 + 8).half()[:, :, :24]  # classes 32 apart, not 24
        fused_moe_gemm(padded, sort, blocks, scales, gather_tokens=gather, config=config)


def identity_problem(k, dtype):
    """One expert, k tokens routed to it, x = identity: y_sorted[t] is column t of W, exactly."""
    ids = torch.zeros(k, 1, dtype=torch.int32)
    sort = sort_by_expert(ids, None, 1)
    return torch.eye(k, dtype=dtype), sort


@pytest.mark.parametrize("dtype, config, scale_range", [
    (torch.float16, cfg(16, 32, 64), (116, 138)),  # every E2M1 code, fp16-exact scales
    (torch.bfloat16, cfg(8, 32, 64), (20, 240)),    # bf16 activations, the interpreter path's full scale range
    (torch.float16, cfg(16, 32, 64, x_copy=0), (116, 138)),  # activations read in place
])
def test_dequantization_in_registers_is_exact(dtype, config, scale_range):
    n, k = 32, 64
    x, sort = identity_problem(k, dtype)
    blocks = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(1, n, k // 32, 16)
    scales = torch.randint(*scale_range, (1, n, k // 32), generator=gen(9)).to(torch.uint8)
    with poisoned_allocations():
        y = fused_moe_gemm(x, sort, blocks, scales, config=config)
    expected = mxfp4_dequantize_torch(blocks[0], scales[0], dtype).t()
    assert torch.equal(y, expected)


def test_default_config_and_registry_entry():
    shape = SPEC.bench_shapes("decode", False)[0]
    inputs = SPEC.make_inputs("decode", shape, CPU, 5)
    out = SPEC.run(inputs, SPEC.launch_config("decode", shape, CPU))
    assert SPEC.compare(out, SPEC.reference(inputs)) is None
    assert SPEC.compare(out.float() + 1.0, SPEC.reference(inputs)) is not None
    assert registry.get("fused_moe_gemm") is SPEC
    gpu = SPEC.bench_shapes("decode", True)
    assert {(s["N"], s["K"]) for s in gpu} == {(4096, 7168), (7168, 2048)} and {s["T"] for s in gpu} == {1, 8, 32, 128}
    for s in gpu:  # the defaults are valid configs (registration checks it too), at any token count
        for tokens in (s["T"], 0, 300, 5000, 70000):  # many rows per expert: 64-row blocks
            SPEC.validate(dict(SPEC.default("decode", {**s, "T": tokens})), {**s, "T": tokens})


def test_constraints_reject_bad_tiles():
    shape = {"T": 4, "E": 8, "top_k": 2, "N": 256, "K": 512}
    with pytest.raises(ConfigError, match="BLOCK_M"):
        SPEC.validate(cfg(1, 64, 64), shape)  # not in the space: tl.dot needs 8+ rows
    with pytest.raises(ConfigError, match="SPLIT_K"):
        SPEC.validate(cfg(8, 64, 256, split=4), shape)
    with pytest.raises(ConfigError, match="registers"):
        SPEC.validate(cfg(8, 256, 512, warps=2), shape)
    with pytest.raises(ConfigError, match="too small"):
        SPEC.validate(cfg(8, 16, 64, warps=8), shape)
    assert {c["BLOCK_M"] for c in SPEC.configs(shape)} == {8, 16}  # 8 routed rows: no larger block


def test_fused_gemm_bad_inputs_raise_naming_the_argument():
    weights, ids = routing(2, 5, 2, seed=0)
    sort = sort_by_expert(ids, weights, 5)
    blocks, scales = experts_mxfp4(5, 16, 64, seed=0)
    x = torch.randn(2, 64).half()
    good = cfg(16, 16, 64)
    fused_moe_gemm(x, sort, blocks, scales, config=good)  # a good call first: its checks are cached, bad calls still raise
    misaligned = torch.empty(blocks.numel() + 2, dtype=torch.uint8)[2:].view(blocks.shape).copy_(blocks)
    cases = [
        (lambda: fused_moe_gemm(x, sort, misaligned, scales, config=good), "blocks"),  # same metadata, off by 2 bytes
        (lambda: fused_moe_gemm(x, sort, blocks, scales, config=good, out_dtype=torch.int32), "out_dtype"),
        (lambda: fused_moe_gemm(x.float(), sort, blocks, scales), "x"),
        (lambda: fused_moe_gemm(x[:, :32], sort, blocks, scales), "x"),
        (lambda: fused_moe_gemm(x, sort, blocks, scales, gather_tokens=False), "x"),
        (lambda: fused_moe_gemm(x, sort, blocks[:4], scales[:4]), "blocks"),
        (lambda: fused_moe_gemm(x, sort, blocks.float(), scales), "blocks"),
        (lambda: fused_moe_gemm(x, sort, blocks, scales[:, :8]), "scales"),
        (lambda: fused_moe_gemm(x, sort, blocks.transpose(1, 2).contiguous().transpose(1, 2), scales), "blocks"),
        (lambda: fused_moe_gemm(x, (ids, weights), blocks, scales), "sort"),
        (lambda: fused_moe_gemm(x, sort, blocks, scales, config=cfg(1, 16, 64)), "BLOCK_M"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_scale_bytes_above_the_paths_range_raise_once_per_version():
    weights, ids = routing(2, 5, 2, seed=1)
    sort = sort_by_expert(ids, weights, 5)
    blocks, scales = experts_mxfp4(5, 32, 64, seed=1)
    x = torch.randn(2, 64, generator=gen(1)).half()
    config = cfg(8, 32, 64)
    fused_moe_gemm(x, sort, blocks, scales, config=config)  # in range: checked, remembered
    scales[3, 7, 1] = 250  # in place: a new version is read again
    with pytest.raises(ValueError, match="scales: bytes must be at most 140 .* got 250"):
        fused_moe_gemm(x, sort, blocks, scales, config=config)
    scales[3, 7, 1] = 0xFF  # NaN in E8M0
    with pytest.raises(ValueError, match="scales"):
        fused_moe_gemm(x, sort, blocks, scales, config=config)
    scales[3, 7, 1] = 0  # small bytes are fine (all-zero blocks often carry 0)
    fused_moe_gemm(x, sort, blocks, scales, config=config)
    assert fused_module.SCALE_MAX["bf16 gpu"] == 192  # the bf16 GPU path (inline PTX), not reachable on the CPU


@pytest.mark.parametrize("byte", [141, 240])
def test_fp16_path_bound_keeps_every_weight_finite(byte):
    """fp16 activations: the weights are rounded to fp16, whose largest block is 6 * 2^(140 - 127) = 49152. Every
    byte up to 140 is exact (identity activations give the weights themselves); a larger one (up to 240 was
    accepted) made infinite weights and NaN outputs where the reference is finite: a ValueError naming scales."""
    n, k = 32, 64
    x, sort = identity_problem(k, torch.float16)
    blocks = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(1, n, k // 32, 16)
    scales = torch.randint(104, 141, (1, n, k // 32), generator=gen(byte)).to(torch.uint8)
    scales[0, :4] = 140
    y = fused_moe_gemm(x, sort, blocks, scales, config=cfg(16, 32, 64))
    assert torch.equal(y, mxfp4_dequantize_torch(blocks[0], scales[0], torch.float16).t())
    scales[0, 3, 1] = byte
    with pytest.raises(ValueError, match=f"scales: bytes must be at most 140 .* got {byte}"):
        fused_moe_gemm(x, sort, blocks, scales, config=cfg(16, 32, 64))
    assert fused_module.scale_max(x) == 140 and fused_module.scale_max(x.bfloat16()) == 240  # (the interpreter's)


def test_kernel_compiles_for_hopper():
    """The GPU compiler (sm_90, no GPU needed) accepts the kernel: the bf16 inline-PTX path and the fp16 one,
    mma.sync (8-row blocks) and wgmma tiles, ragged K, split-K and both X_COPY forms. The interpreter runs neither
    the PTX nor the real compiler, so this is the CPU's only check of the GPU path. Launches recorded from the op
    (not run), with the GPU's path flags, compiled by :mod:`dsa_triton.bench.aot`."""
    from dsa_triton.bench import aot

    cases = [(8, 64, 256, 1, 4, 3, torch.bfloat16, 256, 1), (8, 64, 128, 2, 2, 4, torch.bfloat16, 160, 0),
             (16, 128, 128, 1, 4, 3, torch.bfloat16, 256, 0), (64, 128, 128, 2, 4, 3, torch.float16, 160, 1)]
    weights, ids = routing(16, 5, 4, seed=3)
    sort = sort_by_expert(ids, weights, 5)
    launches = []
    for bm, bn, bk, split, warps, stages, dtype, k, x_copy in cases:
        blocks, scales = experts_mxfp4(5, 128, k, seed=k)
        with aot.record_launches(execute=False) as recorded:
            fused_moe_gemm(torch.randn(16, k).to(dtype), sort, blocks, scales,
                           config=cfg(bm, bn, bk, split, warps, stages, x_copy))
        (launch,) = [r for r in recorded if r["kernel"] == "_fused_moe_kernel"]
        launch["values"].update(FAST=dtype == torch.bfloat16, DOT_F32=False)  # the GPU's paths
        launches.append({**launch, "ptx_needles": ["0x000F000F"]})  # a mask of the bf16 path's inline PTX
    results = aot.compile_in_subprocess(launches, info=True)
    assert [r["error"] for r in results] == [None] * len(cases), results
    assert [r["ptx_has"]["0x000F000F"] for r in results] == [c[6] == torch.bfloat16 for c in cases]
    assert [r["gmma"] > 0 for r in results] == [c[0] >= 16 for c in cases]  # wgmma beyond 8-row blocks


def test_registry_inputs_run_reference_and_baseline_agree():
    """The registry's CPU shapes (gate_up gathers tokens; down reads class-major rows, as the layer passes them,
    and the bf16 baseline its row-major twin): op, oracle and baseline agree, and a wrong result is caught."""
    for shape in SPEC.bench_shapes("decode", False):
        inputs = SPEC.make_inputs("decode", shape, CPU, 3)
        assert inputs["x"].dim() == (2 if shape["gather"] else 3)
        ref = SPEC.reference(inputs)
        out = SPEC.run(inputs, SPEC.launch_config("decode", shape, "cpu"))
        assert SPEC.compare(out, ref) is None
        assert SPEC.compare(SPEC.baseline(inputs), ref) is None
        assert SPEC.compare(out * 1.05, ref) is not None


def test_the_default_config_is_valid_for_every_shape_the_op_takes():
    """Any N (narrow ones included: 1, 16, 17, 32), any K that is a multiple of 32, any token count and routing."""
    for n, k, tokens, (experts, top_k) in itertools.product((1, 16, 17, 23, 32, 33, 48, 100, 4096),
                                                             (32, 64, 96, 2048, 7168), (0, 1, 3, 64, 5000),
                                                             ((1, 1), (5, 2), (256, 8))):
        shape = {"T": tokens, "E": experts, "top_k": top_k, "N": n, "K": k}
        SPEC.validate(dict(SPEC.default("decode", shape)), shape)


@pytest.mark.parametrize("n", [16, 32, 23])
def test_narrow_n_runs_with_the_default_config(n):
    weights, ids = routing(3, 5, 2, seed=n)
    sort = sort_by_expert(ids, weights, 5)
    blocks, scales = experts_mxfp4(5, n, 64, seed=n)
    x = torch.randn(3, 64, generator=gen(n)).half()
    with poisoned_allocations():
        y = fused_moe_gemm(x, sort, blocks, scales)
    torch.testing.assert_close(y.float(), fused_moe_gemm_torch(x, sort, blocks, scales), rtol=2e-3, atol=2e-3)
