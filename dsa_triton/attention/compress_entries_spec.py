"""Registry entry of :func:`~dsa_triton.compress_entries` (DeepSeek-V4's compressors), and the random step its tests
share (:func:`random_step`).

Shapes: ``B`` sequences, ``N`` new tokens (``N / B`` each), ``D`` entry width, ``M`` ratio, ``C`` 2 with the overlap
(else 1). Problem-only dims (not in the key): ``ctx`` tokens cached before the step (sequence ``b`` holds
``ctx + b``, so windows close at different tokens of each), ``R`` rope pairs, ``P`` page size of both streams.
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from ..hostmath import cdiv
from ..registry import Cost, KernelSpec
from . import compress_entries, compress_entries_kernels, compress_entries_reference
from .compress_entries_reference import compress_entries_torch, paged_slots
from .sparse_attention_spec import random_paged_cache

TENSORS = ("kv", "gate", "kv_window", "gate_window", "window_table", "entries", "entry_table", "cu_seqlens",
           "seq_lens", "ape", "norm_weight", "cos", "sin")


def random_step(starts: list[int], counts: list[int], D: int, R: int, M: int, C: int, P: int, dtype: torch.dtype,
                g: torch.Generator) -> dict:
    """A step of ``counts[b]`` new tokens after ``starts[b]`` cached ones in each sequence, on ``g``'s device: random
    inputs and weights; the window stream holding the inputs of the last ``C M - 1`` cached tokens of each sequence
    on shuffled pages (no others: -1 in its table; every other slot NaN, those of the step's tokens too); the entries
    cache holding each sequence's earlier entries (the entries closing in the step and every unused slot NaN);
    rope tables of ``R`` pairs for every entry. The op's keyword arguments (``max_q`` included)."""
    device, B, width = g.device, len(starts), C * D
    ends = [s + n for s, n in zip(starts, counts)]
    randn = lambda *size: torch.randn(*size, generator=g, device=device)  # noqa: E731
    held = [torch.arange(max(s - (C * M - 1), 0), s, device=device) for s in starts]  # the window's tokens
    live = [range(int(h[0]) // P, cdiv(s, P)) if h.numel() else range(0) for h, s in zip(held, starts)]
    num_pages = sum(map(len, live)) + 1  # page 0 spare
    pages = (torch.randperm(num_pages - 1, generator=g, device=device) + 1).tolist()
    window_table = torch.full((B, max(cdiv(max(starts), P), 1)), -1, dtype=torch.int32, device=device)
    for b, logical in enumerate(live):
        window_table[b, list(logical)] = torch.tensor([pages.pop() for _ in logical], dtype=torch.int32).to(device)
    kv_window, gate_window = (torch.full((num_pages, P, width), float("nan"), dtype=dtype, device=device)
                              for _ in range(2))
    for b, positions in enumerate(held):
        slots = paged_slots(window_table[b], positions, P)
        kv_window.view(-1, width)[slots] = randn(positions.numel(), width).to(dtype)
        gate_window.view(-1, width)[slots] = (randn(positions.numel(), width) * 2).to(dtype)
    entries, entry_table = random_paged_cache(B, max(max(ends) // M, 1), P, D, dtype, g)
    for b, start in enumerate(starts):
        fresh = torch.arange(start // M, entry_table.shape[1] * P, device=device)
        entries.view(-1, D)[paged_slots(entry_table[b], fresh, P)] = float("nan")
    angle = randn(max(ends) // M + 1, R) * 3
    return {"kv": randn(sum(counts), width).to(dtype), "gate": (randn(sum(counts), width) * 2).to(dtype),
            "kv_window": kv_window, "gate_window": gate_window, "window_table": window_table, "entries": entries,
            "entry_table": entry_table,
            "cu_seqlens": torch.tensor([0] + counts, device=device).cumsum(0).to(torch.int32),
            "seq_lens": torch.tensor(ends, dtype=torch.int32, device=device),
            "ape": randn(M, width) * 0.5, "norm_weight": 1 + 0.2 * randn(D),
            "cos": angle.cos().to(dtype), "sin": angle.sin().to(dtype),
            "ratio": M, "overlap": C == 2, "eps": 1e-6, "max_q": max(counts)}


def _starts(shape) -> tuple[list[int], list[int]]:
    B, N = shape["B"], shape["N"]
    return [shape["ctx"] + b for b in range(B)], [N // B] * B


def _make_inputs(phase: str, shape, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16
    return random_step(*_starts(shape), *(shape[k] for k in ("D", "R", "M", "C", "P")), dtype, g)


def _split(inputs: dict) -> tuple[list, dict]:
    return [inputs[k] for k in TENSORS], {k: inputs[k] for k in ("ratio", "overlap", "eps")}


def _run(inputs: dict, config: dict) -> torch.Tensor:
    """As the runner calls it: sizes given, value checks off (the inputs are valid)."""
    args, kw = _split(inputs)
    compress_entries.compress_entries(*args, **kw, max_q=inputs["max_q"], check_values=False, config=config)
    return inputs["entries"]


def _reference(inputs: dict) -> torch.Tensor:
    args, kw = _split(inputs)
    args[TENSORS.index("entries")] = entries = inputs["entries"].clone()
    compress_entries_torch(*args, **kw)
    return entries


def compare_entries(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """NaN at the same places (the slots not written keep their NaN; the others are finite) and the values within 4
    units of the dtype's roundoff of their row's largest magnitude."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"{out.dtype}{tuple(out.shape)} vs reference {ref.dtype}{tuple(ref.shape)}"
    if not torch.equal(out.isnan(), ref.isnan()):
        return f"NaN at {int((out.isnan() != ref.isnan()).sum())} places that differ from the reference"
    tol = 1e-5 if out.dtype == torch.float32 else 4 * torch.finfo(out.dtype).eps
    out, ref = out.reshape(-1, out.shape[-1]).float(), ref.reshape(-1, ref.shape[-1]).float()
    finite = ~ref.isnan()
    scale = ref.where(finite, 0.0).abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    err = float(((out - ref).where(finite, 0.0).abs() / scale).max()) if out.numel() else 0.0
    return None if err <= tol else f"max error {err:.2e} of the row's largest magnitude (tolerance {tol:.1e})"


def _windows(shape) -> int:
    starts, counts = _starts(shape)
    return sum((s + n) // shape["M"] - s // shape["M"] for s, n in zip(starts, counts))


def _cost(phase: str, shape) -> Cost:
    """Each closing window's slots read (gates and values: ``C M`` tokens x ``D`` each), its entry written (2 bytes a
    value); the step's inputs read where no window closes are not counted."""
    C, M, D = shape["C"], shape["M"], shape["D"]
    windows = _windows(shape)
    return Cost(bytes=windows * (2 * C * M * D + D) * 2, flops=windows * C * M * D * 6.0)


def _bench_shapes(phase: str, gpu: bool) -> list[dict[str, int]]:
    """DeepSeek-V4-Flash's three compressors (CSA's at 512 and its indexer's at 128, with the overlap; HCA's at 512)
    on the GPU; on the CPU odd widths (a row of 40 padded to 64), pages of 4 and 8 that windows cross."""
    if gpu:
        counts = {"B": 64, "N": 64, "ctx": 4095} if phase == "decode" else {"B": 1, "N": 8192, "ctx": 8192}
        return [{**counts, "D": d, "R": 32, "M": m, "C": c, "P": 64} for d, m, c in ((512, 4, 2), (128, 4, 2),
                                                                                    (512, 128, 1))]
    if phase == "decode":
        return [{"B": 5, "N": 5, "ctx": 7, "D": 48, "R": 8, "M": 4, "C": 2, "P": 4}]
    return [{"B": 2, "N": 26, "ctx": 6, "D": 48, "R": 8, "M": 4, "C": 2, "P": 4},
            {"B": 2, "N": 22, "ctx": 5, "D": 40, "R": 4, "M": 8, "C": 1, "P": 8}]


def _model_dims(m) -> list[dict]:
    """DeepSeek-V4: each compressor of its layer types (CSA: its own and its indexer's, with the overlap; HCA); no
    other model has one."""
    if not m.v4:
        return []
    shapes = {"compressed_sparse_attention": [(m.latent, 2), (m.index_dim, 2)], "heavily_compressed_attention":
              [(m.latent, 1)]}
    return [{"D": d, "R": m.rope // 2, "M": m.compress_rate(kind), "C": c, "P": m.page}
            for kind in m.attention_types() for d, c in shapes.get(kind, [])]


SPEC = registry.register(KernelSpec(
    launch=compress_entries.LAUNCH,
    make_inputs=_make_inputs,
    run=_run,
    reference=_reference,
    compare=compare_entries,
    cost=_cost,
    bench_shapes=_bench_shapes,
    baseline=_reference,
    baseline_name="torch gather + softmax pooling + norm + rope per sequence (the runner's reference)",
    model_dims=_model_dims,
    count_roles={"B": "batch", "N": "tokens"},
    source_modules=(compress_entries_reference, compress_entries_kernels, compress_entries, sys.modules[__name__]),
))
