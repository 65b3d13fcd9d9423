"""Every public op as a PyTorch custom op under ``torch.ops.dsa`` (``torch.library.custom_op``).

``torch.ops.dsa.<op>`` is what a compiled graph or a serving engine calls: the dispatcher sees each op as one node
with a fake implementation (exact output shapes and dtypes, no kernel), so ``torch.compile(fullgraph=True)`` traces
through it and ``torch.library.opcheck`` passes. ``dt.<op>`` stays the documented Python API: it does not go
through the dispatcher, and its eager path is unchanged. Each custom op calls its ``dt`` function.

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
  capture.

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

from .attention.append_tokens import append_tokens
from .attention.block_indexer_logits import block_indexer_logits, block_scores
from .attention.indexer_logits import indexer_logits
from .attention.select_pages import select_pages
from .attention.sparse_attention import sparse_attention_decode, sparse_attention_prefill
from .attention.topk_indices import topk_indices
from .checks import check_tensor
from .hostmath import cdiv
from .linear.fp8_blockwise_linear import fp8_blockwise_linear
from .moe.activation import swiglu
from .moe.fp8_grouped_gemm import fp8_grouped_gemm
from .moe.fused_moe_gemm import fused_moe_gemm
from .moe.moe_forward import moe_forward
from .moe.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .moe.mxfp4_to_fp8 import mxfp4_to_fp8
from .moe.permute import ExpertSort
from .moe.route_topk import route_topk
from .moe.routing import RoutingConfig
# the launch-only entry points of the load-time MXFP4 ops (what their registry entries time): check_values=False
from .moe.mxfp4 import DEQUANTIZE, QUANTIZE, dequantize_launch, quantize_launch
from .moe.mxfp4_to_fp8 import conversion_config, convert_all

NAMESPACE = "dsa"


def _op(name: str, mutates_args: tuple = ()):
    return custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


@functools.lru_cache(maxsize=256)
def _parsed_config(config: str) -> tuple:
    try:
        parsed = json.loads(config)
    except json.JSONDecodeError as e:
        raise ValueError(f"config: not valid JSON ({e}): {config!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"config: expected a JSON object of launch parameters, got {config!r}")
    return tuple(parsed.items())


def _config(config: Optional[str]) -> Optional[dict]:
    """The ``dt`` config of an op's JSON ``config`` string (parsed once per string; a fresh dict each call)."""
    return None if config is None else dict(_parsed_config(config))


def config_json(config: Optional[dict]) -> Optional[str]:
    """A ``dt`` config dict as the ``config`` string argument of a ``torch.ops.dsa`` op."""
    return None if config is None else json.dumps(config, sort_keys=True)


def routing_kwargs(routing: RoutingConfig, mode_name: str = "mode") -> dict:
    """The ``route_topk`` / ``moe_forward`` op arguments of a :class:`~dsa_triton.RoutingConfig` (``moe_forward_out``
    names the mode ``routing_mode``: pass ``mode_name="routing_mode"``)."""
    return {mode_name: routing.mode, "top_k": routing.top_k, "n_group": routing.n_group,
            "topk_group": routing.topk_group, "norm_topk_prob": routing.norm_topk_prob,
            "routed_scaling_factor": float(routing.routed_scaling_factor)}


# -- attention ----------------------------------------------------------------------------------------------------

@_op("append_tokens", mutates_args=("kv_cache", "ik", "ik_scale", "summaries"))
def append_tokens_op(kv_cache: Optional[Tensor], ik: Optional[Tensor], ik_scale: Optional[Tensor],
                     summaries: Optional[Tensor], kv: Optional[Tensor], index_k: Optional[Tensor], items: Tensor,
                     check_values: bool = True, config: Optional[str] = None, rope_dim: int = 64) -> None:
    """:func:`dt.append_tokens`: new tokens ``kv[N, D]`` / ``index_k[N, DK]`` into the paged caches, in place
    (``rope_dim``: the rope values of rows into an FP8 cache).

    ``items[n, 4]`` int32 = (first source row, token count, physical page, first slot in the page), one per touched
    page, pages distinct. A decode step of ``B`` sequences at logical positions ``pos[B]`` is
    ``items = stack([arange(B), ones(B), block_table[b, pos // P], pos % P], 1)``: device ops, capturable. The block
    table and the lengths are the caller's (the op does not update them)."""
    append_tokens(kv_cache, ik, ik_scale, summaries, kv, index_k, items, config=_config(config),
                  check_values=check_values, rope_dim=rope_dim)


@append_tokens_op.register_fake
def _(kv_cache, ik, ik_scale, summaries, kv, index_k, items, check_values=True, config=None, rope_dim=64):
    return None


@_op("indexer_logits")
def indexer_logits_op(q: Tensor, weights: Tensor, k: Tensor, k_scale: Tensor, limits: Tensor, num_cols: int,
                      cu_seqlens_q: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                      seq_lens: Optional[Tensor] = None, key_starts: Optional[Tensor] = None,
                      max_q: Optional[int] = None, check_values: bool = True, config: Optional[str] = None) -> Tensor:
    """:func:`dt.indexer_logits`: ``[T, num_cols]`` fp32. ``num_cols`` is required (``dt``'s default reads
    ``max(limits)``); with ``check_values=False`` give ``max_q`` too when ``cu_seqlens_q`` is given."""
    return indexer_logits(q, weights, k, k_scale, limits, cu_seqlens_q=cu_seqlens_q, block_table=block_table,
                          seq_lens=seq_lens, key_starts=key_starts, num_cols=num_cols, max_q=max_q,
                          check_values=check_values, config=_config(config))


@indexer_logits_op.register_fake
def _(q, weights, k, k_scale, limits, num_cols, *args, **kwargs):
    return q.new_empty((q.shape[0], num_cols), dtype=torch.float32)


def _cols(out: Tensor) -> Optional[int]:
    """The ``num_cols`` of an ``out`` argument (None for one that is not 2-D: ``dt``'s check then names it)."""
    return out.shape[1] if out.dim() == 2 else None


@_op("indexer_logits_out", mutates_args=("out",))
def indexer_logits_out(q: Tensor, weights: Tensor, k: Tensor, k_scale: Tensor, limits: Tensor, out: Tensor,
                       cu_seqlens_q: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                       seq_lens: Optional[Tensor] = None, key_starts: Optional[Tensor] = None,
                       max_q: Optional[int] = None, check_values: bool = True, config: Optional[str] = None) -> None:
    """:func:`dt.indexer_logits` into ``out[T, num_cols]`` fp32 (contiguous; ``num_cols`` is its width)."""
    indexer_logits(q, weights, k, k_scale, limits, cu_seqlens_q=cu_seqlens_q, block_table=block_table,
                   seq_lens=seq_lens, key_starts=key_starts, num_cols=_cols(out), max_q=max_q,
                   check_values=check_values, config=_config(config), out=out)


@indexer_logits_out.register_fake
def _(q, weights, k, k_scale, limits, out, *args, **kwargs):
    return None


@_op("block_scores")
def block_scores_op(q: Tensor, weights: Tensor, pmax: Tensor, pmin: Tensor, block_table: Tensor, seq_lens: Tensor,
                    limits: Tensor, page_size: int, num_cols: int, cu_seqlens_q: Optional[Tensor] = None,
                    max_q: Optional[int] = None, check_values: bool = True, config: Optional[str] = None) -> Tensor:
    """:func:`dt.block_scores`: page upper bounds ``[T, num_cols]`` fp32; ``num_cols`` (pages) is required."""
    return block_scores(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, cu_seqlens_q=cu_seqlens_q,
                        num_cols=num_cols, max_q=max_q, check_values=check_values, config=_config(config))


@block_scores_op.register_fake
def _(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, num_cols, *args, **kwargs):
    return q.new_empty((q.shape[0], num_cols), dtype=torch.float32)


@_op("block_scores_out", mutates_args=("out",))
def block_scores_out(q: Tensor, weights: Tensor, pmax: Tensor, pmin: Tensor, block_table: Tensor, seq_lens: Tensor,
                     limits: Tensor, page_size: int, out: Tensor, cu_seqlens_q: Optional[Tensor] = None,
                     max_q: Optional[int] = None, check_values: bool = True, config: Optional[str] = None) -> None:
    """:func:`dt.block_scores` into ``out[T, num_cols]`` fp32 (contiguous; ``num_cols`` pages is its width)."""
    block_scores(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, cu_seqlens_q=cu_seqlens_q,
                 num_cols=_cols(out), max_q=max_q, check_values=check_values, config=_config(config), out=out)


@block_scores_out.register_fake
def _(q, weights, pmax, pmin, block_table, seq_lens, limits, page_size, out, *args, **kwargs):
    return None


@_op("select_pages")
def select_pages_op(bounds: Tensor, n_select: int, check_values: bool = True, config: Optional[str] = None) -> Tensor:
    """:func:`dt.select_pages`: ``[T, n_select]`` int32 logical pages, ascending, -1 padded."""
    return select_pages(bounds, n_select, config=_config(config))


@select_pages_op.register_fake
def _(bounds, n_select, check_values=True, config=None):
    return bounds.new_empty((bounds.shape[0], n_select), dtype=torch.int32)


@_op("select_pages_out", mutates_args=("out",))
def select_pages_out(bounds: Tensor, n_select: int, out: Tensor, check_values: bool = True,
                     config: Optional[str] = None) -> None:
    """:func:`dt.select_pages` into ``out[T, n_select]`` int32 (contiguous)."""
    select_pages(bounds, n_select, config=_config(config), out=out)


@select_pages_out.register_fake
def _(bounds, n_select, out, check_values=True, config=None):
    return None


@_op("block_indexer_logits")
def block_indexer_logits_op(q: Tensor, weights: Tensor, k: Tensor, k_scale: Tensor, pmax: Tensor, pmin: Tensor,
                            block_table: Tensor, seq_lens: Tensor, limits: Tensor, n_select: int, max_len: int,
                            cu_seqlens_q: Optional[Tensor] = None, max_q: Optional[int] = None,
                            check_values: bool = True, config: Optional[str] = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`dt.block_indexer_logits` with its bounds: ``(logits [T, n_select * P] fp32, positions
    [T, n_select * P] int32, bounds [T, ceil(max_len / P)] fp32)``; ``max_len`` (at least ``max(limits)``) is
    required."""
    return block_indexer_logits(q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits, n_select,
                                cu_seqlens_q=cu_seqlens_q, max_len=max_len, max_q=max_q, check_values=check_values,
                                config=_config(config), return_bounds=True)


@block_indexer_logits_op.register_fake
def _(q, weights, k, k_scale, pmax, pmin, block_table, seq_lens, limits, n_select, max_len, *args, **kwargs):
    T, P = q.shape[0], k.shape[1]
    logits = q.new_empty((T, n_select * P), dtype=torch.float32)
    return logits, q.new_empty((T, n_select * P), dtype=torch.int32), q.new_empty((T, cdiv(max_len, P)),
                                                                                  dtype=torch.float32)


def _topk(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, check_values, config, out):
    return topk_indices(scores, k, lengths, block_table=block_table, page_size=page_size, row_to_seq=row_to_seq,
                        num_pages=num_pages, check_values=check_values, config=_config(config), out=out)


@_op("topk_indices")
def topk_indices_op(scores: Tensor, k: int, lengths: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                    page_size: Optional[int] = None, row_to_seq: Optional[Tensor] = None,
                    num_pages: Optional[int] = None, check_values: bool = True,
                    config: Optional[str] = None) -> Tensor:
    """:func:`dt.topk_indices`: ``[T, k]`` int32 positions (physical slots with ``block_table``), -1 padded."""
    return _topk(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, check_values, config, None)


@topk_indices_op.register_fake
def _(scores, k, *args, **kwargs):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


@_op("topk_indices_out", mutates_args=("out",))
def topk_indices_out(scores: Tensor, k: int, out: Tensor, lengths: Optional[Tensor] = None,
                     block_table: Optional[Tensor] = None, page_size: Optional[int] = None,
                     row_to_seq: Optional[Tensor] = None, num_pages: Optional[int] = None, check_values: bool = True,
                     config: Optional[str] = None) -> None:
    """:func:`dt.topk_indices` into ``out[T, k]`` int32 (contiguous)."""
    _topk(scores, k, lengths, block_table, page_size, row_to_seq, num_pages, check_values, config, out)


@topk_indices_out.register_fake
def _(scores, k, out, *args, **kwargs):
    return None


def _attention_op(name: str, fn, doc: str):
    """The custom op of a sparse-attention function (decode and prefill take the same arguments; DeepSeek-V4's
    last, keyword-only in ``dt``: a custom op takes no keyword-only tensor)."""
    def op(q: Tensor, kv_cache: Tensor, indices: Tensor, sm_scale: float, d_v: int = 512,
           block_table: Optional[Tensor] = None, check_values: bool = True, config: Optional[str] = None,
           attn_sink: Optional[Tensor] = None, topk_length: Optional[Tensor] = None,
           extra_kv_cache: Optional[Tensor] = None, extra_indices: Optional[Tensor] = None,
           extra_topk_length: Optional[Tensor] = None,
           extra_block_table: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        return fn(q, kv_cache, indices, sm_scale, d_v, block_table, config=_config(config),
                  check_values=check_values, attn_sink=attn_sink, topk_length=topk_length,
                  extra_kv_cache=extra_kv_cache, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
                  extra_block_table=extra_block_table)

    op.__doc__ = doc
    registered = _op(name)(op)

    @registered.register_fake
    def _(q, kv_cache, indices, sm_scale, d_v=512, *args, **kwargs):
        rows = q.shape[:-1]  # [B, Hq], [B, S, Hq] (one index set per sequence or per token) or [T, Hq]
        return q.new_empty((*rows, d_v)), q.new_empty(rows, dtype=torch.float32)

    return registered


sparse_attention_decode_op = _attention_op("sparse_attention_decode", sparse_attention_decode, """\
:func:`dt.sparse_attention_decode`: ``(out [B, (S,) Hq, d_v] q's dtype, lse [B, (S,) Hq] fp32)``; with DeepSeek-V4's
sinks, lengths and second index set as keywords.""")
sparse_attention_prefill_op = _attention_op("sparse_attention_prefill", sparse_attention_prefill, """\
:func:`dt.sparse_attention_prefill`: ``(out [T, Hq, d_v] q's dtype, lse [T, Hq] fp32)``; with DeepSeek-V4's sinks,
lengths and second index set as keywords.""")


# -- MXFP4 --------------------------------------------------------------------------------------------------------

def _flat(lead: tuple, k: int) -> dict:
    n = 1
    for d in lead:
        n *= d
    return {"N": n, "K": k}


@_op("mxfp4_quantize")
def mxfp4_quantize_op(w: Tensor, check_values: bool = True, config: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """:func:`dt.mxfp4_quantize`: ``w[..., N, K]`` -> ``(blocks uint8 [..., N, K/32, 16], scales uint8
    [..., N, K/32])``. ``check_values=False`` skips the argument checks and the finiteness scan."""
    if check_values:
        return mxfp4_quantize(w, config=_config(config))
    return quantize_launch(w, _config(config) or QUANTIZE.launch_config("load", _flat(w.shape[:-1], w.shape[-1]), w.device))


@mxfp4_quantize_op.register_fake
def _(w, check_values=True, config=None):
    blocks = w.new_empty((*w.shape[:-1], w.shape[-1] // 32, 16), dtype=torch.uint8)
    return blocks, w.new_empty((*w.shape[:-1], w.shape[-1] // 32), dtype=torch.uint8)


@_op("mxfp4_dequantize")
def mxfp4_dequantize_op(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32,
                        check_values: bool = True, config: Optional[str] = None) -> Tensor:
    """:func:`dt.mxfp4_dequantize`: ``w[..., N, K]`` in ``dtype``. ``check_values=False`` skips the argument checks
    and the 0xFF (NaN) scale scan."""
    if check_values:
        return mxfp4_dequantize(blocks, scales, dtype, config=_config(config))
    shape = _flat(blocks.shape[:-2], blocks.shape[-2] * 32)
    return dequantize_launch(blocks, scales, dtype, _config(config) or DEQUANTIZE.launch_config("load", shape, blocks.device))


@mxfp4_dequantize_op.register_fake
def _(blocks, scales, dtype=torch.float32, check_values=True, config=None):
    return blocks.new_empty((*blocks.shape[:-2], blocks.shape[-2] * 32), dtype=dtype)


@_op("mxfp4_dequantize_out", mutates_args=("out",))
def mxfp4_dequantize_out(blocks: Tensor, scales: Tensor, out: Tensor, check_values: bool = True,
                         config: Optional[str] = None) -> None:
    """:func:`dt.mxfp4_dequantize` into ``out[..., N, K]`` (contiguous; its dtype, fp32/bf16/fp16, is the output's).
    ``check_values=False`` skips the argument checks (``out``'s are kept) and the 0xFF (NaN) scale scan."""
    check_tensor("out", out, dtype=(torch.float32, torch.bfloat16, torch.float16), contiguous_last=False)
    if check_values:
        mxfp4_dequantize(blocks, scales, out.dtype, config=_config(config), out=out)
        return
    shape = _flat(blocks.shape[:-2], blocks.shape[-2] * 32)
    dequantize_launch(blocks, scales, out.dtype, _config(config) or DEQUANTIZE.launch_config("load", shape, blocks.device),
                      out)


@mxfp4_dequantize_out.register_fake
def _(blocks, scales, out, check_values=True, config=None):
    return None


def _fp8_shapes(blocks: Tensor) -> tuple[tuple, tuple]:
    """The ``(w, scale)`` shapes of :func:`dt.mxfp4_to_fp8`: ``[..., N, K]`` and ``[..., N, ceil(K / 128)]``."""
    k = blocks.shape[-2] * 32
    return (*blocks.shape[:-2], k), (*blocks.shape[:-2], cdiv(k, 128))


def _to_fp8(blocks, scales, w, s, check_values, config) -> Tensor:
    """Convert into ``w`` / ``s``; the unfit count as an int32 ``[1]`` tensor (read on the host only when checking)."""
    if check_values:
        return torch.tensor([mxfp4_to_fp8(blocks, scales, (w, s), config=_config(config))[2]], dtype=torch.int32,
                            device=w.device)
    lead, n, kb = blocks.shape[:-3], blocks.shape[-3], blocks.shape[-2]
    experts = 1
    for d in lead:
        experts *= d
    if w.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=w.device)
    config = _config(config) or conversion_config(experts, n, 32 * kb, blocks.device)
    return convert_all(blocks.reshape(experts, n, kb, 16), scales.reshape(experts, n, kb),
                       w.view(experts, n, 32 * kb), s.view(experts, n, -1), config)


@_op("mxfp4_to_fp8")
def mxfp4_to_fp8_op(blocks: Tensor, scales: Tensor, check_values: bool = True,
                    config: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor]:
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


@_op("mxfp4_to_fp8_out", mutates_args=("w_out", "s_out"))
def mxfp4_to_fp8_out(blocks: Tensor, scales: Tensor, w_out: Tensor, s_out: Tensor, check_values: bool = True,
                     config: Optional[str] = None) -> Tensor:
    """:func:`dt.mxfp4_to_fp8` into given tensors (e.g. a workspace slot): returns the unfit count, int32 ``[1]``."""
    return _to_fp8(blocks, scales, w_out, s_out, check_values, config)


@mxfp4_to_fp8_out.register_fake
def _(blocks, scales, w_out, s_out, check_values=True, config=None):
    return blocks.new_empty((1,), dtype=torch.int32)


# -- MoE ----------------------------------------------------------------------------------------------------------

@_op("fp8_grouped_gemm", mutates_args=("unfit_counter",))
def fp8_grouped_gemm_op(x_sorted: Tensor, expert_offsets: Tensor, blocks: Tensor, scales: Tensor,
                        unfit_counter: Optional[Tensor] = None, check_values: bool = True,
                        config: Optional[str] = None) -> Tensor:
    """:func:`dt.fp8_grouped_gemm` on the shared workspace: ``y_sorted [M, N]`` in ``x_sorted``'s dtype;
    ``unfit_counter`` (int32 ``[1]``) is added to in place."""
    return fp8_grouped_gemm(x_sorted, expert_offsets, blocks, scales, config=_config(config),
                            unfit_counter=unfit_counter, check_values=check_values)


@fp8_grouped_gemm_op.register_fake
def _(x_sorted, expert_offsets, blocks, scales, *args, **kwargs):
    return x_sorted.new_empty((x_sorted.shape[0], blocks.shape[1]))


@_op("fp8_grouped_gemm_out", mutates_args=("out", "unfit_counter"))
def fp8_grouped_gemm_out(x_sorted: Tensor, expert_offsets: Tensor, blocks: Tensor, scales: Tensor, out: Tensor,
                         unfit_counter: Optional[Tensor] = None, check_values: bool = True,
                         config: Optional[str] = None) -> None:
    """:func:`dt.fp8_grouped_gemm` into ``out[M, N]`` in ``x_sorted``'s dtype (last dim contiguous)."""
    fp8_grouped_gemm(x_sorted, expert_offsets, blocks, scales, config=_config(config), unfit_counter=unfit_counter,
                     check_values=check_values, out=out)


@fp8_grouped_gemm_out.register_fake
def _(x_sorted, expert_offsets, blocks, scales, out, *args, **kwargs):
    return None


def _check_sort(x, expert_offsets, sorted_token, sorted_expert, blocks, top_k, gather_tokens, check_values) -> None:
    """The sort's tensors: metadata always; with ``check_values``, their values (one transfer)."""
    experts = blocks.shape[0]
    check_tensor("expert_offsets", expert_offsets, dtype=torch.int32, shape=(experts + 1,), device=x.device)
    rows = sorted_expert.shape[0] if sorted_expert.dim() == 1 else -1
    check_tensor("sorted_expert", sorted_expert, dtype=torch.int32, ndim=1, device=x.device)
    check_tensor("sorted_token", sorted_token, dtype=torch.int32, shape=(rows,), device=x.device)
    if type(top_k) is not int or top_k <= 0 or rows % top_k:
        raise ValueError(f"top_k: must be a positive integer dividing the {rows} sorted rows, got {top_k!r}")
    if check_values and rows:
        tokens = x.shape[0] if gather_tokens else rows // top_k
        offsets = expert_offsets.long()
        bad = torch.stack([(offsets[0] != 0) | (offsets[-1] != rows) | (offsets[1:] < offsets[:-1]).any(),
                           ((sorted_token < 0) | (sorted_token >= tokens)).any(),
                           ((sorted_expert < 0) | (sorted_expert >= experts)).any()]).tolist()
        for failed, message in zip(bad, (f"expert_offsets: must rise from 0 to the {rows} sorted rows",
                                          f"sorted_token: tokens must lie in [0, {tokens})",
                                          f"sorted_expert: experts must lie in [0, {experts})")):
            if failed:
                raise ValueError(message)


@_op("fused_moe_gemm")
def fused_moe_gemm_op(x: Tensor, expert_offsets: Tensor, sorted_token: Tensor, sorted_expert: Tensor, blocks: Tensor,
                      scales: Tensor, top_k: int, gather_tokens: bool = True, out_dtype: Optional[torch.dtype] = None,
                      check_values: bool = True, config: Optional[str] = None) -> Tensor:
    """:func:`dt.fused_moe_gemm`: ``y_sorted [M, N]`` in ``out_dtype`` (None: ``x``'s). The sort is given by the
    tensors the GEMM reads: ``expert_offsets [E + 1]``, ``sorted_token [M]``, ``sorted_expert [M]`` (int32, fields
    of ``ExpertSort``), and ``top_k`` (``M = T * top_k``)."""
    return _fused_moe(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens, out_dtype,
                      check_values, config, None)


def _fused_moe(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens, out_dtype,
               check_values, config, out):
    _check_sort(x, expert_offsets, sorted_token, sorted_expert, blocks, top_k, gather_tokens, check_values)
    unread = sorted_expert  # sorted_slot / slot_row / slot_weight: the GEMM reads only the row count of them
    sort = ExpertSort(blocks.shape[0], top_k, expert_offsets, unread, sorted_token, sorted_expert, unread, unread)
    return fused_moe_gemm(x, sort, blocks, scales, gather_tokens=gather_tokens, config=_config(config),
                          out_dtype=out_dtype, out=out)


@fused_moe_gemm_op.register_fake
def _(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens=True, out_dtype=None,
      *args, **kwargs):
    return x.new_empty((sorted_expert.shape[0], blocks.shape[1]), dtype=out_dtype or x.dtype)


@_op("fused_moe_gemm_out", mutates_args=("out",))
def fused_moe_gemm_out(x: Tensor, expert_offsets: Tensor, sorted_token: Tensor, sorted_expert: Tensor, blocks: Tensor,
                       scales: Tensor, top_k: int, out: Tensor, gather_tokens: bool = True, check_values: bool = True,
                       config: Optional[str] = None) -> None:
    """:func:`dt.fused_moe_gemm` into ``out[M, N]`` (last dim contiguous) in ``x``'s dtype or fp32 (the
    ``out_dtype``)."""
    check_tensor("out", out, dtype=(x.dtype, torch.float32), contiguous_last=False)
    _fused_moe(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, gather_tokens, out.dtype,
               check_values, config, out)


@fused_moe_gemm_out.register_fake
def _(x, expert_offsets, sorted_token, sorted_expert, blocks, scales, top_k, out, *args, **kwargs):
    return None


def _routing(mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor) -> RoutingConfig:
    return RoutingConfig(mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)


@_op("route_topk")
def route_topk_op(logits: Tensor, bias: Optional[Tensor] = None, mode: str = "deepseek", top_k: int = 8,
                  n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                  routed_scaling_factor: float = 1.0, check_values: bool = True,
                  config: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """:func:`dt.route_topk`: ``(weights [T, top_k] fp32, ids [T, top_k] int32)``; the routing fields as in
    :class:`~dsa_triton.RoutingConfig` (:func:`routing_kwargs`)."""
    routing = _routing(mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    return route_topk(logits, routing, bias, config=_config(config))


@route_topk_op.register_fake
def _(logits, bias=None, mode="deepseek", top_k=8, *args, **kwargs):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


@_op("swiglu")
def swiglu_op(h: Tensor, dtype: Optional[torch.dtype] = None, class_major: bool = False, check_values: bool = True,
              config: Optional[str] = None) -> Tensor:
    """:func:`dt.swiglu`: ``h[M, 2I]`` -> ``[M, I]`` (or ``[M, 4, I/4]`` class-major) in ``dtype`` (None: h's).
    A fixed-tile elementwise op: ``config`` is accepted and unused."""
    return swiglu(h, dtype, class_major)


@swiglu_op.register_fake
def _(h, dtype=None, class_major=False, check_values=True, config=None):
    inter = h.shape[1] // 2
    shape = (h.shape[0], 4, inter // 4) if class_major else (h.shape[0], inter)
    return h.new_empty(shape, dtype=dtype or h.dtype)


@_op("swiglu_out", mutates_args=("out",))
def swiglu_out(h: Tensor, out: Tensor, class_major: bool = False, check_values: bool = True,
               config: Optional[str] = None) -> None:
    """:func:`dt.swiglu` into ``out`` (``[M, I]``, or ``[M, 4, I/4]`` class-major; contiguous; its dtype is the
    output's)."""
    check_tensor("out", out, dtype=(torch.float32, torch.float16, torch.bfloat16), contiguous_last=False)
    swiglu(h, out.dtype, class_major, out=out)


@swiglu_out.register_fake
def _(h, out, class_major=False, check_values=True, config=None):
    return None


@_op("moe_forward")
def moe_forward_op(x: Tensor, router_weight: Tensor, gate_up_blocks: Tensor, gate_up_scales: Tensor,
                   down_blocks: Tensor, down_scales: Tensor, router_bias: Optional[Tensor] = None,
                   shared_gate_up: Optional[Tensor] = None, shared_down: Optional[Tensor] = None,
                   mode: str = "deepseek", top_k: int = 8, n_group: int = 1, topk_group: int = 1,
                   norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, phase: Optional[str] = None,
                   check_values: bool = True, config: Optional[str] = None) -> Tensor:
    """:func:`dt.moe_forward`: ``y[T, H]`` in ``x``'s dtype; the routing fields as in :class:`~dsa_triton.RoutingConfig`
    (:func:`routing_kwargs`), ``config`` a ``moe_forward`` config such as ``'{"path": "fused"}'``."""
    routing = _routing(mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    return moe_forward(x, router_weight, gate_up_blocks, gate_up_scales, down_blocks, down_scales, routing=routing,
                       router_bias=router_bias, shared_gate_up=shared_gate_up, shared_down=shared_down, phase=phase,
                       config=_config(config))


@moe_forward_op.register_fake
def _(x, *args, **kwargs):
    return x.new_empty(x.shape)


@_op("moe_forward_out", mutates_args=("out",))
def moe_forward_out(x: Tensor, router_weight: Tensor, gate_up_blocks: Tensor, gate_up_scales: Tensor,
                    down_blocks: Tensor, down_scales: Tensor, out: Tensor, router_bias: Optional[Tensor] = None,
                    shared_gate_up: Optional[Tensor] = None, shared_down: Optional[Tensor] = None,
                    routing_mode: str = "deepseek", top_k: int = 8, n_group: int = 1, topk_group: int = 1,
                    norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, phase: Optional[str] = None,
                    check_values: bool = True, config: Optional[str] = None) -> None:
    """:func:`dt.moe_forward` into ``out[T, H]`` in ``x``'s dtype (last dim contiguous). The routing mode is
    ``routing_mode`` here (``routing_kwargs(routing, "routing_mode")``): torch's functionalization of an op that
    mutates passes the arguments by name to a handler whose own first parameter is ``mode``."""
    routing = _routing(routing_mode, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    moe_forward(x, router_weight, gate_up_blocks, gate_up_scales, down_blocks, down_scales, routing=routing,
                router_bias=router_bias, shared_gate_up=shared_gate_up, shared_down=shared_down, phase=phase,
                config=_config(config), out=out)


@moe_forward_out.register_fake
def _(x, *args, **kwargs):
    return None


# -- dense layers on blockwise-FP8 weights ------------------------------------------------------------------------

@_op("fp8_blockwise_linear")
def fp8_blockwise_linear_op(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, check_values: bool = True,
                            config: Optional[str] = None) -> Tensor:
    """:func:`dt.fp8_blockwise_linear`: ``y[M, N]`` in ``x``'s dtype from e4m3 ``weight[N, K]`` and its fp32
    ``weight_scale_inv`` per 128 x 128 block."""
    return fp8_blockwise_linear(x, weight, weight_scale_inv, config=_config(config), check_values=check_values)


@fp8_blockwise_linear_op.register_fake
def _(x, weight, weight_scale_inv, check_values=True, config=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


@_op("fp8_blockwise_linear_out", mutates_args=("out",))
def fp8_blockwise_linear_out(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, out: Tensor,
                             check_values: bool = True, config: Optional[str] = None) -> None:
    """:func:`dt.fp8_blockwise_linear` into ``out[M, N]`` in ``x``'s dtype (contiguous)."""
    fp8_blockwise_linear(x, weight, weight_scale_inv, config=_config(config), check_values=check_values, out=out)


@fp8_blockwise_linear_out.register_fake
def _(x, weight, weight_scale_inv, out, check_values=True, config=None):
    return None


OPS = {name: getattr(torch.ops.dsa, name) for name in (
    "append_tokens", "indexer_logits", "indexer_logits_out", "block_scores", "block_scores_out", "select_pages",
    "select_pages_out", "block_indexer_logits", "topk_indices", "topk_indices_out", "sparse_attention_decode",
    "sparse_attention_prefill", "mxfp4_quantize", "mxfp4_dequantize", "mxfp4_dequantize_out", "mxfp4_to_fp8",
    "mxfp4_to_fp8_out", "fp8_grouped_gemm", "fp8_grouped_gemm_out", "fused_moe_gemm", "fused_moe_gemm_out",
    "route_topk", "swiglu", "swiglu_out", "moe_forward", "moe_forward_out", "fp8_blockwise_linear",
    "fp8_blockwise_linear_out")}
"""Every registered op by name (``torch.ops.dsa.<name>``)."""
