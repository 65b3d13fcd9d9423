"""The MoE layer: route, sort by expert, gate_up GEMM, SwiGLU, down GEMM, weighted combine, shared expert.

Expert weights are MXFP4 (gpt-oss layout): ``gate_up [E, 2I, H/32, 16]`` + scales ``[E, 2I, H/32]`` and
``down [E, H, I/32, 16]`` + scales ``[E, H, I/32]``. The gate_up rows are the gate projection (rows
``0 .. I-1``) followed by the up projection (rows ``I .. 2I-1``), DeepSeek's gate_proj / up_proj stacked;
the activation is ``silu(gate) * up``. (gpt-oss interleaves gate and up rows: de-interleave at load.)

Two paths for the grouped GEMMs, chosen per shape by the ``moe_path`` registry entry (the tuning database,
else a crossover on the average routed rows per expert): ``fused`` (:func:`.fused_moe.fused_moe_gemm`,
MXFP4 dequantized in registers: decode and small batches) and ``workspace``
(:func:`.fp8_grouped_gemm.fp8_grouped_gemm`: online MXFP4 -> FP8 conversion into the shared workspace plus an
FP8 GEMM with e4m3 activations: large batches; it reads the expert offsets on the host, one sync).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .. import registry
from ..checks import PlanCache, check_kernel_device, check_tensor
from ..registry import Cost
from . import activation, fused_moe, permute, permute_kernel, routing_kernel
from .activation import swiglu
from .activation_reference import swiglu_torch
from .fp8_grouped_gemm import fp8_grouped_gemm
from .fused_moe import ExpertWeights, expected_active_experts, fused_moe_gemm
from .layer_reference import moe_forward_torch
from .permute import combine_rows, sort_by_expert
from .permute_kernel import sort_and_align
from .routing import RoutingConfig, check_routing, route
from .routing_kernel import route_topk

DECODE_MAX_TOKENS = 256  # moe_forward's phase when none is given: decode up to this many tokens
# default (until tuned): the grouped-GEMM ("workspace") path from this many routed rows per expert. H200 graph
# times (results/h200/tune-...-1400): 32 rows (T=1024, top-8 of 256) 3774 us against 8228 fused (2.18x); 4 rows
# (T=128) fused faster; in between not measured
CROSSOVER_ROWS = 32


def shared_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act=swiglu) -> torch.Tensor:
    """Dense SwiGLU MLP: ``x[T, H]``, ``gate_up[2Is, H]`` (gate | up), ``down[H, Is]`` -> ``[T, H]``; ``act``:
    :func:`.activation.swiglu` (one launch) or the torch reference."""
    return act(x @ gate_up.t()) @ down.t()


def _check(x, router_weight, router_bias, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
           routing, shared_gate_up, shared_down) -> tuple[int, int, int]:
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
    check_tensor("router_weight", router_weight, dtype=(torch.float32, torch.float16, torch.bfloat16),
                 shape=(experts, hidden), device=device)
    check_routing(routing, experts, router_bias, device, bias_name="router_bias")
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
    shape = fused_moe.gemm_shape(x.shape[0], experts, top_k, 2 * inter, hidden, gather_tokens=True)
    return fused_moe.SPEC.launch_config("decode", shape, x.device)["BLOCK_M"]


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, gate_up_blocks: torch.Tensor,
                gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor, *,
                routing: RoutingConfig, router_bias: torch.Tensor | None = None,
                shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                phase: str | None = None, config: dict | None = None) -> torch.Tensor:
    """One MoE layer: ``x[T, H]`` (fp16/bf16) -> ``y[T, H]`` in ``x``'s dtype.

    - ``router_weight [E, H]``: logits = x @ router_weight.T in fp32; ``router_bias [E]``: DeepSeek's
      e_score_correction_bias (selection only; None for softmax routing);
    - ``gate_up_blocks/scales``, ``down_blocks/scales``: MXFP4 experts (layout: module docstring);
    - ``routing``: :class:`.routing.RoutingConfig`;
    - ``shared_gate_up [2Is, H]`` / ``shared_down [H, Is]``: the shared expert in ``x``'s dtype, or None;
    - ``phase``: "decode" or "prefill" for the tuning lookup (None: decode up to 256 tokens);
    - ``config``: a ``moe_path`` config ``{"path": "fused" | "workspace"}``; None reads the tuning database.

    The fused path (decode) has no host sync and no data-dependent shape once each scales tensor's range has
    been read (the first call per tensor and in-place version): after one eager warm-up call it can be captured
    in a CUDA graph. It runs 5 Triton launches (routing: :func:`.routing_kernel.route_topk`; sort by expert and
    block alignment for the gate_up GEMM's ``BLOCK_M``: :func:`.permute_kernel.sort_and_align`, both on every
    path up to 4096 routed rows; gate_up; :func:`.activation.swiglu`, written class-major so that the down GEMM
    copies nothing; down), one more for the shared expert's swiglu, and the kernel-launching torch ops of the
    router, gate_up's activation copy, the shared expert's matmuls and the combine. The grouped-GEMM path
    ("workspace") has no host sync either where its config takes the registers route and every expert fits it
    (tiles planned on the device); its workspace routes read the expert offsets on the host (one sync a GEMM).
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
    experts, hidden, inter, block_m = sizes
    tokens = x.shape[0]
    phase = phase or ("decode" if tokens <= DECODE_MAX_TOKENS else "prefill")
    shape = {"T": tokens, "E": experts, "top_k": routing.top_k, "hidden": hidden, "I": inter}
    config = PATH.launch_config(phase, shape, x.device) if config is None else PATH.validate(dict(config), shape)

    logits = F.linear(x.float(), router_weight.float())
    weights, ids = route_topk(logits, routing, router_bias)  # one launch at any T (lowest expert first on ties)
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
    return combine_rows(y, sort, add=shared).to(x.dtype)


_PLANS = PlanCache(1024)  # _check's (E, H, I) and the gate_up BLOCK_M by tensor metadata and routing fields


# -- registry entry: which path per shape ------------------------------------------------------------
def _default(phase, shape):
    rows_per_expert = shape["T"] * shape["top_k"] / shape["E"]
    return {"path": "workspace" if rows_per_expert >= CROSSOVER_ROWS else "fused"}


def _routing_of(shape) -> RoutingConfig:
    return RoutingConfig("deepseek", top_k=shape["top_k"], n_group=shape.get("n_group", 1),
                         topk_group=shape.get("topk_group", 1), routed_scaling_factor=2.5)


def _make_inputs(phase, shape, device, seed):
    """A DeepSeek-style layer: random MXFP4 experts (shared by every seed), router, bias, bf16 shared expert."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    e, h, i = shape["E"], shape["hidden"], shape["I"]
    dense = lambda *size: (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5).to(dtype)
    return {"x": torch.randn(shape["T"], h, generator=gen, device=device).to(dtype),
            "router_weight": torch.randn(e, h, generator=gen, device=device) * h ** -0.5,
            "router_bias": torch.randn(e, generator=gen, device=device) * 0.1,
            "gate_up": ExpertWeights.random(e, 2 * i, h, device), "down": ExpertWeights.random(e, h, i, device),
            "shared_gate_up": dense(2 * i, h), "shared_down": dense(h, i), "routing": _routing_of(shape)}


def _layer_args(inputs):
    gu, dn = inputs["gate_up"], inputs["down"]
    return ((inputs["x"], inputs["router_weight"], gu.blocks, gu.scales, dn.blocks, dn.scales),
            dict(routing=inputs["routing"], router_bias=inputs["router_bias"],
                 shared_gate_up=inputs["shared_gate_up"], shared_down=inputs["shared_down"]))


def _run(inputs, config):
    args, kwargs = _layer_args(inputs)
    return moe_forward(*args, **kwargs, config=config)


def _reference(inputs):
    args, kwargs = _layer_args(inputs)
    return moe_forward_torch(*args, **kwargs)


def compare_layer(out: torch.Tensor, ref: torch.Tensor, max_relative: float = 0.06) -> str | None:
    """None when ``||out - ref|| / ||ref|| <= max_relative``. Loose enough for the workspace path, which rounds
    the activations to e4m3 (about 4% relative error against the fp32 oracle; the fused path is near 0.05%)."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.float()
    if not torch.isfinite(out).all():
        return "non-finite values in the output"
    error = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item() if ref.numel() else 0.0
    return None if error <= max_relative else f"relative error {error:.3g} over {max_relative}"


def bf16_layer(inputs) -> torch.Tensor:
    """Baseline: the same layer in plain torch on pre-dequantized bf16 experts (cuBLAS mm per active expert)."""
    x = inputs["x"]
    logits = F.linear(x.float(), inputs["router_weight"])
    weights, ids = route(logits, inputs["routing"], inputs["router_bias"])
    sort = sort_by_expert(ids, weights, inputs["gate_up"].blocks.shape[0], check_ids=False)
    rows = x[sort.sorted_token.long()]
    w1, w2 = inputs["gate_up"].dense(x.dtype), inputs["down"].dense(x.dtype)
    y = rows.new_empty(rows.shape[0], x.shape[1])
    bounds = sort.expert_offsets.tolist()  # the host needs the row ranges: one sync, as every torch loop has
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b > a:
            y[a:b] = swiglu_torch(rows[a:b] @ w1[e].t()) @ w2[e].t()
    shared = shared_expert(x, inputs["shared_gate_up"], inputs["shared_down"], act=swiglu_torch)
    return combine_rows(y, sort, add=shared).to(x.dtype)


def _cost(phase, shape) -> Cost:
    """Floor: the MXFP4 bytes of the experts expected to get rows, router and shared expert once, x and y."""
    t, h, i = shape["T"], shape["hidden"], shape["I"]
    rows = t * shape["top_k"]
    expert_bytes = expected_active_experts(shape) * 3 * h * i * 17 / 32
    dense_bytes = shape["E"] * h * 4 + 3 * h * i * 2 + 2 * t * h * 2
    flops = 2.0 * (rows + t) * 3 * h * i + 2.0 * t * h * shape["E"]
    return Cost(bytes=expert_bytes + dense_bytes, flops=flops)


def _bench_shapes(phase, gpu):
    if gpu:  # DeepSeek-V3.2
        tokens = (1, 64) if phase == "decode" else (4096,)
        return [{"T": t, "E": 256, "top_k": 8, "hidden": 7168, "I": 2048, "n_group": 8, "topk_group": 4}
                for t in tokens]
    return [{"T": 3 if phase == "decode" else 6, "E": 6, "top_k": 2, "hidden": 64, "I": 32, "n_group": 3,
             "topk_group": 2}]


PATH = registry.register(registry.KernelSpec(
    name="moe_path",
    phases=("decode", "prefill"),
    space={"path": ("fused", "workspace")},
    default=_default,
    fixed_dims=("E", "top_k", "hidden", "I"),
    bucketed_dims=("T",),
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_layer,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=bf16_layer,
    baseline_name="torch layer, cuBLAS bf16 mm per active expert (pre-dequantized)",
    source_modules=(sys.modules[__name__], activation, fused_moe, permute, routing_kernel, permute_kernel),
))
