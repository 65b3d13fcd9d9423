"""Router top-k in one Triton launch: :func:`route_topk`, the semantics of :func:`.routing.route` (exact ties
included: the lowest expert first).

The torch form (:mod:`.routing`, the reference) is ~14 kernel-launching ops per call (sigmoid, bias add, group
top-2 sums, group top-k, mask, top-k, gather, normalize, scale); at decode the host time of those launches is most
of the routing time. Here one program routes ``TOKENS`` tokens (:mod:`.route_topk_kernels`); launch parameters
(:data:`LAUNCH`): ``TOKENS`` and ``num_warps``.

Outside the kernel's range (``top_k`` > :data:`MAX_TOP_K`, or a padded row over :data:`MAX_BLOCK` experts) the
op falls back to the torch functions of :mod:`.routing`. With ``check_values=False`` no host sync and no
data-dependent shape: capturable.

Non-finite input, as :mod:`.routing`: ``check_values=True`` rejects a NaN or infinite logit or bias (``ValueError``
naming it, one host read); ``check_values=False`` propagates: a NaN key ranks as -inf (never before a finite one),
a weight computed from a NaN is NaN. Never a finite wrong weight, never a NaN that ranks first.
"""
from __future__ import annotations

import torch

from ..checks import check_kernel_device
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..hostmath import cdiv, next_pow2
from ..launch import launch_with
from ..registry import LaunchSpace
from .route_topk_kernels import _route_kernel, ranked_groups, tile_of
from .routing import RoutingConfig, check_route, check_route_values, route

MAX_TOP_K = 16  # top_k up to this runs in the kernel (one argmax pass per expert chosen); above: torch
MAX_BLOCK = 4096  # padded experts per token (groups x group block) the kernel holds in registers; above: torch


def _default(phase, shape) -> dict:
    """One token per program, about 8 padded experts per thread (one warp for DeepSeek's 256)."""
    groups, group_block = tile_of(shape["E"], shape["n_group"], shape["topk_group"])
    return {"num_warps": min(8, max(1, groups * group_block // 256)), "TOKENS": 1}


def _constraint(config, shape) -> str | None:
    groups, group_block = tile_of(shape["E"], shape["n_group"], shape["topk_group"])
    per_thread = config["TOKENS"] * groups * group_block // (32 * config["num_warps"])
    return f"{per_thread} experts per thread (at most 64 in registers)" if per_thread > 64 else None


LAUNCH = LaunchSpace(
    name="route_topk",
    phases=("decode",),  # one launch at any T: prefill calls share the bucketed decode keys
    space={"num_warps": (1, 2, 4, 8), "TOKENS": (1, 2, 4)},
    default=_default,
    fixed_dims=("E", "top_k", "n_group", "topk_group", "softmax"),
    bucketed_dims=("T",),
    constraint=_constraint,
)


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
        config = LAUNCH.launch_config("decode", shape, logits.device) if config is None else LAUNCH.validate(config, shape)
        n_group = ranked_groups(n_group, topk_group)
        self.grid = (cdiv(tokens, config["TOKENS"]),)
        self.args = (tokens, logits.stride(0), n_group, experts // n_group, topk_group, routing.top_k)
        self.meta = dict(SOFTMAX=bool(shape["softmax"]), HAS_BIAS=has_bias, GROUPED=n_group > 1, NORM=routing.norm_topk_prob,
                         GROUPS=groups, GROUP_BLOCK=group_block, K_BLOCK=next_pow2(routing.top_k),
                         TOKENS=config["TOKENS"], num_warps=config["num_warps"])

    def __call__(self, logits, bias, routing):
        if self.fallback:
            return route(logits, routing, bias, check_values=False)  # (checked by route_topk)
        weights = torch.empty(self.shape, dtype=torch.float32, device=logits.device)
        ids = torch.empty(self.shape, dtype=torch.int32, device=logits.device)
        if self.shape[0]:
            launch_with(_route_kernel, self.grid, self.meta, logits, logits if bias is None else bias, weights, ids,
                        *self.args, float(routing.routed_scaling_factor))
        return weights, ids


_PLANS = PlanCache()


def route_shape(tokens: int, experts: int, routing: RoutingConfig) -> dict[str, int]:
    """The registry shape of a routing call (softmax: ``n_group = topk_group = 1``)."""
    softmax = routing.mode == "softmax"
    return {"T": tokens, "E": experts, "top_k": routing.top_k, "n_group": 1 if softmax else routing.n_group,
            "topk_group": 1 if softmax else routing.topk_group, "softmax": int(softmax)}


def route_topk(logits: torch.Tensor, routing: RoutingConfig, bias: torch.Tensor | None = None, *,
               check_values: bool = True, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.routing.route` in one launch: ``logits [T, E]`` -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)``.

    - ``logits``: fp32/fp16/bf16 ``[T, E]``, any row stride, last dim contiguous;
    - ``routing``: :class:`.routing.RoutingConfig` (mode, top_k, groups, normalization, scaling factor);
    - ``bias``: fp32/fp16/bf16 ``[E]``, DeepSeek's e_score_correction_bias (selection only), None in softmax mode;
    - ``check_values``: reject non-finite logits or bias (one host read; skipped inside a CUDA-graph capture), or
      propagate them (the module docstring);
    - ``config``: ``{"num_warps", "TOKENS"}`` (default: the tuning database / the registry default).

    Experts of a token in descending order of their selection score, the lowest expert first among exact ties.
    ``top_k`` > :data:`MAX_TOP_K` or more than :data:`MAX_BLOCK` padded experts per token: the torch functions.
    """
    if type(routing) is not RoutingConfig:
        raise ValueError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")
    key, launch = _PLANS.find((logits, bias), routing.plan_ints(), config)
    if launch is None:
        launch = _PLANS.put(key, _plan(logits, routing, bias, config))
    if check_values:
        check_route_values(logits, bias)
    return launch(logits, bias, routing)


def _plan(logits, routing, bias, config) -> RouteLaunch:
    """The checks of :func:`.routing.route` plus the device, then the launch."""
    check_route(logits, routing, bias)
    check_kernel_device("logits", logits)
    return RouteLaunch(logits, routing, bias is not None, config)


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("route_topk")
def route_topk_op(logits: torch.Tensor, bias: torch.Tensor | None = None, mode: str = "deepseek", top_k: int = 8,
                  n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                  routed_scaling_factor: float = 1.0, check_values: bool = True,
                  config: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dt.route_topk`: ``(weights [T, top_k] fp32, ids [T, top_k] int32)``; the routing fields as in
    :class:`~dsa_triton.RoutingConfig` (:func:`~dsa_triton.library.routing_kwargs`)."""
    routing = RoutingConfig(mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    return route_topk(logits, routing, bias, config=op_config(config))


@route_topk_op.register_fake
def _(logits, bias=None, mode="deepseek", top_k=8, *args, **kwargs):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)
