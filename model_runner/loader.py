"""Reading checkpoints in the Hugging Face layout, shared by every family: one ``model.safetensors`` or shards named
by the ``weight_map`` of ``model.safetensors.index.json``. Which tensors a family expects (names, shapes) is its own
weight-name map (:mod:`.families`); what is here is the mechanics.

Formats. A weight may be any float dtype, or float8_e4m3fn with its 128 x 128 block scales beside it
(``quantization_config`` fp8): ``<name>_scale_inv`` (Hugging Face) or, for ``X.weight``, ``X.scale`` (DeepSeek's
own name), fp32 or E8M0 (``float8_e8m0fnu``, read as the fp32 power of two it is). :func:`load_dense` keeps FP8
projections FP8 (an :class:`.ops.FP8Weight`, multiplied by the blockwise-FP8 GEMM) where the family says so and
dequantizes the rest. Experts end as MXFP4 (``blocks [E, N, K/32, 16]``, ``scales [E, N, K/32]`` uint8):
:func:`take_mxfp4` reads stacked MXFP4 tensors as shipped (or only the rows of some experts),
:func:`mxfp4_view` reads an FP4 (e2m1, two a byte, low nibble first, one E8M0 scale per 32) expert as MXFP4 without
conversion, :func:`MXFP4Stack` quantizes float experts at load (lossy: the 32-blocks whose values change are
counted). Multi-token-prediction layers are skipped with a note (:func:`finish`). A missing or misshaped tensor, an
FP8 weight without its scales, a tensor left over: a :class:`.errors.RunnerError` naming it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

import dsa_triton as dt
from dsa_triton.linear.formats import dequantize_fp8_blockwise
from dsa_triton.moe.formats import validate_mxfp4
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch
from dsa_triton.runtime import interpreting

from .errors import RunnerError
from .ops import FP8Weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def scale_name(name: str) -> str:
    """Hugging Face's name of an FP8 weight's block scales."""
    return name + "_scale_inv"


def deepseek_scale_name(name: str) -> str | None:
    """DeepSeek's name of the scales of ``X.weight``: ``X.scale`` (None for other names)."""
    return name[: -len("weight")] + "scale" if name.endswith(".weight") else None


class TensorFiles:
    """A checkpoint's tensors by name, read on demand from the file that holds each."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise RunnerError(f"checkpoint: {index} has no readable weight_map ({exc!r})") from None
        elif single.exists():
            self.weight_map = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            raise RunnerError(f"checkpoint: {self.folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._files: dict[str, object] = {}

    def _open(self, file: str):
        path = self.folder / file
        if not path.exists():
            raise RunnerError(f"checkpoint: {path} is named by {INDEX_FILE} but does not exist")
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise RunnerError(f"checkpoint: cannot read {path} ({exc})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def dtype(self, name: str) -> str:
        """The tensor's dtype as safetensors names it (e.g. "F8_E8M0"), without reading it."""
        return self._handle(name).get_slice(name).get_dtype()

    def get_rows(self, name: str, rows: range) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Rows ``rows`` of dimension 0 (only those bytes are read) and the whole tensor's shape."""
        part = self._handle(name).get_slice(name)
        return part[rows.start:rows.stop], tuple(part.get_shape())

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = self._open(file)
        handle = self._files[file]
        if name not in handle.keys():
            raise RunnerError(f"checkpoint: tensor {name} is in the weight_map but not in {file}")
        return handle


@dataclass
class Checkpoint:
    """The model's tensors by name and what loading did to them (one line each)."""
    weights: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Reader:
    """Takes tensors out of a :class:`TensorFiles` by expected name and shape; remembers which were taken.
    ``fp8``: whether config.json declares FP8 weights (``quantization_config`` fp8)."""

    def __init__(self, files: TensorFiles, fp8: bool):
        self.files, self.fp8, self.taken = files, fp8, set()

    def take(self, name: str, shape: tuple[int, ...], rows: range | None = None) -> torch.Tensor:
        """The tensor ``name`` of ``shape``, or only ``rows`` of its dimension 0."""
        if name not in self.files:
            raise RunnerError(f"checkpoint: tensor {name} is missing")
        t, full = self.files.get_rows(name, rows) if rows is not None else (self.files.get(name), None)
        if (full or tuple(t.shape)) != shape:
            raise RunnerError(f"checkpoint: tensor {name} has shape {full or tuple(t.shape)}, expected {shape}")
        self.taken.add(name)
        return t

    def scale_of(self, name: str) -> str | None:
        """The name of ``name``'s block scales in this checkpoint (None: it has none)."""
        return next((s for s in (scale_name(name), deepseek_scale_name(name)) if s in self.files), None)

    def skip(self, name: str) -> None:
        """Count ``name`` and its scales as read (another rank's experts)."""
        self.taken.update(n for n in (name, scale_name(name), deepseek_scale_name(name)) if n)

    def take_scales(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Block scales ``shape`` as fp32, checked finite and > 0 (E8M0 bytes read as their power of two)."""
        scale = self.take(name, shape)
        if scale.dtype not in SCALE_DTYPES:
            raise RunnerError(f"checkpoint: tensor {name} must be float32 or float8_e8m0fnu, got {scale.dtype}")
        scale = scale.float()
        if not bool((scale.isfinite() & (scale > 0)).all()):
            raise RunnerError(f"checkpoint: tensor {name} must be finite and > 0")
        return scale

    def take_weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | FP8Weight:
        """A float tensor, or an FP8 weight with its block scales (checked: finite, positive, no e4m3 NaN)."""
        t = self.take(name, shape)
        scales = self.scale_of(name)
        if t.dtype == torch.float8_e4m3fn:
            if not self.fp8:
                raise RunnerError(f"checkpoint: tensor {name} is float8_e4m3fn but config.json has no "
                                  f"quantization_config with quant_method fp8")
            if scales is None:
                raise RunnerError(f"checkpoint: FP8 tensor {name} has no {scale_name(name)}")
            scale = self.take_scales(scales, tuple(-(-n // 128) for n in shape))
            if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise RunnerError(f"checkpoint: tensor {name} holds an e4m3 NaN")
            return FP8Weight(t, scale)
        if scales is not None:
            raise RunnerError(f"checkpoint: tensor {scales} scales {name}, which is {t.dtype}, not FP8")
        if t.dtype not in FLOAT_DTYPES:
            raise RunnerError(f"checkpoint: tensor {name} has dtype {t.dtype}, expected a float dtype or FP8")
        return t


def load_dense(reader: Reader, shapes: dict[str, tuple[int, ...]], weights: dict, dtype: torch.dtype, device, *,
               keep_fp8, fp32, dequantize_fp8: bool) -> list[str]:
    """Every tensor of ``shapes`` into ``weights``: FP8 weights kept as :class:`.ops.FP8Weight` where
    ``keep_fp8(name, shape)`` (unless ``dequantize_fp8``), else in ``dtype`` (fp32 where ``fp32(name)``); -> the
    note (none when nothing was FP8)."""
    kept = dequantized = 0
    for name, shape in shapes.items():
        t = reader.take_weight(name, shape)
        if isinstance(t, FP8Weight):
            if keep_fp8(name, shape) and not dequantize_fp8:
                weights[name] = FP8Weight(t.weight.to(device), t.scale_inv.to(device))
                kept += 1
                continue
            t, dequantized = dequantize_fp8_blockwise(*t), dequantized + 1
        weights[name] = t.to(device, torch.float32 if fp32(name) else dtype)
    if not (kept or dequantized):
        return []
    return [f"dense weights: {kept} FP8 projections kept in FP8 (blockwise-FP8 GEMM), {dequantized} FP8 tensors "
            f"dequantized to {str(dtype).replace('torch.', '')} at load"]


def take_mxfp4(reader: Reader, name: str, shape: tuple[int, ...], rows: range, device) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Stacked MXFP4 ``name_blocks`` ``shape`` and ``name_scales`` (experts ``rows`` of them), checked."""
    blocks = reader.take(name + "_blocks", shape, rows)
    scales = reader.take(name + "_scales", shape[:-1], rows)
    try:
        validate_mxfp4(name, blocks, scales)  # a 0xFF scale names the tensor and the block
    except ValueError as exc:
        raise RunnerError(f"checkpoint: {exc}") from None
    return blocks.to(device), scales.to(device)


def mxfp4_view(reader: Reader, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An FP4 expert weight ``name`` of logical ``shape [N, K]`` (``[N, K/2]`` bytes, E8M0 scales ``[N, K/32]``) as
    MXFP4 ``blocks [N, K/32, 16]``, ``scales [N, K/32]`` uint8 (views, no conversion); None when ``name`` is not
    FP4 (no scales of dtype E8M0 beside it)."""
    scales = reader.scale_of(name)
    n, k = shape
    if scales is None or reader.files.dtype(scales) != "F8_E8M0" or k % 32:
        return None
    packed = reader.take(name, (n, k // 2))
    if packed.dtype not in FP4_DTYPES:
        raise RunnerError(f"checkpoint: FP4 tensor {name} has dtype {packed.dtype}, expected int8 (two e2m1 a byte)")
    blocks = packed.view(torch.uint8).view(n, k // 32, 16)
    scale_bytes = reader.take(scales, (n, k // 32)).view(torch.uint8)
    try:
        validate_mxfp4(name, blocks, scale_bytes)
    except ValueError as exc:
        raise RunnerError(f"checkpoint: {exc}") from None
    return blocks, scale_bytes


class MXFP4Stack:
    """Experts of one projection gathered as MXFP4: :meth:`add` each expert in order (FP4 as read, float quantized
    a batch of up to :attr:`BATCH_BYTES` at a time: few quantize calls, bounded memory), then :meth:`tensors`;
    counts the 32-blocks that quantizing changed. Quantized by ``dt.mxfp4_quantize``, or in the Triton interpreter
    by its bit-identical PyTorch reference (the interpreter is far slower at it). ``name`` names the experts in
    errors."""
    BATCH_BYTES = 2 ** 28

    def __init__(self, device, name: str):
        self.device, self.name, self.blocks, self.scales, self.pending = device, name, [], [], []
        self.lossy = self.total = 0

    def add(self, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> None:
        """``weight``: a float ``[N, K]`` tensor or MXFP4 ``(blocks, scales)``."""
        if isinstance(weight, tuple):
            self._flush()
            self.blocks.append(weight[0].to(self.device))
            self.scales.append(weight[1].to(self.device))
            return
        self.pending.append(weight)
        if sum(w.numel() * w.element_size() for w in self.pending) >= self.BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        dense = torch.stack(self.pending).to(self.device)
        self.pending = []
        if not bool(torch.isfinite(dense).all()):
            raise RunnerError(f"checkpoint: experts {self.name} hold NaN or inf, which MXFP4 cannot represent")
        blocks, scales = (mxfp4_quantize_torch if interpreting() else dt.mxfp4_quantize)(dense)
        changed = mxfp4_dequantize_torch(blocks, scales) != dense
        self.lossy += int(changed.view(*changed.shape[:-1], -1, 32).any(-1).sum())
        self.total += scales.numel()
        self.blocks += list(blocks)
        self.scales += list(scales)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``blocks [E, N, K/32, 16]``, ``scales [E, N, K/32]`` uint8 on the device."""
        self._flush()
        return torch.stack(self.blocks), torch.stack(self.scales)


def tally_conversion(converted: dict[str, list[int]], fmt: str, lossy: int, blocks: int) -> None:
    """Count one layer's experts quantized at load from ``fmt`` (nothing for experts stored as MXFP4) into
    ``converted``, ``{source format: [layers, lossy 32-blocks, 32-blocks]}``."""
    if fmt != "mxfp4":
        counts = converted.setdefault(fmt, [0, 0, 0])
        counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + lossy, counts[2] + blocks


def conversion_notes(converted: dict[str, list[int]]) -> list[str]:
    """``{source format: [layers, lossy 32-blocks, 32-blocks]}`` of experts quantized at load -> one note each."""
    return [f"experts: {fmt} -> MXFP4 at load in {layers} layers; {lossy} of {blocks} 32-element blocks lossy "
            f"({100 * lossy / max(blocks, 1):.2f}%)" for fmt, (layers, lossy, blocks) in converted.items()]


def finish(reader: Reader, mtp: range, notes: list[str], layer_pattern: str = r"model\.layers\.(\d+)\.") -> None:
    """Skip the multi-token-prediction layers ``mtp`` (noted); any other tensor left is an error naming it."""
    layer_of = re.compile(layer_pattern)
    left = sorted(set(reader.files.weight_map) - reader.taken)
    skipped = [n for n in left if (m := layer_of.match(n)) and int(m.group(1)) in mtp]
    if skipped:
        notes.append(f"multi-token-prediction layers {mtp.start}..{mtp.stop - 1} (num_nextn_predict_layers = "
                     f"{len(mtp)}): {len(skipped)} tensors skipped (not used for generation)")
    unused = sorted(set(left) - set(skipped))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise RunnerError(f"checkpoint: tensor {unused[0]} is not implemented by the runner{more}")
