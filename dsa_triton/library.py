"""What the PyTorch custom ops under ``torch.ops.dsa`` (``torch.library.custom_op``) share.

``torch.ops.dsa.<op>`` is what a compiled graph or a serving engine calls: the dispatcher sees each op as one node
with a fake implementation (exact output shapes and dtypes, no kernel), so ``torch.compile(fullgraph=True)`` traces
through it and ``torch.library.opcheck`` passes. ``dt.<op>`` stays the documented Python API: it does not go
through the dispatcher, and its eager path is unchanged. Each custom op calls its ``dt`` function.

Each op's module registers its custom ops beside the op (``<op>_op`` and its fake, ``<op>_out`` where there is one)
with :func:`dsa_op`, which records them in :data:`OPS`; ``import dsa_triton`` imports every op module. This module
holds what they share and imports no op.

How arguments map (a custom op takes tensors, ints, floats, bools, strings, dtypes and lists of them):

- ``config`` (a dict of launch parameters) becomes an optional JSON string, e.g. ``'{"path": "fused"}'``;
  None reads the tuning database, as ``dt`` does;
- a class argument becomes its tensors and numbers: ``RoutingConfig`` -> ``mode, top_k, n_group, topk_group,
  norm_topk_prob, routed_scaling_factor`` (:func:`routing_kwargs`); ``ExpertSort`` -> the three tensors the GEMM
  reads (``expert_offsets, sorted_token, sorted_expert``) and ``top_k``; ``PagedCache`` -> its tensors; the
  workspace of :func:`dt.fp8_grouped_gemm` is the shared one (the op has no ``workspace`` argument);
- an output whose size depends on values is sized by an argument that ``dt`` makes optional and the op requires:
  ``indexer_logits(num_cols)`` and ``block_scores(num_cols)`` (``dt``'s default ``max(limits)``, rounded up to
  pages for the bounds, is a device read), ``block_indexer_logits(max_len)`` (the bounds are
  ``[T, ceil(max_len / P)]``). Every other output size follows from shapes and integer arguments;
- ops that write into given tensors declare them (``mutates_args``) and return nothing but what is new:
  ``append_tokens`` (the four cache tensors), ``mxfp4_to_fp8_out`` (``w_out``, ``s_out``; it returns the unfit count),
  ``fp8_grouped_gemm`` (``unfit_counter``), and the ``<op>_out`` form of every op whose output a caller would
  preallocate (``out``; ``dt``'s ``out=``): ``indexer_logits_out``, ``block_scores_out``, ``select_pages_out``,
  ``topk_indices_out``, ``mxfp4_dequantize_out``, ``fp8_grouped_gemm_out``, ``fused_moe_gemm_out``, ``swiglu_out``,
  ``moe_forward_out``, ``fp8_blockwise_linear_out``. A custom op cannot return an alias of an input, so these
  return nothing; ``out``'s shape gives the sizes the plain op takes as arguments (``num_cols``), its dtype the
  output dtype (``dtype``, ``out_dtype``);
- ``block_indexer_logits`` always returns ``(logits, positions, bounds)`` (``dt``'s ``return_bounds=True``);
  ``mxfp4_to_fp8`` returns its unfit count as an int32 ``[1]`` tensor (``dt`` returns a Python int, a host read).

The one switch, ``check_values`` (every op takes it, last but ``config``):

- ``True`` (the default): inputs are validated, values included; a bad input raises ``ValueError`` naming the
  argument before any launch. Value checks read the device on the host (a sync, usually one transfer), so a call
  with checks on cannot be captured in a CUDA graph. Non-finite inputs are rejected where an op checks them
  (``mxfp4_quantize``; a 0xFF MXFP4 scale in the MXFP4 ops).
- ``False``: the caller promises valid input. The op reads nothing on the host, touches no file after its first
  call for a shape (launch configs are resolved once and kept in memory) and allocates only its outputs and
  scratch with the caching allocator, which a CUDA graph capture records: warm it up once eagerly for each
  shape, then capture. Invalid input is not detected (indices out of range are skipped where the kernels can tell,
  never read out of bounds); non-finite input propagates (NaN in, NaN out).

  Exceptions, where the op's path itself needs the host: ``fp8_grouped_gemm`` and ``moe_forward``'s grouped-GEMM
  ("workspace") path read the expert offsets on the host unless the config takes the registers route and every
  expert fits it (tiles planned on the device); ``fused_moe_gemm`` (and ``moe_forward``'s fused path) reads each
  scales tensor's range once, on its first call per tensor and in-place version. Warm-up calls do both before a
  capture. An op whose reads no config alone avoids declares them where it registers (:data:`HOST_READS`).

Ops with no value checks of their own (``select_pages``, ``route_topk``, ``swiglu``, ``moe_forward``) take the
switch for uniformity; it changes nothing for them. ``fused_moe_gemm`` checks the sort's values when it is on
(offsets rising within the rows, tokens and experts in range: one transfer).
"""
import functools
import json
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

NAMESPACE = "dsa"

OPS: dict = {}
"""Every registered op by name (``torch.ops.dsa.<name>``), recorded by :func:`dsa_op` as the op modules load."""

HOST_READS: dict[str, str] = {}
"""The ops that may read device values on the host even with ``check_values=False`` and warm, where no config alone
avoids it, each with what it reads and when (declared with :func:`dsa_op`)."""


def dsa_op(name: str, mutates_args: tuple = (), host_reads: str = ""):
    """A decorator registering its function as ``torch.ops.dsa.<name>`` (the schema from its annotations; the
    tensors it writes in ``mutates_args``) and recording it in :data:`OPS` (and ``host_reads`` in
    :data:`HOST_READS`)."""
    def register(fn):
        registered = custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)
        OPS[name] = getattr(torch.ops.dsa, name)
        if host_reads:
            HOST_READS[name] = host_reads
        return registered
    return register


@functools.lru_cache(maxsize=256)
def _parsed_config(config: str) -> tuple:
    try:
        parsed = json.loads(config)
    except json.JSONDecodeError as e:
        raise ValueError(f"config: not valid JSON ({e}): {config!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"config: expected a JSON object of launch parameters, got {config!r}")
    return tuple(parsed.items())


def op_config(config: Optional[str]) -> Optional[dict]:
    """The ``dt`` config of an op's JSON ``config`` string (parsed once per string; a fresh dict each call)."""
    return None if config is None else dict(_parsed_config(config))


def config_json(config: Optional[dict]) -> Optional[str]:
    """A ``dt`` config dict as the ``config`` string argument of a ``torch.ops.dsa`` op."""
    return None if config is None else json.dumps(config, sort_keys=True)


def routing_kwargs(routing, mode_name: str = "mode") -> dict:
    """The ``route_topk`` / ``moe_forward`` op arguments of a :class:`~dsa_triton.RoutingConfig` (``moe_forward_out``
    names the mode ``routing_mode``: pass ``mode_name="routing_mode"``)."""
    return {mode_name: routing.mode, "top_k": routing.top_k, "n_group": routing.n_group,
            "topk_group": routing.topk_group, "norm_topk_prob": routing.norm_topk_prob,
            "routed_scaling_factor": float(routing.routed_scaling_factor)}


def out_cols(out: Tensor) -> Optional[int]:
    """The ``num_cols`` of an ``out`` argument (None for one that is not 2-D: ``dt``'s check then names it)."""
    return out.shape[1] if out.dim() == 2 else None
