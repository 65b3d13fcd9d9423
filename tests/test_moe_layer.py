"""The MoE layer (interpreter): moe_forward against the all-fp32 oracle, path choice, argument checks, and the
decode path's host work (no syncing op, five or six launches)."""
import importlib

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

import dsa_triton as dt
from dsa_triton.moe import activation, fused_moe_gemm
from dsa_triton.bench.reports.moe_decode import AtenOpCounter
from dsa_triton.moe.moe_forward_spec import SPEC, compare_layer
from dsa_triton.moe.moe_forward_reference import moe_forward_torch
from dsa_triton.moe.mxfp4_reference import mxfp4_quantize_torch
from dsa_triton.moe.routing import RoutingConfig
from tests.poison import poisoned_allocations

DEEPSEEK = RoutingConfig("deepseek", top_k=2, n_group=3, topk_group=2, routed_scaling_factor=2.5)
SOFTMAX = RoutingConfig("softmax", top_k=2)


def layer(tokens, experts, hidden, inter, routing, shared=True, seed=0):
    """Random layer arguments: fp16 activations, MXFP4 experts quantized from Gaussian weights."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *size, scale=1.0: torch.randn(*size, generator=g) * scale
    gu_blocks, gu_scales = mxfp4_quantize_torch(rand(experts, 2 * inter, hidden, scale=hidden ** -0.5))
    dn_blocks, dn_scales = mxfp4_quantize_torch(rand(experts, hidden, inter, scale=inter ** -0.5))
    args = (rand(tokens, hidden).half(), rand(experts, hidden, scale=hidden ** -0.5), gu_blocks, gu_scales,
            dn_blocks, dn_scales)
    kwargs = {"routing": routing, "router_bias": rand(experts, scale=0.1) if routing.mode == "deepseek" else None}
    if shared:
        kwargs["shared_gate_up"] = rand(2 * inter, hidden, scale=hidden ** -0.5).half()
        kwargs["shared_down"] = rand(hidden, inter, scale=inter ** -0.5).half()
    return args, kwargs


def assert_matches_oracle(args, kwargs, **extra):
    with poisoned_allocations():
        y = dt.moe_forward(*args, **kwargs, **extra)
    ref = moe_forward_torch(*args, **kwargs)
    assert y.dtype == torch.float16 and y.shape == args[0].shape and torch.isfinite(y).all()
    # fused path, fp16 activations: errors up to 8e-4 of the largest output (was 2e-2, room for a lost expert)
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.parametrize("tokens, experts, hidden, inter, routing, shared", [
    (1, 6, 64, 32, DEEPSEEK, True),   # T = 1: 4 of 6 experts idle
    (5, 9, 96, 64, DEEPSEEK, False),  # hidden 96 (not a multiple of 128), groups of 3
    (1, 5, 64, 32, SOFTMAX, False),   # odd E, softmax routing
    (4, 7, 64, 96, SOFTMAX, True),    # odd E, I = 96
])
def test_moe_forward_matches_oracle(tokens, experts, hidden, inter, routing, shared):
    args, kwargs = layer(tokens, experts, hidden, inter, routing, shared, seed=tokens + experts)
    assert_matches_oracle(args, kwargs)


def test_workspace_path_matches_oracle_to_fp8_precision():
    args, kwargs = layer(16, 6, 64, 32, DEEPSEEK, seed=11)
    with poisoned_allocations():
        y = dt.moe_forward(*args, **kwargs, config={"path": "workspace"})
    ref = moe_forward_torch(*args, **kwargs)
    # FP8 (e4m3) activations: about 4% relative error; a wrong expert or row would be O(1)
    assert compare_layer(y, ref) is None
    assert compare_layer(y, ref, max_relative=1e-3) is not None  # it did run the FP8 path (fused: ~5e-4)


def test_path_default_is_a_crossover_on_rows_per_expert():
    decode = {"T": 1, "E": 256, "top_k": 8, "hidden": 7168, "I": 2048}
    assert SPEC.default("decode", decode) == {"path": "fused"}
    assert SPEC.default("prefill", dict(decode, T=16384)) == {"path": "workspace"}


def test_bad_inputs_raise_naming_the_argument():
    args, kwargs = layer(2, 6, 64, 32, DEEPSEEK)
    x, router, gu_b, gu_s, dn_b, dn_s = args
    cases = [
        ((x.float(), router, gu_b, gu_s, dn_b, dn_s), {}, "x"),
        ((x, router[:5], gu_b, gu_s, dn_b, dn_s), {}, "router_weight"),
        ((x, router, gu_b[:, :, :1], gu_s, dn_b, dn_s), {}, "gate_up_blocks"),
        ((x, router, gu_b, gu_s[:, :3], dn_b, dn_s), {}, "gate_up_scales"),
        ((x, router, gu_b, gu_s, dn_b[:4], dn_s), {}, "down_blocks"),
        ((x, router, gu_b, gu_s, dn_b, dn_s[..., :0]), {}, "down_scales"),
        (args, {"router_bias": torch.zeros(5)}, "router_bias"),
        (args, {"shared_down": None}, "shared"),
        (args, {"shared_gate_up": kwargs["shared_gate_up"][:, :32]}, "shared_gate_up"),
        (args, {"routing": "deepseek"}, "routing"),
        (args, {"routing": RoutingConfig("deepseek", top_k=2, n_group=4)}, "n_group"),
        (args, {"routing": SOFTMAX}, "bias"),
        (args, {"config": {"path": "dense"}}, "path"),
    ]
    dt.moe_forward(*args, **kwargs)  # a good call first: its checked plan is cached, the bad calls still raise
    for a, override, match in cases:
        with pytest.raises(ValueError, match=match):
            dt.moe_forward(*a, **{**kwargs, **override})


def test_hidden_32_runs_with_the_default_configs():
    """The down GEMM's N is the hidden size: 32 columns take the fused GEMM's narrowest default tile."""
    args, kwargs = layer(2, 6, 32, 32, DEEPSEEK, seed=3)
    assert_matches_oracle(args, kwargs)


@pytest.mark.parametrize("path", ["fused", "workspace"])
def test_weight_errors_name_the_weight(path):
    """A NaN scale byte (0xFF), blocks off 4-byte alignment or with rows that are not contiguous: the error names
    gate_up or down, on either path, before any launch."""
    args, kwargs = layer(16, 6, 64, 32, DEEPSEEK, seed=11)
    for i, name in ((2, "gate_up"), (4, "down")):
        blocks, scales = args[i], args[i + 1]
        nan_scale = scales.clone()
        nan_scale[1, 3, 0] = 0xFF
        misaligned = torch.empty(blocks.numel() + 2, dtype=torch.uint8)[2:].view(blocks.shape).copy_(blocks)
        spread = torch.zeros(*blocks.shape[:-1], 32, dtype=torch.uint8)[..., :16].copy_(blocks)  # rows 32 bytes apart
        for j, bad, what in ((i + 1, nan_scale, "scales"), (i, misaligned, "blocks"), (i, spread, "blocks")):
            bad_args = list(args)
            bad_args[j] = bad
            with pytest.raises(ValueError, match=f"^{name}_{what}: "):
                dt.moe_forward(*bad_args, **kwargs, config={"path": path})


def test_fused_path_rejects_scale_bytes_past_the_fp16_bound():
    """fp16 activations on the fused path: a scale byte above 140 (a weight past fp16's range there) raises naming the
    scales, as fused_moe_gemm does; the workspace path (FP8 with its own scales) takes it."""
    args, kwargs = layer(4, 6, 64, 32, DEEPSEEK, seed=12)
    big = args[3].clone()
    big[2, 5, 1] = 141
    bad_args = (*args[:3], big, *args[4:])
    with pytest.raises(ValueError, match="^gate_up_scales: bytes must be at most 140"):
        dt.moe_forward(*bad_args, **kwargs, config={"path": "fused"})
    dt.moe_forward(*bad_args, **kwargs, config={"path": "workspace"})


def test_zero_tokens_give_an_empty_output():
    args, kwargs = layer(0, 6, 64, 32, DEEPSEEK)
    y = dt.moe_forward(*args, **kwargs)
    assert y.shape == (0, 64) and y.dtype == torch.float16


@pytest.mark.parametrize("routing, shared", [(DEEPSEEK, True), (SOFTMAX, False)])
def test_decode_path_runs_no_syncing_op_and_five_launches(monkeypatch, routing, shared):
    """After the first call (which reads each scales tensor's range once), a fused-path decode call has no
    host sync and no data-dependent shape, so it can be captured in a CUDA graph; its launches and torch ops
    are counted so the host path cannot grow unnoticed (Triton launches stubbed: the host path only)."""
    launches = []

    class StubKernel:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(grid)

    class StubRoute:  # routes every token to experts 0..k-1 without counting its own ops
        def __getitem__(self, grid):
            def launch(logits, bias, weights, ids, *args, **meta):
                launches.append(grid)
                with _disable_current_modes():
                    ids.copy_(torch.arange(ids.shape[1]).expand_as(ids))
                    weights.fill_(0.5)
            return launch

    class HiddenPermute:  # the real permutation kernel, the interpreter's torch ops hidden from the counter
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append(grid)
                with _disable_current_modes():
                    real_permute[grid](*args, **meta)
            return launch

    route_topk, sort_and_align = (importlib.import_module(f"dsa_triton.moe.{name}")  # the modules, not the functions
                                  for name in ("route_topk", "sort_and_align"))
    real_permute = sort_and_align._permute_kernel
    monkeypatch.setattr(fused_moe_gemm, "_fused_moe_kernel", StubKernel())
    monkeypatch.setattr(activation, "_swiglu_kernel", StubKernel())
    monkeypatch.setattr(route_topk, "_route_kernel", StubRoute())
    monkeypatch.setattr(sort_and_align, "_permute_kernel", HiddenPermute())
    args, kwargs = layer(1, 6, 64, 32, routing, shared, seed=5)
    first = AtenOpCounter()
    with first:
        dt.moe_forward(*args, **kwargs)
    assert first.ops["_local_scalar_dense"] == 2  # the two scales tensors' range, read once each
    launches.clear()
    x = torch.randn_like(args[0])  # a new activation, same weights: nothing to re-check on the device
    steady = AtenOpCounter()
    with steady:
        y = dt.moe_forward(x, *args[1:], **kwargs)
    assert y.shape == x.shape
    assert not steady.syncing()
    # routing, sort + alignment, gate_up, swiglu (class-major), down, and the shared expert's swiglu
    assert len(launches) == 5 + shared
    # 37 (DeepSeek routing, shared expert) with the swiglu kernel; 47 with the permutation kernel; 65 with the
    # routing kernel; 80 before
    assert sum(steady.ops.values()) <= 40
