"""``dt.fp8_blockwise_linear``: a dense layer on blockwise-FP8 weights (DeepSeek-V3 / V3.2 checkpoints).

``y[M, N] = x[M, K] @ W.T`` with ``W = weight * weight_scale_inv`` per 128 x 128 block (format:
:mod:`.fp8_linear_reference`). The weights stay e4m3 in memory (half the bytes of bf16) and are converted in
registers (:mod:`.fp8_linear_kernels`); activations are not quantized. Launch configs come from the tuning
database through the registry entry ``fp8_blockwise_linear`` (:mod:`.fp8_linear_spec`) unless ``config`` is given.
"""
from __future__ import annotations

import torch

from ..checks import PlanCache, check_kernel_device, check_out, check_tensor
from ..hostmath import cdiv
from ..launch import launch_with
from ..runtime import interpreting
from .fp8_linear_kernels import fp8_linear_kernel
from .fp8_linear_reference import BLOCK
from .fp8_linear_spec import SPEC, linear_shape

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LinearLaunch:
    """One checked :func:`fp8_linear_kernel` launch but its tensors."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, config: dict | None):
        (M, K), N = x.shape, weight.shape[0]
        phase, shape = linear_shape(M, N, K)
        config = SPEC.launch_config(phase, shape, x.device) if config is None else SPEC.validate(config, shape)
        self.out_shape, self.dtype = (M, N), x.dtype
        self.grid = (cdiv(M, config["BLOCK_M"]) * cdiv(N, config["BLOCK_N"]),) if M and N else None
        self.args = (M, N, K, x.stride(0), weight.stride(0), weight_scale_inv.stride(0), N)
        self.meta = dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                         GROUP_M=config["GROUP_M"], DOT_F32=interpreting() or x.dtype == torch.float32,
                         num_warps=config["num_warps"], num_stages=config["num_stages"])

    def __call__(self, x, weight, weight_scale_inv, out=None) -> torch.Tensor:
        y = torch.empty(self.out_shape, dtype=self.dtype, device=x.device) if out is None else out
        if self.grid is not None:
            if x.shape[1] == 0:
                y.zero_()
            else:
                launch_with(fp8_linear_kernel, self.grid, self.meta, x, weight, weight_scale_inv, y, *self.args)
        return y


def _checked_launch(x, weight, weight_scale_inv, config) -> LinearLaunch:
    check_tensor("x", x, dtype=X_DTYPES, ndim=2)
    device = check_kernel_device("x", x)
    check_tensor("weight", weight, dtype=torch.float8_e4m3fn, ndim=2, device=device)
    N, K = weight.shape
    if x.shape[1] != K:
        raise ValueError(f"x: dimension 1 must be K = {K} (weight is [N, K] = {tuple(weight.shape)}), "
                         f"got shape {tuple(x.shape)}")
    check_tensor("weight_scale_inv", weight_scale_inv, dtype=torch.float32,
                 shape=(cdiv(N, BLOCK), cdiv(K, BLOCK)), device=device)
    return LinearLaunch(x, weight, weight_scale_inv, config)


def _check_values(x, weight, weight_scale_inv) -> None:
    """Finite activations, no e4m3 NaN (bytes 0x7F / 0xFF) in the weights, finite positive scales: one transfer."""
    bytes_ = weight.view(torch.uint8) & 0x7F
    flags = torch.stack([~x.isfinite().all(), (bytes_ == 0x7F).any(),
                         ~(weight_scale_inv.isfinite() & (weight_scale_inv > 0)).all()]).tolist()
    for bad, message in zip(flags, ("x: holds a non-finite value", "weight: holds an e4m3 NaN",
                                    "weight_scale_inv: every scale must be finite and > 0")):
        if bad:
            raise ValueError(message)


_PLANS = PlanCache()


def fp8_blockwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                         config: dict | None = None, check_values: bool = True,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[M, N] = x @ (weight * weight_scale_inv per 128 x 128 block).T``, in ``x``'s dtype (fp32 accumulation).

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32 activations, last dim contiguous (any ``M``, including 0).
        weight: ``[N, K]`` float8_e4m3fn, last dim contiguous (a DeepSeek-V3 / V3.2 checkpoint's ``*.weight``).
        weight_scale_inv: ``[ceil(N / 128), ceil(K / 128)]`` fp32, one scale per 128 x 128 block (the checkpoint's
            ``*.weight_scale_inv``); ``N`` and ``K`` need not be multiples of 128.
        config: ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}`` (default: the tuning
            database / the registry default for the shape).
        check_values: also reject non-finite ``x``, e4m3 NaN weights and non-finite or non-positive scales (host
            reads, one transfer); ``False`` reads nothing on the host (CUDA-graph safe). Shapes, dtypes and devices
            are always checked (once per tensor metadata and config).
        out: optional ``[M, N]`` contiguous tensor in ``x``'s dtype to write (and return).
    """
    key, launch = _PLANS.find((x, weight, weight_scale_inv, out), (), config)
    if launch is None:
        launch = _checked_launch(x, weight, weight_scale_inv, config)
        if out is not None:
            check_out(out, launch.out_shape, launch.dtype, x.device)
        launch = _PLANS.put(key, launch)
    if check_values:
        _check_values(x, weight, weight_scale_inv)
    return launch(x, weight, weight_scale_inv, out)
