"""Online MXFP4 -> FP8 conversion: ``dt.mxfp4_to_fp8``, and the launcher the prefill GEMM pipelines.

Semantics and oracle: :mod:`.mxfp4_to_fp8_reference`; the kernel and its register-side helpers:
:mod:`.mxfp4_to_fp8_kernels`. Launch configs: :data:`LAUNCH` (``BLOCK_N`` rows x ``GROUPS`` 128-k groups per program,
``num_warps``).
:func:`row_references` picks each weight row's reference exponent and the experts whose every block is within
reach of it (the prefill GEMM's registers route and row-scaled workspace route take those).
"""
from __future__ import annotations

import math
import weakref

import torch

from ..checks import check_kernel_device, check_tensor
from ..hostmath import cdiv
from ..launch import launch_with
from ..library import dsa_op, op_config
from ..plans import cached
from ..registry import LaunchSpace
from .formats import BLOCK, BLOCKS_PER_GROUP, GROUP, SCALE_NAN, check_no_nan_scale, n_groups, validate_mxfp4
from .mxfp4_to_fp8_kernels import _convert_kernel


def _default(phase, shape):
    if shape["G"] * shape["N"] * shape["K"] >= 2**22:
        return {"BLOCK_N": 32, "GROUPS": 2, "num_warps": 4}
    return {"BLOCK_N": 64, "GROUPS": 2, "num_warps": 4}  # interpreter-sized: few, large programs


LAUNCH = LaunchSpace(
    name="mxfp4_to_fp8",
    phases=("prefill",),
    space={"BLOCK_N": (4, 8, 16, 32, 64), "GROUPS": (1, 2, 4, 8), "num_warps": (1, 2, 4, 8)},
    default=_default,
    fixed_dims=("N", "K"),
    bucketed_dims=("G",),  # experts converted per call
    constraint=lambda c, shape: "tile over 16384 values" if c["BLOCK_N"] * c["GROUPS"] * GROUP > 16384 else None,
)


@cached
def _convert_meta(block_n: int, groups: int, count_unfit: bool, row_ref: bool, ptx: bool, num_warps: int) -> dict:
    return dict(BLOCK_N=block_n, GROUPS=groups, COUNT_UNFIT=count_unfit, ROW_REF=row_ref, PTX=ptx,
                num_warps=num_warps)


def convert_experts(blocks: torch.Tensor, scales: torch.Tensor, expert_ids: torch.Tensor, w_out: torch.Tensor,
                    s_out: torch.Tensor, unfit: torch.Tensor | None, config: dict,
                    row_ref: torch.Tensor | None = None) -> None:
    """Launch only (arguments already checked): experts ``expert_ids[j]`` of ``blocks[E, N, K/32, 16]`` into
    ``w_out[j]`` ([G, N, K] e4m3, rows contiguous) and ``s_out[j]`` ([G, N, ceil(K/128)] fp32, any strides); adds the
    count of unfit blocks to ``unfit`` (int32 [1]) when given. ``row_ref`` (uint8 ``[E, N]``, from
    :func:`row_references`): every group of a row takes the row's reference instead of its own top block, so the
    row's group scales are all equal (exact for experts that ``fits``). Enqueued on the current stream.
    """
    n, kb = blocks.shape[1], blocks.shape[2]
    count = expert_ids.numel()
    if count == 0 or n == 0:
        return
    groups = config["GROUPS"]
    grid = (count, cdiv(n, config["BLOCK_N"]), cdiv(kb, groups * BLOCKS_PER_GROUP))
    pairs, words = blocks.view(torch.int32), w_out.view(torch.int32)  # [E, N, K/32, 4], [G, N, K/4]
    refs = scales if row_ref is None else row_ref  # (any tensor when unused)
    meta = _convert_meta(config["BLOCK_N"], groups, unfit is not None, row_ref is not None,
                         blocks.device.type == "cuda" and torch.version.hip is None, config["num_warps"])
    launch_with(
        _convert_kernel, grid, meta,
        pairs, scales, expert_ids, refs, words, s_out, unfit if unfit is not None else expert_ids, n, kb,
        s_out.shape[2], pairs.stride(0), pairs.stride(1), scales.stride(0), scales.stride(1), refs.stride(0),
        words.stride(0), words.stride(1), s_out.stride(0), s_out.stride(1), s_out.stride(2),
    )


FAST_SHIFT = 11  # binades below the reference within which every E2M1 value is a normal e4m3 number

_facts: dict[int, tuple] = {}  # id(scales) -> (weakref to it, version, ref, fits, has a 0xFF)


def _scale_facts(scales: torch.Tensor) -> tuple[torch.Tensor, list[bool], bool]:
    """``(ref, fits, any 0xFF)`` of ``scales[E, N, K/32]``, read once per tensor and in-place version (one sync)."""
    key = id(scales)
    hit = _facts.get(key)
    if hit is not None and hit[0]() is scales and hit[1] == scales._version:
        return hit[2:]
    ref = scales.amax(-1)
    fits = ((ref - scales.amin(-1)) <= FAST_SHIFT).all(-1)
    host = torch.cat([fits, (ref == SCALE_NAN).any().view(1)]).tolist()  # a 0xFF is its row's largest byte
    facts = (ref, host[:-1], host[-1])
    _facts[key] = (weakref.ref(scales, lambda _, key=key: _facts.pop(key, None)), scales._version, *facts)
    return facts


def row_references(scales: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """``scales[E, N, K/32]`` -> ``(ref uint8 [E, N], fits)``: each row's largest block scale, and per expert whether
    every block of every row lies within :data:`FAST_SHIFT` binades of its row's (so the fused GEMM converts it in
    registers with one table per block and no per-group rescaling). Cached per tensor (until it is modified in
    place or freed); the first call per weight reads the scales once and syncs."""
    ref, fits, _ = _scale_facts(scales)
    return ref, fits


def check_scales(label: str, scales: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``label`` and the first 0xFF (NaN) block of ``scales[E, N, K/32]``; the scan is
    :func:`row_references`'s (cached per tensor and version: the first call per weight syncs once)."""
    if _scale_facts(scales)[2]:
        check_no_nan_scale(label, scales)


def check_experts_layout(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """``blocks[E, N, K/32, 16]`` / ``scales[E, N, K/32]`` with each block row's bytes contiguous (any E, N strides)
    and ``blocks`` 4-byte aligned (the kernel reads it as int32 words); a ``K/32`` of 1 takes scales of any stride."""
    if blocks.stride(-1) != 1 or blocks.stride(-2) != 16 or (scales.stride(-1) != 1 and scales.shape[-1] > 1):
        raise ValueError(f"{name}_blocks / {name}_scales: the last dimensions must be contiguous, got strides "
                         f"{blocks.stride()} and {scales.stride()}")
    if blocks.data_ptr() % 4 or any(st % 4 for st in blocks.stride()[:-2]):
        raise ValueError(f"{name}_blocks: must be 4-byte aligned with strides in multiples of 4, got offset "
                         f"{blocks.storage_offset()} and strides {blocks.stride()}")


def mxfp4_to_fp8(blocks: torch.Tensor, scales: torch.Tensor,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, *, name: str = "mxfp4",
                 config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Convert MXFP4 ``blocks[..., N, K/32, 16]`` / ``scales[..., N, K/32]`` (uint8) to FP8.

    Returns ``(w float8_e4m3fn [..., N, K], scale fp32 [..., N, ceil(K/128)], n_unfit)`` with
    ``w * scale`` (scale repeated over each 128-k group) equal to the MXFP4 values in every block that
    fits; ``n_unfit`` counts the blocks that do not (too far below their group's top block, see
    :mod:`.mxfp4_to_fp8_reference`). ``out`` = ``(w, scale)`` writes into given tensors, e.g. a workspace slot
    (``FP8Workspace`` lease views). Reading ``n_unfit`` syncs the device. ``config``: an ``mxfp4_to_fp8`` config
    (None: the tuning database's), validated (:class:`~dsa_triton.ConfigError`).
    """
    validate_mxfp4(name, blocks, scales)
    device = check_kernel_device(f"{name}_blocks", blocks)
    lead, n, kb = tuple(blocks.shape[:-3]), blocks.shape[-3], blocks.shape[-2]
    k, ng = kb * BLOCK, n_groups(kb * BLOCK)
    experts = math.prod(lead)  # not -1: reshape cannot infer it when a dimension is 0
    shape = {"G": experts, "N": n, "K": k}
    config = LAUNCH.launch_config("prefill", shape, device) if config is None else LAUNCH.validate(config, shape)
    blocks3, scales3 = blocks.reshape(experts, n, kb, 16), scales.reshape(experts, n, kb)
    check_experts_layout(name, blocks3, scales3)
    if out is None:
        w = torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(*lead, n, ng, dtype=torch.float32, device=device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError("out: expected a (w, scale) pair")
        w = check_tensor("out[0]", out[0], dtype=torch.float8_e4m3fn, shape=(*lead, n, k), device=device)
        s = check_tensor("out[1]", out[1], dtype=torch.float32, shape=(*lead, n, ng), device=device,
                         contiguous_last=False)
        if w.data_ptr() % 4 or any(st % 4 for st in w.stride()[:-1]):
            raise ValueError(f"out[0]: must be 4-byte aligned with strides in multiples of 4, got {w.stride()}")
    try:
        w3, s3 = w.view(experts, n, k), s.view(experts, n, ng)
    except RuntimeError:
        raise ValueError(f"out: must be viewable as [E, N, K] / [E, N, G], got strides {w.stride()}, {s.stride()}") from None
    if w.numel() == 0:
        return w, s, 0
    return w, s, int(convert_all(blocks3, scales3, w3, s3, config).item())


def convert_all(blocks: torch.Tensor, scales: torch.Tensor, w: torch.Tensor, s: torch.Tensor, config: dict
                ) -> torch.Tensor:
    """Every expert of ``blocks[E, N, K/32, 16]`` into ``w[E, N, K]`` / ``s[E, N, G]``, launch only (no checks, no
    sync: the registry times this); returns the unfit count as an int32 ``[1]`` tensor."""
    unfit = torch.zeros(1, dtype=torch.int32, device=blocks.device)
    ids = torch.arange(blocks.shape[0], dtype=torch.int32, device=blocks.device)
    convert_experts(blocks, scales, ids, w, s, unfit, config)
    return unfit


def conversion_config(experts: int, n: int, k: int, device: torch.device) -> dict:
    """The conversion's launch config for ``experts`` matrices of ``[n, k]`` (the tuning database's, else the
    default): what :func:`convert_experts` is given by the callers that pipeline it."""
    return LAUNCH.launch_config("prefill", {"G": experts, "N": n, "K": k}, device)


# -- as custom ops under torch.ops.dsa (dsa_triton.library) ------------------------------------------------------------

def _fp8_shapes(blocks: torch.Tensor) -> tuple[tuple, tuple]:
    """The ``(w, scale)`` shapes of :func:`dt.mxfp4_to_fp8`: ``[..., N, K]`` and ``[..., N, ceil(K / 128)]``."""
    k = blocks.shape[-2] * BLOCK
    return (*blocks.shape[:-2], k), (*blocks.shape[:-2], n_groups(k))


def _to_fp8(blocks, scales, w, s, check_values, config) -> torch.Tensor:
    """Convert into ``w`` / ``s``; the unfit count as an int32 ``[1]`` tensor (read on the host only when checking)."""
    if check_values:
        return torch.tensor([mxfp4_to_fp8(blocks, scales, (w, s), config=op_config(config))[2]], dtype=torch.int32,
                            device=w.device)
    experts, n, kb = math.prod(blocks.shape[:-3]), blocks.shape[-3], blocks.shape[-2]
    if w.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=w.device)
    config = op_config(config) or conversion_config(experts, n, kb * BLOCK, blocks.device)
    return convert_all(blocks.reshape(experts, n, kb, 16), scales.reshape(experts, n, kb),
                       w.view(experts, n, kb * BLOCK), s.view(experts, n, -1), config)


@dsa_op("mxfp4_to_fp8")
def mxfp4_to_fp8_op(blocks: torch.Tensor, scales: torch.Tensor, check_values: bool = True,
                    config: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dt.mxfp4_to_fp8`: ``(w float8_e4m3fn [..., N, K], scale fp32 [..., N, ceil(K/128)], n_unfit int32
    [1])``. ``check_values=False`` skips the checks and the 0xFF scan and leaves the count on the device."""
    w_shape, s_shape = _fp8_shapes(blocks)
    w = torch.empty(w_shape, dtype=torch.float8_e4m3fn, device=blocks.device)
    s = torch.empty(s_shape, dtype=torch.float32, device=blocks.device)
    return w, s, _to_fp8(blocks, scales, w, s, check_values, config)


@mxfp4_to_fp8_op.register_fake
def _(blocks, scales, check_values=True, config=None):
    w_shape, s_shape = _fp8_shapes(blocks)
    return (blocks.new_empty(w_shape, dtype=torch.float8_e4m3fn), blocks.new_empty(s_shape, dtype=torch.float32),
            blocks.new_empty((1,), dtype=torch.int32))


@dsa_op("mxfp4_to_fp8_out", mutates_args=("w_out", "s_out"))
def mxfp4_to_fp8_out(blocks: torch.Tensor, scales: torch.Tensor, w_out: torch.Tensor, s_out: torch.Tensor,
                     check_values: bool = True, config: str | None = None) -> torch.Tensor:
    """:func:`dt.mxfp4_to_fp8` into given tensors (e.g. a workspace slot): returns the unfit count, int32 ``[1]``."""
    return _to_fp8(blocks, scales, w_out, s_out, check_values, config)


@mxfp4_to_fp8_out.register_fake
def _(blocks, scales, w_out, s_out, check_values=True, config=None):
    return blocks.new_empty((1,), dtype=torch.int32)
