"""Router top-k: which experts each token uses and with what combine weight.

Two modes, both from router logits ``[T, E]`` (computed in fp32 by the caller or :func:`route`):

- ``"deepseek"`` (DeepSeek-V3 / V3.2, ``noaux_tc``): scores = sigmoid(logits); the correction bias
  ``e_score_correction_bias[E]`` is added for *selection only*. Experts form ``n_group`` equal groups; each
  group is ranked by the sum of its top-2 corrected scores, the best ``topk_group`` groups are kept and the
  ``top_k`` best corrected scores among their experts are chosen. The weights are the *uncorrected* sigmoid
  scores of the chosen experts, divided by their sum when ``norm_topk_prob``, times ``routed_scaling_factor``.
- ``"softmax"`` (gpt-oss / Mixtral): the ``top_k`` largest logits; weights = softmax over the chosen logits
  (``renormalize``, gpt-oss) or the full softmax probabilities of the chosen experts (not renormalized).

Every function returns ``(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32)``, experts of a token
in descending order of their selection score, the lowest expert first among equal scores (as the kernel of
:mod:`.route_topk` and the oracle: a token's experts never depend on its batch). Plain PyTorch; the loop-per-token
oracle is :mod:`.routing_reference`.

Non-finite input. ``check_values=True`` (the default) rejects a NaN or infinite logit or bias with a
``ValueError`` naming it (one host read). ``check_values=False`` reads nothing on the host (capturable) and
propagates: a NaN selection key (a NaN logit, or a NaN bias in DeepSeek mode) ranks as -inf, below every finite
key, so it is chosen only when a token has fewer than ``top_k`` other experts to choose; a weight computed from a
NaN is NaN (the chosen expert's own weight, and through the normalization or the full softmax every weight of its
token that depends on it). Never a finite wrong weight, never a NaN that ranks first.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..checks import check_positive, check_tensor

MODES = ("deepseek", "softmax")


@dataclass(frozen=True)
class RoutingConfig:
    """How a MoE layer routes: ``mode`` is ``"deepseek"`` or ``"softmax"`` (see the module docstring).

    ``n_group`` / ``topk_group`` / ``routed_scaling_factor`` apply to ``"deepseek"``; ``norm_topk_prob``
    means "normalize the chosen weights to sum 1" in both modes. DeepSeek-V3.2: ``RoutingConfig("deepseek",
    top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)``; gpt-oss: ``RoutingConfig("softmax", top_k=4)``.
    """

    mode: str = "deepseek"
    top_k: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"routing.mode: must be one of {MODES}, got {self.mode!r}")
        for name in ("top_k", "n_group", "topk_group"):
            check_positive(f"routing.{name}", getattr(self, name))
        if not isinstance(self.norm_topk_prob, bool):  # "false" is truthy: it would normalize
            raise ValueError(f"routing.norm_topk_prob: must be a bool, got {self.norm_topk_prob!r}")
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"routing.routed_scaling_factor: must be a finite number > 0, got {factor!r}")

    def plan_ints(self) -> tuple[int, ...]:
        """The integer fields a cached plan depends on (the scaling factor is a launch argument)."""
        return MODES.index(self.mode), self.top_k, self.n_group, self.topk_group, int(self.norm_topk_prob)


def _check_logits(logits: torch.Tensor, top_k: int) -> int:
    check_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    num_experts = logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 < top_k <= num_experts:
        raise ValueError(f"top_k: must be an integer in [1, E = {num_experts}], got {top_k!r}")
    return num_experts


def check_grouping(num_experts: int, top_k: int, n_group: int, topk_group: int) -> int:
    """Validate DeepSeek group-limited routing parameters; return the group size."""
    if not isinstance(n_group, int) or n_group <= 0 or num_experts % n_group:
        raise ValueError(f"n_group: must be a positive divisor of E = {num_experts}, got {n_group!r}")
    if not isinstance(topk_group, int) or not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group: must be an integer in [1, n_group = {n_group}], got {topk_group!r}")
    group_size = num_experts // n_group
    if top_k > topk_group * group_size:
        raise ValueError(f"top_k: {top_k} exceeds the {topk_group} kept groups x {group_size} experts")
    return group_size


def check_finite(name: str, t: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``t`` holds a NaN or an infinity (reads it: one host sync; skipped
    inside a CUDA-graph capture, where nothing may be read)."""
    if t is None or not t.numel() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        nans = int(t.isnan().sum())
        raise ValueError(f"{name}: must be finite, got {nans} NaN and {int((~finite).sum()) - nans} inf values "
                         "(check_values=False propagates them instead)")


def check_route_values(logits: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The value checks of ``check_values=True``: every logit and bias entry finite."""
    check_finite("logits", logits)
    check_finite("bias", bias)


def _nan_last(keys: torch.Tensor) -> torch.Tensor:
    """Selection keys with NaN as -inf: a NaN never ranks before a finite key (``torch.topk`` would rank it first)."""
    return keys.masked_fill(keys.isnan(), float("-inf"))


def _top_ids(keys: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The ``top_k`` largest ``keys [T, E]`` (no NaN) in descending order, the lowest expert first among equal keys
    (as the kernel and the oracle; ``torch.topk`` orders ties its own way): a stable sort. ``allowed [T, E]`` bool:
    only those experts (every one of them ranks before any other, a -inf key too: the experts of the kept groups)."""
    ids = keys.sort(dim=-1, descending=True, stable=True).indices
    if allowed is not None:
        ids = ids.gather(1, (~allowed.gather(1, ids)).to(torch.uint8).sort(dim=-1, stable=True).indices)
    return ids[:, :top_k]


def deepseek_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    *,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing. ``logits[T, E]``, ``bias[E]`` (the e_score_correction_bias, or None)
    -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)``. ``check_values``: the module docstring. Among groups of
    equal score the lowest are kept, among experts of equal score the lowest are chosen first (as the kernel and the
    reference do). Bad arguments raise a ValueError naming them before anything runs."""
    num_experts = _check_logits(logits, top_k)
    group_size = check_grouping(num_experts, top_k, n_group, topk_group)
    check_bias(bias, "deepseek", num_experts, logits.device)
    if check_values:
        check_route_values(logits, bias)
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    unknown = choice.isnan()  # (with a bias: a chosen expert's weight is NaN where its key is)
    choice = choice.masked_fill(unknown, float("-inf"))
    allowed = None  # (the experts of the kept groups; a NaN or -inf key among them still ranks before the others)
    if topk_group < n_group:
        grouped = choice.view(-1, n_group, group_size)
        group_score = _nan_last(grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1))  # [T, n_group]
        kept = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]  # (ties: lowest group)
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        allowed = allowed.repeat_interleave(group_size, dim=1)
    ids = _top_ids(choice, top_k, allowed)
    weights = scores.gather(1, ids)
    if bias is not None:
        weights = weights.masked_fill(unknown.gather(1, ids), float("nan"))
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def check_bias(bias: torch.Tensor | None, mode: str, num_experts: int, device: torch.device,
               name: str = "bias") -> None:
    """A DeepSeek correction bias: None, or fp32/fp16/bf16 ``[E]`` on ``device``; softmax routing takes none."""
    if bias is None:
        return
    if mode == "softmax":
        raise ValueError(f"{name}: softmax routing takes no correction bias")
    check_tensor(name, bias, dtype=(torch.float32, torch.float16, torch.bfloat16), shape=(num_experts,),
                 device=device)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True, *,
                 check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (gpt-oss with ``renormalize``). ``logits[T, E]``
    -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)``. ``check_values``: the module docstring."""
    _check_logits(logits, top_k)
    if check_values:
        check_route_values(logits, None)
    x = logits.float()
    ids = _top_ids(_nan_last(x), top_k)
    chosen = x.gather(1, ids)
    if renormalize:
        weights = chosen.softmax(dim=-1)
    else:
        weights = x.softmax(dim=-1).gather(1, ids)  # (an infinite logit: every weight NaN, as the oracle's)
    return weights, ids.to(torch.int32)


def check_routing(routing: RoutingConfig, num_experts: int, bias: torch.Tensor | None, device: torch.device,
                  bias_name: str = "bias") -> None:
    """What a routing over ``num_experts`` experts needs: a :class:`RoutingConfig` with ``top_k`` <= E, DeepSeek's
    groups dividing E, and the bias :func:`check_bias` takes."""
    if not isinstance(routing, RoutingConfig):
        raise ValueError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")
    if routing.top_k > num_experts:
        raise ValueError(f"top_k: must be an integer in [1, E = {num_experts}], got {routing.top_k!r}")
    if routing.mode == "deepseek":
        check_grouping(num_experts, routing.top_k, routing.n_group, routing.topk_group)
    check_bias(bias, routing.mode, num_experts, device, bias_name)


def check_route(logits: torch.Tensor, routing: RoutingConfig, bias: torch.Tensor | None) -> int:
    """:func:`route`'s checks: ``logits`` (fp32/fp16/bf16 ``[T, E]``) first, then :func:`check_routing`; returns E."""
    check_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    check_routing(routing, logits.shape[1], bias, logits.device)
    return logits.shape[1]


def route(logits: torch.Tensor, routing: RoutingConfig, bias: torch.Tensor | None = None, *,
          check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``routing.mode``: ``logits[T, E]`` (+ DeepSeek ``bias[E]``) -> ``(weights fp32, ids int32)``.
    ``check_values``: reject non-finite logits or bias (one host read), or propagate them (the module docstring)."""
    check_route(logits, routing, bias)
    if check_values:
        check_route_values(logits, bias)
    if routing.mode == "deepseek":
        return deepseek_topk(logits, bias, routing.top_k, routing.n_group, routing.topk_group,
                             routing.norm_topk_prob, routing.routed_scaling_factor, check_values=False)
    return softmax_topk(logits, routing.top_k, routing.norm_topk_prob, check_values=False)
