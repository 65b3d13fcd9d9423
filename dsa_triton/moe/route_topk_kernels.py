"""The Triton kernel of :func:`.route_topk.route_topk` and the register tile it holds per token.

One program routes ``TOKENS`` tokens; a token's logits sit in registers as a ``[groups, group block]`` tile
(power-of-two blocks, masked, so E need not be a power of two). DeepSeek mode: sigmoid, bias for the selection
key, each group's top-2 sum, the ``topk_group`` best groups by repeated argmax, then ``top_k`` repeated argmaxes
over the kept experts (lowest expert on exact ties), the weights normalized and scaled in registers. Softmax mode:
the same top-k on the logits, then the softmax of the chosen logits (``NORM``) or their full-softmax probabilities.
A NaN key (and a NaN group key: +inf + -inf) ranks as -inf, last; a chosen expert whose key is NaN has a NaN
weight (a NaN bias makes it so explicitly: the weight itself does not read the bias), and the normalization
spreads it over the token, as :mod:`.routing` does.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..hostmath import next_pow2

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
            x = tl.where(key == key, x, key)  # a NaN key's weight is NaN
    key = tl.where(key != key, float("-inf"), key)  # NaN ranks last
    avail = valid
    if GROUPED:  # keep the topk_group groups with the best top-2 key sums
        in_group = tl.where(valid, key, float("-inf"))
        top1 = tl.max(in_group, 2)
        first = tl.min(tl.where(in_group == top1[:, :, None], j[None, None, :], GROUP_BLOCK), 2)
        top2 = tl.max(tl.where(j[None, None, :] == first[:, :, None], float("-inf"), in_group), 2)
        group_key = tl.where(group_size > 1, top1 + top2, top1)
        group_key = tl.where(group_key != group_key, float("-inf"), group_key)[:, :, None]  # [TOKENS, GROUPS, 1]
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
