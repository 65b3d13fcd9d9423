"""route_topk (one Triton launch) against routing.route (torch), in the interpreter: DeepSeek group-limited and
softmax routing, odd and non-power-of-two E, fp32/bf16/fp16 logits, strided rows, the torch fallbacks, ties and
NaN, configs, and argument checks. Outputs come from poisoned allocations (NaN weights, -2 ids)."""
import importlib

import pytest
import torch

import dsa_triton as dt
from dsa_triton.moe.route_topk import MAX_BLOCK, route_shape, route_topk
from dsa_triton.moe.route_topk_spec import SPEC, compare_routes
from dsa_triton.moe.routing import RoutingConfig, route
from tests.poison import poisoned_allocations


def router_logits(tokens, experts, dtype, seed, row_stride=None):
    """Fresh logits ``[T, E]``. fp32: Gaussian. fp16/bf16: a random permutation of distinct values k/16 per row
    (exact in both), so the chosen experts have no tie for torch.topk to order its own way."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        logits = torch.randn(tokens, experts, generator=g) * 2
    else:
        logits = ((torch.rand(tokens, experts, generator=g).argsort(1) - experts // 2) / 16).to(dtype)
    if row_stride is None:
        return logits
    wide = torch.randn(tokens, row_stride, generator=g).to(dtype)
    wide[:, :experts] = logits
    return wide[:, :experts]


def assert_routes_like_torch(logits, routing, bias=None, config=None):
    with poisoned_allocations():
        out = route_topk(logits, routing, bias, config=config)
    ref = route(logits, routing, bias)
    assert compare_routes(out, ref) is None, compare_routes(out, ref)
    return out


@pytest.mark.parametrize("tokens, experts, top_k, n_group, topk_group, norm, with_bias, dtype", [
    (5, 256, 8, 8, 4, True, True, torch.float32),    # DeepSeek-V3.2
    (5, 256, 8, 8, 4, True, False, torch.float32),   # no correction bias
    (5, 256, 16, 4, 2, True, True, torch.float32),   # top_k 16 (the kernel's largest), 4 groups / 2 kept
    (1, 256, 4, 1, 1, False, True, torch.float32),   # no groups, unnormalized
    (5, 160, 4, 8, 4, True, True, torch.float32),    # E not a power of two, groups of 20
    (5, 160, 8, 4, 2, False, True, torch.float32),   # groups of 40, unnormalized
    (5, 160, 8, 8, 8, True, True, torch.float32),    # every group kept: no group step
    (5, 7, 1, 1, 1, True, True, torch.float32),      # odd E, top-1
    (3, 12, 2, 6, 1, True, True, torch.float32),     # groups of 2 (top-2 sum = the whole group), one kept
    (4, 10, 3, 10, 4, True, True, torch.float32),    # groups of 1 (the group score is the expert's)
    (0, 256, 8, 8, 4, True, True, torch.float32),    # no tokens
    (5, 256, 8, 8, 4, True, True, torch.bfloat16),
    (5, 160, 4, 4, 2, True, False, torch.float16),
])
def test_deepseek_matches_torch(tokens, experts, top_k, n_group, topk_group, norm, with_bias, dtype):
    routing = RoutingConfig("deepseek", top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                            routed_scaling_factor=2.5)
    logits = router_logits(tokens, experts, dtype, seed=tokens * 1000 + experts + top_k)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(experts)) * 0.1
    bias = bias.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32) if with_bias else None
    weights, ids = assert_routes_like_torch(logits, routing, bias)
    assert weights.shape == ids.shape == (tokens, top_k)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k, dtype", [
    (5, 128, 4, torch.float32),   # gpt-oss
    (1, 7, 1, torch.float32),     # odd E, top-1
    (5, 40, 16, torch.float32),   # top_k 16
    (0, 128, 4, torch.float32),
    (5, 128, 4, torch.bfloat16),
    (5, 24, 3, torch.float16),
])
def test_softmax_matches_torch(tokens, experts, top_k, dtype, renormalize):
    routing = RoutingConfig("softmax", top_k=top_k, norm_topk_prob=renormalize)
    assert_routes_like_torch(router_logits(tokens, experts, dtype, seed=experts + top_k), routing)


def test_strided_rows_and_every_config():
    """Rows of a wider buffer (row stride 300), each config of the space (partial last program at T = 5)."""
    routing = RoutingConfig("deepseek", top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    logits = router_logits(5, 256, torch.float32, seed=3, row_stride=300)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(4)) * 0.1
    shape = route_shape(5, 256, routing)
    configs = list(SPEC.configs(shape))
    assert len(configs) == 12
    for config in configs:
        assert_routes_like_torch(logits, routing, bias, config=config)


@pytest.mark.parametrize("routing, experts", [
    (RoutingConfig("deepseek", top_k=20, n_group=4, topk_group=2, routed_scaling_factor=2.5), 64),  # top_k > 16
    (RoutingConfig("softmax", top_k=17), 40),
    (RoutingConfig("softmax", top_k=2), MAX_BLOCK + 1),  # more experts than the kernel holds
])
def test_outside_the_kernel_falls_back_to_torch(monkeypatch, routing, experts):
    monkeypatch.setattr(importlib.import_module("dsa_triton.moe.route_topk"), "_route_kernel", None)  # no launch
    logits = router_logits(3, experts, torch.float32, seed=experts)
    bias = torch.randn(experts) * 0.1 if routing.mode == "deepseek" else None
    assert_routes_like_torch(logits, routing, bias)


@pytest.mark.parametrize("mode", ["deepseek", "softmax"])
def test_exact_ties_take_the_lowest_expert(mode):
    routing = RoutingConfig(mode, top_k=3, n_group=2 if mode == "deepseek" else 1, topk_group=1)
    logits = torch.tensor([[0.5] * 8, [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]])
    weights, ids = route_topk(logits, routing)
    # row 1, DeepSeek: the two groups tie (top-2 sums 2 sigmoid(1)): group 0 kept
    assert ids.tolist() == [[0, 1, 2], [1, 2, 0] if mode == "deepseek" else [1, 2, 4]]
    torch.testing.assert_close(weights[0], weights[0, :1].expand(3))


def test_a_tie_on_a_group_maximum_counts_both_experts_in_the_group_key():
    """sigmoid rounds large logits to exactly 1.0: group 0 holds two maxima (key 2.0) and beats group 1 (1 + s(5));
    a top-2 that dropped every lane equal to the maximum would score group 0 at 1.0 and keep group 1."""
    logits = torch.tensor([[30.0, 30.0, -5.0, -5.0, 30.0, 5.0, 5.0, 5.0]])
    routing = RoutingConfig("deepseek", top_k=2, n_group=2, topk_group=1)
    _, ids = route_topk(logits, routing)
    assert sorted(ids[0].tolist()) == sorted(route(logits, routing)[1][0].tolist()) == [0, 1]


def test_constraint_caps_the_experts_a_thread_holds():
    shape = {"T": 4, "E": 4096, "top_k": 8, "n_group": 1, "topk_group": 1, "softmax": 1}
    assert not SPEC.is_valid({"num_warps": 1, "TOKENS": 4}, shape)
    assert SPEC.is_valid({"num_warps": 4, "TOKENS": 1}, dict(shape, E=256))


@pytest.mark.parametrize("routing", [RoutingConfig("deepseek", top_k=2, n_group=2, topk_group=1),
                                     RoutingConfig("softmax", top_k=2)])
def test_non_finite_logits_or_bias_are_rejected_with_value_checks(routing):
    logits = router_logits(2, 8, torch.float32, seed=8)
    bias = torch.zeros(8) if routing.mode == "deepseek" else None
    logits[0, 5] = float("nan")
    with pytest.raises(ValueError, match="^logits: .*NaN"):
        route_topk(logits, routing, bias)
    logits[0, 5] = float("inf")
    with pytest.raises(ValueError, match="^logits: .*inf"):
        route_topk(logits, routing, bias)
    if bias is not None:
        logits[0, 5] = 0.0
        bias[2] = float("nan")
        with pytest.raises(ValueError, match="^bias: .*NaN"):
            route_topk(logits, routing, bias)


@pytest.mark.parametrize("routing, with_bias", [
    (RoutingConfig("deepseek", top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5), True),
    (RoutingConfig("deepseek", top_k=2), False),
    (RoutingConfig("softmax", top_k=3), False),
    (RoutingConfig("deepseek", top_k=8), True),  # every expert chosen: the NaN keys last, their weights NaN
    (RoutingConfig("softmax", top_k=3, norm_topk_prob=False), False),  # a full softmax over a NaN: NaN weights
])
def test_with_value_checks_off_a_nan_never_ranks_first(routing, with_bias):
    """NaN keys rank as -inf (never before a finite one) and the weights that depend on a NaN are NaN, as in the
    torch routing: NaN logits at token 0 expert 5 and token 2 experts 0 and 1, a NaN bias at expert 3."""
    logits = router_logits(3, 8, torch.float32, seed=9)
    logits[:, 3] = 4.0
    logits[0, 5] = logits[2, 0] = logits[2, 1] = float("nan")
    bias = torch.randn(8, generator=torch.Generator().manual_seed(10)) * 0.1 if with_bias else None
    if with_bias:
        bias[3] = float("nan")
    with poisoned_allocations():
        weights, ids = route_topk(logits, routing, bias, check_values=False)
    ref_w, ref_ids = route(logits, routing, bias, check_values=False)
    nan_keys = [{5}, set(), {0, 1}] if not with_bias else [{3, 5}, {3}, {0, 1, 3}]
    for t in range(3):
        chosen = ids[t].tolist()
        finite = [e for e in chosen if e not in nan_keys[t]]
        assert chosen[:len(finite)] == finite  # NaN keys only after every finite one
        assert chosen[:len(finite)] == ref_ids[t, :len(finite)].tolist()
        assert sorted(chosen[len(finite):]) == sorted(ref_ids[t, len(finite):].tolist())  # ties at -inf
    assert torch.equal(weights.isnan(), ref_w.isnan())
    torch.testing.assert_close(weights.nan_to_num(), ref_w.nan_to_num(), rtol=1e-6, atol=1e-7)


def test_bad_arguments_name_the_argument():
    deepseek = RoutingConfig("deepseek", top_k=2, n_group=2, topk_group=1)
    logits = torch.randn(3, 8)
    cases = [
        (logits.int(), deepseek, None, "logits"),
        (logits[0], deepseek, None, "logits"),
        (torch.randn(8, 3).t(), deepseek, None, "logits"),  # last dimension not contiguous
        (logits, deepseek, torch.randn(7), "bias"),
        (logits, deepseek, torch.randn(8).int(), "bias"),
        (logits, RoutingConfig("softmax", top_k=2), torch.randn(8), "bias"),
        (logits, RoutingConfig("softmax", top_k=9), None, "top_k"),
        (logits, RoutingConfig("deepseek", top_k=2, n_group=3), None, "n_group"),
        (logits, RoutingConfig("deepseek", top_k=5, n_group=4, topk_group=2), None, "top_k"),
        (logits, "deepseek", None, "routing"),
        (logits.tolist(), RoutingConfig("softmax", top_k=1), None, "logits"),  # checked before its shape is read
    ]
    for args in cases:
        for op in (route_topk, route):
            with pytest.raises(ValueError, match=args[-1]):
                op(*args[:-1])
    with pytest.raises(dt.ConfigError):
        route_topk(logits, deepseek, config={"num_warps": 3, "TOKENS": 1})


def test_registry_entry_runs_and_its_compare_can_fail():
    for shape in SPEC.bench_shapes("decode", False):
        inputs = SPEC.make_inputs("decode", shape, "cpu", 11)
        with poisoned_allocations():
            weights, ids = SPEC.run(inputs, SPEC.launch_config("decode", shape, "cpu"))
        ref = SPEC.reference(inputs)
        assert SPEC.compare((weights, ids), ref) is None
        assert "ids differ" in SPEC.compare((weights, ids.flip(1)), ref)
        assert "relative error" in SPEC.compare((weights * (1 + 1e-5), ids), ref)
        assert SPEC.cost("decode", shape).bytes > 0
