"""The MoE layer: route, sort by expert, gate_up GEMM, SwiGLU, down GEMM, weighted combine, shared expert.

Expert weights are MXFP4 (gpt-oss layout): ``gate_up [E, 2I, H/32, 16]`` + scales ``[E, 2I, H/32]`` and
``down [E, H, I/32, 16]`` + scales ``[E, H, I/32]``. The gate_up rows are the gate projection (rows
``0 .. I-1``) followed by the up projection (rows ``I .. 2I-1``), DeepSeek's gate_proj / up_proj stacked;
the activation is ``silu(gate) * up``. (gpt-oss interleaves gate and up rows: de-interleave at load.)

Two paths for the grouped GEMMs, chosen per shape by the ``path`` of :data:`LAUNCH` (the tuning database, else a
crossover on the average routed rows per expert): ``fused`` (:func:`.fused_moe_gemm.fused_moe_gemm`,
MXFP4 dequantized in registers: decode and small batches) and ``workspace``
(:func:`.fp8_grouped_gemm.fp8_grouped_gemm`: online MXFP4 -> FP8 conversion into the shared workspace plus an
FP8 GEMM with e4m3 activations: large batches; it reads the expert offsets on the host, one sync).
:func:`moe_experts` is the layer after its routing (given expert ids and weights): what an expert-parallel rank runs
on the rows sent to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import check_kernel_device, check_out, check_tensor
from ..library import dsa_op, op_config
from ..plans import PlanCache
from ..registry import LaunchSpace
from .activation import swiglu
from .fp8_grouped_gemm import fp8_grouped_gemm
from .fused_moe_gemm import check_scale_bytes, fused_moe_gemm, gemm_shape, launch_config, scale_max
from .permute import check_id_range, combine_rows
from .permute import check_routing as check_routing_ids
from .route_topk import route_topk
from .routing import RoutingConfig, check_routing
from .sort_and_align import sort_and_align

DECODE_MAX_TOKENS = 256  # moe_forward's phase when none is given: decode up to this many tokens
NAN_SCALE = 0xFF  # the E8M0 scale byte that is NaN: rejected on either path

# the default's crossover (a tuned record per shape overrides it): the grouped-GEMM ("workspace") path from this many
# routed rows per expert, where its FP8 tensor cores outrun the fused kernel's dequantization in registers; below
# it the fused path, which reads each active expert's MXFP4 bytes once and writes no workspace
CROSSOVER_ROWS = 32


def _default(phase, shape):
    rows_per_expert = shape["T"] * shape["top_k"] / shape["E"]
    return {"path": "workspace" if rows_per_expert >= CROSSOVER_ROWS else "fused"}


LAUNCH = LaunchSpace(name="moe_forward", phases=("decode", "prefill"), space={"path": ("fused", "workspace")},
                     default=_default, fixed_dims=("E", "top_k", "hidden", "I"), bucketed_dims=("T",))


def shared_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act=swiglu) -> torch.Tensor:
    """Dense SwiGLU MLP: ``x[T, H]``, ``gate_up[2Is, H]`` (gate | up), ``down[H, Is]`` -> ``[T, H]``; ``act``:
    :func:`.activation.swiglu` (one launch) or the torch reference."""
    return act(x @ gate_up.t()) @ down.t()


def _check(x, router_weight, router_bias, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
           routing, shared_gate_up, shared_down) -> tuple[int, int, int]:
    experts, hidden, inter = _check_experts(x, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                                            shared_gate_up, shared_down)
    check_tensor("router_weight", router_weight, dtype=(torch.float32, torch.float16, torch.bfloat16),
                 shape=(experts, hidden), device=x.device)
    check_routing(routing, experts, router_bias, x.device, bias_name="router_bias")
    return experts, hidden, inter


def _check_experts(x, gate_up_blocks, gate_up_scales, down_blocks, down_scales, shared_gate_up,
                   shared_down) -> tuple[int, int, int]:
    check_tensor("x", x, dtype=(torch.float16, torch.bfloat16), ndim=2)
    device = check_kernel_device("x", x)
    tokens, hidden = x.shape
    check_tensor("gate_up_blocks", gate_up_blocks, dtype=torch.uint8, ndim=4, device=device)
    experts, two_i, groups, _ = gate_up_blocks.shape
    if groups * 32 != hidden or two_i % 2 or gate_up_blocks.shape[3] != 16:
        raise ValueError(f"gate_up_blocks: expected [E, 2I, H/32 = {hidden // 32}, 16], got {tuple(gate_up_blocks.shape)}")
    inter = two_i // 2
    if inter % 32:
        raise ValueError(f"gate_up_blocks: the intermediate size I = {inter} must be a multiple of 32 (MXFP4 down K)")
    check_tensor("gate_up_scales", gate_up_scales, dtype=torch.uint8, shape=(experts, two_i, groups), device=device)
    check_tensor("down_blocks", down_blocks, dtype=torch.uint8, shape=(experts, hidden, inter // 32, 16), device=device)
    check_tensor("down_scales", down_scales, dtype=torch.uint8, shape=(experts, hidden, inter // 32), device=device)
    for name, blocks in (("gate_up_blocks", gate_up_blocks), ("down_blocks", down_blocks)):
        # what both paths' kernels read (int16 and int32 words), so that no token count changes what is accepted
        if blocks.stride(-2) != 16 or any(stride % 4 for stride in blocks.stride()[:-2]):
            raise ValueError(f"{name}: each row's K/32 x 16 bytes must be contiguous and the other strides multiples "
                             f"of 4 (the kernels read 32-bit words), got strides {blocks.stride()}")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up / shared_down: give both or neither")
    if shared_gate_up is not None:
        check_tensor("shared_gate_up", shared_gate_up, dtype=x.dtype, ndim=2, device=device)
        if shared_gate_up.shape[1] != hidden or shared_gate_up.shape[0] % 2:
            raise ValueError(f"shared_gate_up: expected [2Is, H = {hidden}], got {tuple(shared_gate_up.shape)}")
        check_tensor("shared_down", shared_down, dtype=x.dtype, shape=(hidden, shared_gate_up.shape[0] // 2),
                     device=device)
    return experts, hidden, inter


def gate_up_block_m(x: torch.Tensor, experts: int, top_k: int, hidden: int, inter: int) -> int:
    """The ``BLOCK_M`` the fused gate_up GEMM will launch with (its registry config for this shape), so the
    permutation kernel can align the rows for it in the same launch."""
    shape = gemm_shape(x.shape[0], experts, top_k, 2 * inter, hidden, gather_tokens=True)
    return launch_config(shape, x.device)["BLOCK_M"]


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, gate_up_blocks: torch.Tensor,
                gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor, *,
                routing: RoutingConfig, router_bias: torch.Tensor | None = None,
                shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                phase: str | None = None, config: dict | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One MoE layer: ``x[T, H]`` (fp16/bf16) -> ``y[T, H]`` in ``x``'s dtype.

    - ``router_weight [E, H]``: logits = x @ router_weight.T in fp32; ``router_bias [E]``: DeepSeek's
      e_score_correction_bias (selection only; None for softmax routing);
    - ``gate_up_blocks/scales``, ``down_blocks/scales``: MXFP4 experts (layout: module docstring);
    - ``routing``: :class:`.routing.RoutingConfig`;
    - ``shared_gate_up [2Is, H]`` / ``shared_down [H, Is]``: the shared expert in ``x``'s dtype, or None;
    - ``phase``: "decode" or "prefill" for the tuning lookup (None: decode up to 256 tokens);
    - ``config``: a ``moe_forward`` config ``{"path": "fused" | "workspace"}``; None reads the tuning database;
    - ``out``: optional ``[T, H]`` tensor in ``x``'s dtype to write (and return); the combine writes it.

    The fused path (decode) has no host sync and no data-dependent shape once each scales tensor's range has
    been read (the first call per tensor and in-place version): after one eager warm-up call it can be captured
    in a CUDA graph. It runs 5 Triton launches (routing: :func:`.route_topk.route_topk`; sort by expert and
    block alignment for the gate_up GEMM's ``BLOCK_M``: :func:`.sort_and_align.sort_and_align`, both on every
    path up to 4096 routed rows; gate_up; :func:`.activation.swiglu`, written class-major so that the down GEMM
    copies nothing; down), one more for the shared expert's swiglu, and the kernel-launching torch ops of the
    router, gate_up's activation copy, the shared expert's matmuls and the combine. The grouped-GEMM path
    ("workspace") has no host sync either where its config takes the registers route and every expert fits it
    (tiles planned on the device); its workspace routes read the expert offsets on the host (one sync a GEMM).

    Errors about an expert weight name it (``gate_up_blocks``, ``down_scales``, ...), on either path, before any
    launch. Non-finite input: a NaN scale byte (0xFF) is rejected on either path, and on the fused path any byte
    above its :func:`.fused_moe_gemm.scale_max` (the range read once per scales tensor and in-place version); ``x`` and
    the router are not read on the host: a NaN or infinity propagates (a NaN router logit or bias never ranks first,
    :func:`.route_topk.route_topk` with ``check_values=False``; a token that reads a NaN gets NaN outputs), never
    a finite wrong number.
    """
    if type(routing) is RoutingConfig:  # the checks read only metadata and these routing fields: run once
        key, sizes = _PLANS.find((x, router_weight, router_bias, gate_up_blocks, gate_up_scales, down_blocks,
                                  down_scales, shared_gate_up, shared_down),
                                 routing.plan_ints())
    else:  # not a RoutingConfig: the checks name it
        key, sizes = None, None
    if sizes is None:
        sizes = _check(x, router_weight, router_bias, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                       routing, shared_gate_up, shared_down)
        sizes = _PLANS.put(key, (*sizes, gate_up_block_m(x, sizes[0], routing.top_k, *sizes[1:])))
    if out is not None:
        check_out(out, (x.shape[0], sizes[1]), x.dtype, x.device, contiguous=False)
    config = _path_config(x, sizes, routing.top_k, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                          phase, config)
    logits = F.linear(x.float(), router_weight.float())
    # one launch at any T (lowest expert first on ties); non-finite logits propagate (a NaN never ranks first)
    weights, ids = route_topk(logits, routing, router_bias, check_values=False)
    return _grouped(x, ids, weights, sizes, config, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                    shared_gate_up, shared_down, x.dtype, out)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
                gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, down_blocks: torch.Tensor,
                down_scales: torch.Tensor, *, shared_gate_up: torch.Tensor | None = None,
                shared_down: torch.Tensor | None = None, phase: str | None = None, config: dict | None = None,
                out_dtype: torch.dtype | None = None, check_ids: bool = True) -> torch.Tensor:
    """The layer after its routing: ``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` (+ the
    shared expert), what :func:`moe_forward` runs once :func:`.route_topk.route_topk` has chosen the experts.
    An expert-parallel rank runs it on the rows dispatched to it, each row with its one local expert (``top_k`` 1,
    weights None, fp32 out: the routing weights are applied where the rows return).

    - ``x [T, H]`` fp16/bf16; ``topk_ids [T, top_k]`` int32/int64 in ``[0, E)``; ``topk_weights [T, top_k]``
      fp32/fp16/bf16, or None for ones;
    - the experts, ``shared_gate_up`` / ``shared_down``, ``phase`` and ``config``: as in :func:`moe_forward`;
    - ``out_dtype``: ``y``'s dtype (default ``x``'s; the combine itself runs in fp32);
    - ``check_ids``: read the ids' range on the host (one sync) and raise ``ValueError`` naming ``topk_ids``
      outside ``[0, E)``; off, such ids give unspecified rows (never an access out of bounds).
    """
    key, sizes = _EXPERT_PLANS.find((x, topk_ids, topk_weights, gate_up_blocks, gate_up_scales, down_blocks,
                                     down_scales, shared_gate_up, shared_down))
    if sizes is None:
        sizes = _check_experts(x, gate_up_blocks, gate_up_scales, down_blocks, down_scales, shared_gate_up,
                               shared_down)
        check_routing_ids(topk_ids, topk_weights, sizes[0])
        check_tensor("topk_ids", topk_ids, shape=(x.shape[0], None), device=x.device, contiguous_last=False)
        sizes = _EXPERT_PLANS.put(key, (*sizes, gate_up_block_m(x, sizes[0], topk_ids.shape[1], *sizes[1:])))
    if check_ids:
        check_id_range(topk_ids, sizes[0])
    config = _path_config(x, sizes, topk_ids.shape[1], gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                          phase, config)
    return _grouped(x, topk_ids, topk_weights, sizes, config, gate_up_blocks, gate_up_scales, down_blocks,
                    down_scales, shared_gate_up, shared_down, out_dtype or x.dtype, None)


def _path_config(x, sizes, top_k, gate_up_blocks, gate_up_scales, down_blocks, down_scales, phase, config) -> dict:
    """The ``moe_forward`` config of this shape, and the scale bytes checked against the bound of its path."""
    experts, hidden, inter, _ = sizes
    tokens = x.shape[0]
    phase = phase or ("decode" if tokens <= DECODE_MAX_TOKENS else "prefill")
    shape = {"T": tokens, "E": experts, "top_k": top_k, "hidden": hidden, "I": inter}
    config = LAUNCH.launch_config(phase, shape, x.device) if config is None else LAUNCH.validate(config, shape)
    bound = scale_max(x) if config["path"] == "fused" else NAN_SCALE - 1
    for name, blocks, scales in (("gate_up", gate_up_blocks, gate_up_scales), ("down", down_blocks, down_scales)):
        if blocks.data_ptr() % 4:  # (not in the plan's key)
            raise ValueError(f"{name}_blocks: the data must be 4-byte aligned (the kernels read 32-bit words)")
        check_scale_bytes(scales, bound, f"{name}_scales")  # (once per tensor and in-place version)
    return config


def _grouped(x, ids, weights, sizes, config, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
             shared_gate_up, shared_down, out_dtype, out) -> torch.Tensor:
    """Sort the routed rows by expert, the two grouped GEMMs on ``config``'s path, the weighted combine (into
    ``out`` when given)."""
    experts, _, _, block_m = sizes
    sort = sort_and_align(ids, weights, experts, block_m if config["path"] == "fused" else None, check_ids=False)
    if config["path"] == "fused":  # fp32 GEMM outputs: no conversion op before swiglu and the combine
        h = fused_moe_gemm(x, sort, gate_up_blocks, gate_up_scales, gather_tokens=True, out_dtype=torch.float32)
        y = fused_moe_gemm(swiglu(h, x.dtype, class_major=True), sort, down_blocks, down_scales,  # no copy in down
                           gather_tokens=False, out_dtype=torch.float32)
    else:
        # offsets of our own sort: unchecked (no host sync on the registers route with fitting weights)
        h = fp8_grouped_gemm(x[sort.sorted_token], sort.expert_offsets, gate_up_blocks, gate_up_scales,
                             check_values=False)
        y = fp8_grouped_gemm(swiglu(h), sort.expert_offsets, down_blocks, down_scales, check_values=False)
    shared = None if shared_gate_up is None else shared_expert(x, shared_gate_up, shared_down)
    if out is None:
        return combine_rows(y, sort, add=shared).to(out_dtype)
    return out.copy_(combine_rows(y, sort, add=shared))


_PLANS = PlanCache(1024)  # _check's (E, H, I) and the gate_up BLOCK_M by tensor metadata and routing fields
_EXPERT_PLANS = PlanCache(1024)  # moe_experts' checked (E, H, I) and gate_up BLOCK_M by tensor metadata


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

@dsa_op("moe_forward")
def moe_forward_op(x: torch.Tensor, router_weight: torch.Tensor, gate_up_blocks: torch.Tensor,
                   gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor,
                   router_bias: torch.Tensor | None = None, shared_gate_up: torch.Tensor | None = None,
                   shared_down: torch.Tensor | None = None, mode: str = "deepseek", top_k: int = 8, n_group: int = 1,
                   topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                   phase: str | None = None, check_values: bool = True, config: str | None = None) -> torch.Tensor:
    """:func:`dt.moe_forward`: ``y[T, H]`` in ``x``'s dtype; the routing fields as in
    :class:`~dsa_triton.RoutingConfig` (:func:`~dsa_triton.library.routing_kwargs`), ``config`` a ``moe_forward``
    config such as ``'{"path": "fused"}'``."""
    routing = RoutingConfig(mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    return moe_forward(x, router_weight, gate_up_blocks, gate_up_scales, down_blocks, down_scales, routing=routing,
                       router_bias=router_bias, shared_gate_up=shared_gate_up, shared_down=shared_down, phase=phase,
                       config=op_config(config))


@moe_forward_op.register_fake
def _(x, *args, **kwargs):
    return x.new_empty(x.shape)


@dsa_op("moe_forward_out", mutates_args=("out",))
def moe_forward_out(x: torch.Tensor, router_weight: torch.Tensor, gate_up_blocks: torch.Tensor,
                    gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor,
                    out: torch.Tensor, router_bias: torch.Tensor | None = None,
                    shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                    routing_mode: str = "deepseek", top_k: int = 8, n_group: int = 1, topk_group: int = 1,
                    norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, phase: str | None = None,
                    check_values: bool = True, config: str | None = None) -> None:
    """:func:`dt.moe_forward` into ``out[T, H]`` in ``x``'s dtype (last dim contiguous). The routing mode is
    ``routing_mode`` here (``routing_kwargs(routing, "routing_mode")``): torch's functionalization of an op that
    mutates passes the arguments by name to a handler whose own first parameter is ``mode``."""
    routing = RoutingConfig(routing_mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    moe_forward(x, router_weight, gate_up_blocks, gate_up_scales, down_blocks, down_scales, routing=routing,
                router_bias=router_bias, shared_gate_up=shared_gate_up, shared_down=shared_down, phase=phase,
                config=op_config(config), out=out)


@moe_forward_out.register_fake
def _(x, *args, **kwargs):
    return None
