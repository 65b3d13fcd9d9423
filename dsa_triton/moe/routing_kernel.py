"""Router top-k in one Triton launch: :func:`route_topk`, the semantics of :func:`.routing.route` (the order
among exact ties aside: lowest expert first here, unspecified in ``torch.topk``).

The torch form (:mod:`.routing`, the reference) is ~14 kernel-launching ops per call (sigmoid, bias add, group
top-2 sums, group top-k, mask, top-k, gather, normalize, scale); on a host where a launch costs ~20 us that is
most of the routing time at decode. Here one program routes ``TOKENS`` tokens; a token's logits sit in
registers as a ``[groups, group block]`` tile (power-of-two blocks, masked, so E need not be a power of two).
DeepSeek mode: sigmoid, bias for the selection key, each group's top-2 sum, the ``topk_group`` best groups by
repeated argmax, then ``top_k`` repeated argmaxes over the kept experts (lowest expert on exact ties, NaN keys
first as in ``torch.topk``), the weights normalized and scaled in registers. Softmax mode: the same top-k on the
logits, then the softmax of the chosen logits (``norm_topk_prob``) or their full-softmax probabilities.

Outside the kernel's range (``top_k`` > :data:`MAX_TOP_K`, or a padded row over :data:`MAX_BLOCK` experts) the
op falls back to the torch functions of :mod:`.routing`. No host sync and no data-dependent shape: capturable.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .. import registry
from ..checks import PlanCache, check_kernel_device
from ..hostmath import cdiv, next_pow2
from ..registry import Cost, KernelSpec
from .routing import RoutingConfig, check_route, route

MAX_TOP_K = 16  # top_k up to this runs in the kernel (one argmax pass per expert chosen); above: torch
MAX_BLOCK = 4096  # padded experts per token (groups x group block) the kernel holds in registers; above: torch
_NO_EXPERT = tl.constexpr(1 << 30)  # argmax fill: above every expert id


@triton.jit
def _argmax_first(key, ok, index, NONE: tl.constexpr):
    """Per token (axis 0) of ``key [TOKENS, A, B]`` where ``ok``: the lowest ``index`` holding the largest key
    (``NONE`` where nothing is ``ok``)."""
    key = tl.where(ok, key, float("-inf"))
    best = tl.max(tl.max(key, 2), 1)
    return tl.min(tl.min(tl.where(ok & (key == best[:, None, None]), index, NONE), 2), 1)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, stride_t, n_group, group_size, topk_group, top_k,
                  scale, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
                  GROUPS: tl.constexpr, GROUP_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, TOKENS: tl.constexpr):
    """Tokens ``pid * TOKENS ..``: ``weights[t, :top_k]`` fp32 and ``ids[t, :top_k]`` int32 (contiguous)."""
    tok = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, GROUP_BLOCK)
    expert = (g[:, None] * group_size + j[None, :])[None, :, :]  # [1, GROUPS, GROUP_BLOCK]
    real = ((g[:, None] < n_group) & (j[None, :] < group_size))[None, :, :]
    valid = (tok < T)[:, None, None] & real
    x = tl.load(logits_ptr + tok[:, None, None] * stride_t + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        key = x
    else:
        x = tl.sigmoid(x)  # the weights are the uncorrected scores
        key = x
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + expert, mask=real, other=0.0).to(tl.float32)
    key = tl.where(key != key, float("inf"), key)  # NaN ranks first, as in torch.topk
    avail = valid
    if GROUPED:  # keep the topk_group groups with the best top-2 key sums
        in_group = tl.where(valid, key, float("-inf"))
        top1 = tl.max(in_group, 2)
        first = tl.min(tl.where(in_group == top1[:, :, None], j[None, None, :], GROUP_BLOCK), 2)
        top2 = tl.max(tl.where(j[None, None, :] == first[:, :, None], float("-inf"), in_group), 2)
        group_key = tl.where(group_size > 1, top1 + top2, top1)
        group_key = tl.where(group_key != group_key, float("inf"), group_key)[:, :, None]  # [TOKENS, GROUPS, 1]
        group = g[None, :, None]
        open_group = (tok < T)[:, None, None] & (group < n_group)
        kept = tl.zeros([TOKENS, GROUPS, 1], tl.int1)
        for _ in range(topk_group):
            pick = _argmax_first(group_key, open_group, group, GROUPS)
            chosen = group == pick[:, None, None]
            kept = kept | chosen
            open_group = open_group & ~chosen
        avail = avail & kept
    slot = tl.arange(0, K_BLOCK)[None, :]
    values = tl.zeros([TOKENS, K_BLOCK], tl.float32)
    ids = tl.zeros([TOKENS, K_BLOCK], tl.int32)
    for i in range(top_k):
        pick = _argmax_first(key, avail, expert, _NO_EXPERT)
        hit = expert == pick[:, None, None]
        value = tl.sum(tl.sum(tl.where(hit, x, 0.0), 2), 1)
        avail = avail & ~hit
        values = tl.where(slot == i, value[:, None], values)
        ids = tl.where(slot == i, pick[:, None], ids)
    used = slot < top_k
    if SOFTMAX:
        if NORM:  # softmax over the chosen logits
            peak = tl.max(tl.where(used, values, float("-inf")), 1)
            p = tl.where(used, tl.exp(values - peak[:, None]), 0.0)
            weights = p / tl.sum(p, 1)[:, None]
        else:  # full-softmax probabilities of the chosen
            peak = tl.max(tl.max(x, 2), 1)
            total = tl.sum(tl.sum(tl.exp(x - peak[:, None, None]), 2), 1)  # padding lanes hold -inf: exp 0
            weights = tl.exp(values - peak[:, None]) / total[:, None]
    else:
        weights = values
        if NORM:
            weights = weights / tl.sum(weights, 1)[:, None]  # (zero past top_k)
        weights = weights * scale
    out = tok[:, None] * top_k + slot
    keep = (tok < T)[:, None] & used
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def ranked_groups(n_group: int, topk_group: int) -> int:
    """The groups the kernel ranks: ``n_group`` when some are dropped, else one group of every expert."""
    return n_group if topk_group < n_group else 1


def tile_of(num_experts: int, n_group: int, topk_group: int) -> tuple[int, int]:
    """The ``(GROUPS, GROUP_BLOCK)`` register tile of one token (:func:`ranked_groups` of them)."""
    groups = ranked_groups(n_group, topk_group)
    return next_pow2(groups), next_pow2(num_experts // groups)


class RouteLaunch:
    """One :func:`_route_kernel` launch for fixed metadata (checked once), or the torch fallback."""

    def __init__(self, logits: torch.Tensor, routing: RoutingConfig, has_bias: bool, config: dict | None) -> None:
        tokens, experts = logits.shape
        shape = route_shape(tokens, experts, routing)
        n_group, topk_group = shape["n_group"], shape["topk_group"]
        groups, group_block = tile_of(experts, n_group, topk_group)
        self.shape = (tokens, routing.top_k)
        self.fallback = routing.top_k > MAX_TOP_K or groups * group_block > MAX_BLOCK
        if self.fallback:
            return
        config = SPEC.launch_config("decode", shape, logits.device) if config is None else SPEC.validate(config, shape)
        n_group = ranked_groups(n_group, topk_group)
        self.grid = (cdiv(tokens, config["TOKENS"]),)
        self.args = (tokens, logits.stride(0), n_group, experts // n_group, topk_group, routing.top_k)
        self.meta = dict(SOFTMAX=bool(shape["softmax"]), HAS_BIAS=has_bias, GROUPED=n_group > 1, NORM=routing.norm_topk_prob,
                         GROUPS=groups, GROUP_BLOCK=group_block, K_BLOCK=next_pow2(routing.top_k),
                         TOKENS=config["TOKENS"], num_warps=config["num_warps"])

    def __call__(self, logits, bias, routing):
        if self.fallback:
            return route(logits, routing, bias)
        weights = torch.empty(self.shape, dtype=torch.float32, device=logits.device)
        ids = torch.empty(self.shape, dtype=torch.int32, device=logits.device)
        if self.shape[0]:
            _route_kernel[self.grid](logits, logits if bias is None else bias, weights, ids, *self.args,
                                     float(routing.routed_scaling_factor), **self.meta)
        return weights, ids


_PLANS = PlanCache()


def route_shape(tokens: int, experts: int, routing: RoutingConfig) -> dict[str, int]:
    """The registry shape of a routing call (softmax: ``n_group = topk_group = 1``)."""
    softmax = routing.mode == "softmax"
    return {"T": tokens, "E": experts, "top_k": routing.top_k, "n_group": 1 if softmax else routing.n_group,
            "topk_group": 1 if softmax else routing.topk_group, "softmax": int(softmax)}


def route_topk(logits: torch.Tensor, routing: RoutingConfig, bias: torch.Tensor | None = None, *,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.routing.route` in one launch: ``logits [T, E]`` -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)``.

    - ``logits``: fp32/fp16/bf16 ``[T, E]``, any row stride, last dim contiguous;
    - ``routing``: :class:`.routing.RoutingConfig` (mode, top_k, groups, normalization, scaling factor);
    - ``bias``: fp32/fp16/bf16 ``[E]``, DeepSeek's e_score_correction_bias (selection only), None in softmax mode;
    - ``config``: ``{"num_warps", "TOKENS"}`` (default: the tuning database / the registry default).

    Experts of a token in descending order of their selection score, the lowest expert first among exact ties.
    ``top_k`` > :data:`MAX_TOP_K` or more than :data:`MAX_BLOCK` padded experts per token: the torch functions.
    """
    if type(routing) is not RoutingConfig:
        raise ValueError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")
    key, launch = _PLANS.find((logits, bias), routing.plan_ints(), config)
    if launch is None:
        launch = _PLANS.put(key, _plan(logits, routing, bias, config))
    return launch(logits, bias, routing)


def _plan(logits, routing, bias, config) -> RouteLaunch:
    """The checks of :func:`.routing.route` plus the device, then the launch."""
    check_route(logits, routing, bias)
    check_kernel_device("logits", logits)
    return RouteLaunch(logits, routing, bias is not None, config)


# -- registry entry -------------------------------------------------------------------------------

def _routing_of(shape) -> RoutingConfig:
    """DeepSeek-V3.2-style (scaling 2.5) or gpt-oss-style (softmax over the chosen) routing of a bench shape."""
    if shape["softmax"]:
        return RoutingConfig("softmax", top_k=shape["top_k"])
    return RoutingConfig("deepseek", top_k=shape["top_k"], n_group=shape["n_group"], topk_group=shape["topk_group"],
                         routed_scaling_factor=2.5)


def _make_inputs(phase, shape, device, seed) -> dict:
    """fp32 router logits (the layer's dtype) and, in DeepSeek mode, a correction bias."""
    gen = torch.Generator(device).manual_seed(seed)
    routing = _routing_of(shape)
    logits = torch.randn(shape["T"], shape["E"], generator=gen, device=device) * 2
    bias = None if shape["softmax"] else torch.randn(shape["E"], generator=gen, device=device) * 0.1
    return {"logits": logits, "routing": routing, "bias": bias}


def compare_routes(out, ref, rtol: float = 1e-6) -> str | None:
    """None when the ids are equal and every weight is within ``rtol`` of the reference's (relative)."""
    (weights, ids), (ref_weights, ref_ids) = out, ref
    if ids.shape != ref_ids.shape or weights.shape != ref_weights.shape:
        return f"shapes {tuple(weights.shape)} / {tuple(ids.shape)} != reference {tuple(ref_ids.shape)}"
    if weights.dtype != torch.float32 or ids.dtype != torch.int32:
        return f"dtypes {weights.dtype} / {ids.dtype}, expected float32 / int32"
    if not torch.equal(ids, ref_ids):
        return f"{int((ids != ref_ids).sum())} of {ids.numel()} ids differ"
    error = ((weights - ref_weights).abs() / ref_weights.abs().clamp_min(1e-30)).nan_to_num(float("inf"))
    worst = error.max().item() if error.numel() else 0.0
    return None if worst <= rtol else f"weights: relative error {worst:.3g} over {rtol}"


def _default(phase, shape) -> dict:
    """One token per program, about 8 padded experts per thread (one warp for DeepSeek's 256)."""
    groups, group_block = tile_of(shape["E"], shape["n_group"], shape["topk_group"])
    return {"num_warps": min(8, max(1, groups * group_block // 256)), "TOKENS": 1}


def _constraint(config, shape) -> str | None:
    groups, group_block = tile_of(shape["E"], shape["n_group"], shape["topk_group"])
    per_thread = config["TOKENS"] * groups * group_block // (32 * config["num_warps"])
    return f"{per_thread} experts per thread (at most 64 in registers)" if per_thread > 64 else None


def _cost(phase, shape) -> Cost:
    """Logits (fp32) and bias read once, weights and ids written once."""
    t, e, k = shape["T"], shape["E"], shape["top_k"]
    return Cost(bytes=t * e * 4 + (0 if shape["softmax"] else e * 4) + t * k * 8)


def _bench_shapes(phase, gpu) -> list[dict]:
    deepseek = {"E": 256, "top_k": 8, "n_group": 8, "topk_group": 4, "softmax": 0}  # DeepSeek-V3.2
    gpt_oss = {"E": 128, "top_k": 4, "n_group": 1, "topk_group": 1, "softmax": 1}
    if gpu:
        return [{"T": t, **dims} for dims in (deepseek, gpt_oss) for t in (1, 64, 256)]
    return [{"T": 3, "E": 12, "top_k": 3, "n_group": 4, "topk_group": 2, "softmax": 0},
            {"T": 5, "E": 10, "top_k": 4, "n_group": 1, "topk_group": 1, "softmax": 1}]


def _torch_route(inputs):
    return route(inputs["logits"], inputs["routing"], inputs["bias"])


SPEC = registry.register(KernelSpec(
    name="moe_route",
    phases=("decode",),  # one launch at any T: prefill calls share the bucketed decode keys
    space={"num_warps": (1, 2, 4, 8), "TOKENS": (1, 2, 4)},
    default=_default,
    constraint=_constraint,
    fixed_dims=("E", "top_k", "n_group", "topk_group", "softmax"),
    bucketed_dims=("T",),
    make_inputs=_make_inputs,
    run=lambda inputs, config: route_topk(inputs["logits"], inputs["routing"], inputs["bias"], config=config),
    reference=_torch_route,
    compare=compare_routes,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_torch_route,
    baseline_name="routing.route (torch, ~14 ops)",
    source_modules=(sys.modules[__name__],),
))
