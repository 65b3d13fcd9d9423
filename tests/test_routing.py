"""Routing: DeepSeek group-limited sigmoid top-k and softmax top-k against the loop-per-token oracle."""
import pytest
import torch

import dsa_triton as dt
from dsa_triton.moe.routing import RoutingConfig, deepseek_topk, route, softmax_topk
from dsa_triton.moe.routing_reference import deepseek_topk_torch, route_torch, softmax_topk_torch


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("tokens, experts, top_k, n_group, topk_group, norm, scale, with_bias", [
    (1, 7, 2, 1, 1, True, 1.0, True),      # odd E, no groups
    (5, 12, 3, 4, 2, True, 2.5, True),     # groups of 3, two kept
    (4, 16, 4, 8, 4, False, 2.5, True),    # groups of 2 (top-2 sum = the whole group), unnormalized
    (3, 10, 2, 5, 1, True, 2.5, False),    # one group kept, no bias
    (6, 32, 8, 8, 4, True, 2.5, True),     # DeepSeek-V3 ratios
])
def test_deepseek_matches_oracle(tokens, experts, top_k, n_group, topk_group, norm, scale, with_bias):
    g = gen(tokens * 100 + experts)
    logits = torch.randn(tokens, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.5 if with_bias else None
    weights, ids = deepseek_topk(logits, bias, top_k, n_group, topk_group, norm, scale)
    ref_w, ref_ids = deepseek_topk_torch(logits, bias, top_k, n_group, topk_group, norm, scale)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-6)
    if norm:
        torch.testing.assert_close(weights.sum(1), torch.full((tokens,), scale), rtol=1e-6, atol=1e-6)
    group_of = ids // (experts // n_group)
    assert all(len(set(row)) <= topk_group for row in group_of.tolist())


def test_deepseek_bias_selects_but_does_not_weigh():
    logits = torch.zeros(1, 4)
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    weights, ids = deepseek_topk(logits, bias, 1, routed_scaling_factor=1.0, norm_topk_prob=False)
    assert ids.tolist() == [[3]]
    assert weights.tolist() == [[0.5]]  # sigmoid(0), not sigmoid(0) + 1


def test_deepseek_group_limit_excludes_a_strong_expert_in_a_weak_group():
    # group 0 = experts 0,1 (one strong, one very weak), group 1 = experts 2,3 (both good): top-2 sums rank
    # group 1 first, so with one group kept expert 0 is excluded although it has the best score.
    logits = torch.tensor([[4.0, -8.0, 2.0, 2.0]])
    _, ids = deepseek_topk(logits, None, 1, n_group=2, topk_group=1)
    assert ids.tolist() == [[2]] or ids.tolist() == [[3]]
    _, ids = deepseek_topk(logits, None, 1, n_group=2, topk_group=2)
    assert ids.tolist() == [[0]]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 5, 2), (7, 9, 4), (3, 32, 4)])
def test_softmax_matches_oracle(tokens, experts, top_k, renormalize):
    logits = torch.randn(tokens, experts, generator=gen(experts + top_k)) * 3
    weights, ids = softmax_topk(logits, top_k, renormalize)
    ref_w, ref_ids = softmax_topk_torch(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(tokens))


@pytest.mark.parametrize("routing", [RoutingConfig("deepseek", top_k=3, n_group=3, topk_group=2, routed_scaling_factor=2.5),
                                     RoutingConfig("softmax", top_k=2)])
def test_route_dispatches_like_the_oracle(routing):
    g = gen(3)
    logits = torch.randn(4, 9, generator=g)
    bias = torch.randn(9, generator=g) if routing.mode == "deepseek" else None
    weights, ids = dt.route(logits, routing, bias)
    ref_w, ref_ids = route_torch(logits, routing, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)


@pytest.mark.parametrize("routing", [RoutingConfig("deepseek", top_k=4, n_group=4, topk_group=2),
                                     RoutingConfig("deepseek", top_k=5), RoutingConfig("softmax", top_k=5)])
def test_exact_ties_take_the_lowest_expert_as_the_kernel_and_the_oracle(routing):
    """Logits on a coarse grid (many exact ties, at the k-th key too): the torch functions (route, and route_topk's
    fallback) choose the lowest experts among equal keys, as the kernel and the oracle do (torch.topk did not)."""
    g = gen(17)
    logits = torch.randint(-2, 3, (64, 24), generator=g).float()
    bias = torch.zeros(24) if routing.mode == "deepseek" else None
    weights, ids = dt.route(logits, routing, bias)
    ref_w, ref_ids = route_torch(logits, routing, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    assert torch.equal(dt.route_topk(logits, routing, bias)[1], ref_ids)


def test_half_precision_logits_are_routed_in_fp32():
    logits = torch.randn(3, 8, generator=gen(5)).to(torch.bfloat16)
    weights, ids = deepseek_topk(logits, None, 2, 4, 2)
    ref_w, ref_ids = deepseek_topk_torch(logits.float(), None, 2, 4, 2)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)


@pytest.mark.parametrize("call, match", [
    (lambda l: deepseek_topk(l[0], None, 2), "logits"),
    (lambda l: deepseek_topk(l.int(), None, 2), "logits"),
    (lambda l: deepseek_topk(l, None, 9), "top_k"),
    (lambda l: deepseek_topk(l, None, 0), "top_k"),
    (lambda l: deepseek_topk(l, None, 2, n_group=3), "n_group"),
    (lambda l: deepseek_topk(l, None, 2, n_group=4, topk_group=5), "topk_group"),
    (lambda l: deepseek_topk(l, None, 5, n_group=4, topk_group=2), "top_k"),
    (lambda l: deepseek_topk(l, torch.zeros(7), 2), "bias"),
    (lambda l: softmax_topk(l, 9), "top_k"),
    (lambda l: route(l, RoutingConfig("softmax", top_k=2), torch.zeros(8)), "bias"),
    (lambda l: RoutingConfig("sigmoid"), "mode"),
    (lambda l: RoutingConfig(top_k=0), "top_k"),
])
def test_bad_inputs_raise_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 8))


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), float("-inf"), 0.0, -2.5, True, "2.5", None])
def test_routed_scaling_factor_must_be_a_finite_positive_number(factor):
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        RoutingConfig("deepseek", routed_scaling_factor=factor)
    assert RoutingConfig("deepseek", routed_scaling_factor=2).routed_scaling_factor == 2  # an int is a number


DEEPSEEK = RoutingConfig("deepseek", top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["logits", "bias"])
def test_non_finite_router_input_is_rejected_with_value_checks(where, bad):
    logits, bias = torch.randn(3, 8, generator=gen(6)), torch.randn(8, generator=gen(7)) * 0.1
    (logits[1] if where == "logits" else bias)[5] = bad
    with pytest.raises(ValueError, match=f"^{where}: .*(NaN|inf)"):
        route(logits, DEEPSEEK, bias)
    if where == "logits":
        for call in (lambda: deepseek_topk(logits, None, 2), lambda: softmax_topk(logits, 2),
                     lambda: route(logits, RoutingConfig("softmax", top_k=2))):
            with pytest.raises(ValueError, match="^logits: "):
                call()


def nan_rows(experts=8, seed=8):
    """Router logits with a NaN at expert 5 of token 0 and at experts 0 and 1 of token 2; a bias with a NaN at expert 3
    (every token would choose it: it holds the largest logit)."""
    logits = torch.randn(3, experts, generator=gen(seed))
    logits[:, 3] = 4.0
    logits[0, 5] = logits[2, 0] = logits[2, 1] = float("nan")
    bias = torch.randn(experts, generator=gen(seed + 1)) * 0.1
    bias[3] = float("nan")
    return logits, bias


NAN_LOGITS = [{5}, set(), {0, 1}]  # the experts of each token of nan_rows() with a NaN logit


@pytest.mark.parametrize("routing, with_bias", [(DEEPSEEK, True), (DEEPSEEK, False),
                                                (RoutingConfig("deepseek", top_k=2), True),
                                                (RoutingConfig("softmax", top_k=3), False)])
def test_with_value_checks_off_a_nan_never_ranks_first(routing, with_bias):
    """NaN selection keys rank as -inf: never chosen while a finite key is available; the weights of the others
    are what they are without the NaN experts (the oracle treats NaN keys the same way)."""
    logits, bias = nan_rows()
    bias = bias if with_bias else None
    weights, ids = route(logits, routing, bias, check_values=False)
    ref_w, ref_ids = route_torch(logits, routing, bias)
    assert torch.equal(ids, ref_ids)
    for t, row in enumerate(ids.tolist()):
        assert not set(row) & (NAN_LOGITS[t] | ({3} if with_bias else set()))
    torch.testing.assert_close(weights, ref_w)
    assert torch.isfinite(weights).all()


def test_with_value_checks_off_nan_enters_the_weights_that_depend_on_it():
    """NaN in, NaN out: a softmax over every logit (not renormalized) of a row with a NaN, and a token made to choose
    an expert whose key is NaN (top_k = E: NaN keys last), get NaN weights; rows without a NaN stay finite."""
    logits, bias = nan_rows()
    weights, ids = route(logits, RoutingConfig("softmax", top_k=2, norm_topk_prob=False), check_values=False)
    assert weights.isnan().all(1).tolist() == [True, False, True] and torch.isfinite(weights[1]).all()
    assert all(not set(row) & NAN_LOGITS[t] for t, row in enumerate(ids.tolist()))
    for routing, b in ((RoutingConfig("deepseek", top_k=8), bias), (RoutingConfig("softmax", top_k=8), None)):
        weights, ids = route(logits, routing, b, check_values=False)
        assert weights.isnan().all(1).tolist() == [True, routing.mode == "deepseek", True]
        for t, row in enumerate(ids.tolist()):
            last = NAN_LOGITS[t] | ({3} if b is not None else set())
            assert sorted(row) == list(range(8)) and set(row[8 - len(last):]) == last
