"""Manifold-constrained hyper-connections (mHC), as transformers' ``DeepseekV4HyperConnection`` and
``DeepseekV4HyperHead`` compute them: the residual is ``hc_mult`` streams ``x[T, hc, D]``; before a block a learned
projection of the normed streams gives ``pre`` (collapse the streams into the block's input), ``post`` (expand its
output back) and ``comb`` (mix the streams: Sinkhorn-normalized to doubly stochastic); after it
``x = post * block(collapse(x)) + comb^T x``. The hyper head collapses the streams once more before the final norm.
All mixing weights in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .norms import unweighted_rms_norm


class HyperConnection:
    """``fn [(2 + hc) hc, hc D]``, ``base [(2 + hc) hc]``, ``scale [3]`` (fp32), ``iterations`` Sinkhorn steps."""

    def __init__(self, w: dict, prefix: str, hc: int, iterations: int, hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = w[prefix + "fn"], w[prefix + "base"], w[prefix + "scale"]
        self.hc, self.iterations, self.hc_eps, self.norm_eps = hc, iterations, hc_eps, norm_eps

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x[T, hc, D]`` -> ``pre [T, hc]``, ``post [T, hc]``, ``comb [T, hc, hc]`` (fp32)."""
        hc = self.hc
        mixes = F.linear(unweighted_rms_norm(x.flatten(1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post * self.scale[1] + post_b)
        comb = torch.softmax(comb.view(-1, hc, hc) * self.scale[2] + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    def __call__(self, x: torch.Tensor, block) -> torch.Tensor:
        """``x[T, hc, D]`` through ``block`` (``[T, D] -> [T, D]``): ``post * block(sum_s pre_s x_s) + comb^T x``."""
        pre, post, comb = self.weights(x)
        out = block((pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype))
        return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)


class HyperHead:
    """The last collapse: ``hc_fn [hc, hc D]``, ``hc_base [hc]``, ``hc_scale [1]`` (fp32)."""

    def __init__(self, w: dict, prefix: str, hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = w[prefix + "hc_fn"], w[prefix + "hc_base"], w[prefix + "hc_scale"]
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x[T, hc, D]`` -> ``[T, D]``."""
        mixes = F.linear(unweighted_rms_norm(x.flatten(1).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
