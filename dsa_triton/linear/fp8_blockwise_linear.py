"""``dt.fp8_blockwise_linear``: a dense layer on blockwise-FP8 weights (DeepSeek-V3 / V3.2 checkpoints).

``y[M, N] = x[M, K] @ W.T`` with ``W = weight * weight_scale_inv`` per 128 x 128 block (format: :mod:`.formats`).
The weights stay e4m3 in memory (half the bytes of bf16) and are converted in registers
(:mod:`.fp8_blockwise_linear_kernels`); activations are not quantized. Launch configs come from the tuning database
through the registry (:data:`LAUNCH`: ``BLOCK_M`` x ``BLOCK_N`` output tile per program, ``BLOCK_K`` a divisor of the
128-wide scale block, ``GROUP_M`` row tiles per program group for L2 reuse of weight tiles, ``num_warps``,
``num_stages``; phase decode up to ``DECODE_MAX_ROWS`` rows, prefill above) unless ``config`` is given.
"""
from __future__ import annotations

import torch

from ..checks import check_kernel_device, check_out, check_tensor
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..hostmath import cdiv, next_pow2
from ..launch import launch_with
from ..registry import LaunchSpace
from ..runtime import interpreting
from .formats import BLOCK
from .fp8_blockwise_linear_kernels import fp8_linear_kernel

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DECODE_MAX_ROWS = 64
SMEM_BYTES = 232448  # Hopper's shared memory per block (227 KiB)
ACC_REGISTERS = 128  # fp32 accumulator registers per thread at most


def linear_shape(M: int, N: int, K: int) -> tuple[str, dict[str, int]]:
    """Phase and registry shape of a call."""
    return ("decode" if M <= DECODE_MAX_ROWS else "prefill"), {"M": M, "N": N, "K": K}


def _constraint(config, shape) -> str | None:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if bm > max(16, next_pow2(shape["M"])):
        return f"BLOCK_M={bm} is taller than the {shape['M']} rows"
    if bn > max(32, next_pow2(shape["N"])):
        return f"BLOCK_N={bn} is wider than N={shape['N']}"
    if bm * bn / (32 * config["num_warps"]) > ACC_REGISTERS:
        return f"the {bm}x{bn} accumulator needs more than {ACC_REGISTERS} registers a thread: more warps"
    stage_bytes = bm * bk * 2 + bk * bn  # pipelined loads: activations (2 bytes) and e4m3 weights
    smem = config["num_stages"] * stage_bytes + bk * bn * 2  # plus one 16-bit copy of the weight tile for the dot
    if smem > SMEM_BYTES:
        return f"{config['num_stages']} stages of {stage_bytes} bytes and the converted weight tile exceed shared memory"
    return None


def _default(phase, shape) -> dict:
    """Until tuned: tiles that compile for sm_90 without register spills (ptxas, bf16 activations)."""
    if phase == "decode":
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    config["BLOCK_N"] = min(config["BLOCK_N"], max(32, next_pow2(shape["N"])))
    config["BLOCK_M"] = min(config["BLOCK_M"], max(16, next_pow2(shape["M"])))
    return config


LAUNCH = LaunchSpace(
    name="fp8_blockwise_linear",
    phases=("decode", "prefill"),
    space={"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (32, 64, 128, 256), "BLOCK_K": (32, 64, 128),
           "GROUP_M": (1, 8), "num_warps": (4, 8), "num_stages": (2, 3, 4)},
    default=_default,
    fixed_dims=("N", "K"),
    bucketed_dims=("M",),
    constraint=_constraint,
)


class LinearLaunch:
    """One checked :func:`fp8_linear_kernel` launch but its tensors."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, config: dict | None):
        (M, K), N = x.shape, weight.shape[0]
        phase, shape = linear_shape(M, N, K)
        config = LAUNCH.launch_config(phase, shape, x.device) if config is None else LAUNCH.validate(config, shape)
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


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("fp8_blockwise_linear")
def fp8_blockwise_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                            check_values: bool = True, config: str | None = None) -> torch.Tensor:
    """:func:`dt.fp8_blockwise_linear`: ``y[M, N]`` in ``x``'s dtype from e4m3 ``weight[N, K]`` and its fp32
    ``weight_scale_inv`` per 128 x 128 block."""
    return fp8_blockwise_linear(x, weight, weight_scale_inv, config=op_config(config), check_values=check_values)


@fp8_blockwise_linear_op.register_fake
def _(x, weight, weight_scale_inv, check_values=True, config=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


@dsa_op("fp8_blockwise_linear_out", mutates_args=("out",))
def fp8_blockwise_linear_out(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, out: torch.Tensor,
                             check_values: bool = True, config: str | None = None) -> None:
    """:func:`dt.fp8_blockwise_linear` into ``out[M, N]`` in ``x``'s dtype (contiguous)."""
    fp8_blockwise_linear(x, weight, weight_scale_inv, config=op_config(config), check_values=check_values, out=out)


@fp8_blockwise_linear_out.register_fake
def _(x, weight, weight_scale_inv, out, check_values=True, config=None):
    return None
