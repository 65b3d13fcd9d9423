"""Sparse attention beside FlashMLA on the same GPU: the same cache bytes, indices and scale, CUDA-graph replay.

Decode over the FP8 latent cache at DeepSeek-V3.2 dims (128 heads, D 576, Dv 512, top-2048 of a 32K-token
sequence), ``B`` in 1, 8, 64, 128 and ``s_q`` 1 and 2 query tokens a sequence, each with its own index set (the
speculative-decoding form FlashMLA takes); 64 heads (a two-way tensor-parallel shard of V3.2, V4-Flash's head count)
at B 64; prefill over a bf16 cache, T 4096 over 32K and 128K tokens. DeepSeek-V4 decode over MODEL1 FP8 pages
(D = Dv = 512, 584 bytes a token) with a sink per head: a window of 128 tokens (pages of 256) beside the top-k2 of
8192 compressed entries (pages of 64), V4-Flash's 64 heads with k2 512 and V4-Pro's 128 with k2 1024; DeepSeek-V4
prefill at d_qk 512 over a bf16 cache (FlashMLA's form: one index set over one buffer of window and compressed rows),
T 4096, 64 heads with top-512 and 128 with top-1024 of 8K and 64K rows, with sinks and per-token lengths (a quarter
of the tokens keep between half and all of their k). Each row: both
medians, ``ours_over_flashmla`` (time ratio: below 1 ours is faster), both as fractions of the bf16 matmul rate
measured in the same run, and the largest difference of the two outputs (both bf16; a row whose outputs disagree
beyond bf16 rounding is an error; a row whose call raises is an error naming it, the others still measured).
Without FlashMLA (not built, or no GPU) the report is one row that says so.
"""
from __future__ import annotations

import torch
import triton

from dsa_triton.attention.sparse_attention import sparse_attention_decode, sparse_attention_prefill
from dsa_triton.attention.sparse_attention_reference import slots_from_indices
from dsa_triton.attention.sparse_attention_spec import (random_fp8_paged_cache, random_model1_paged_cache,
                                                        random_paged_cache)
from dsa_triton.bench import flashmla
from dsa_triton.bench.harness import Ceilings, error_text, graph_time_us, rotation

D, DV, K, P = 576, 512, 2048, 64
DECODE = [(b, s, 128) for b in (1, 8, 64, 128) for s in (1, 2)] + [(64, s, 64) for s in (1, 2)]
V4_D, V4_WINDOW, V4_ENTRIES = 512, 128, 8192  # MODEL1 width; window tokens; compressed entries a sequence
PREFILL = ([(4096, L, 128, D, K, False) for L in (32768, 131072)]  # (T, L, H, d_qk, k, V4's sinks and lengths)
           + [(4096, L, h, V4_D, k, True) for h, k in ((64, 512), (128, 1024)) for L in (8192, 65536)])
V4_DECODE = [(b, s, h, k2) for h, k2 in ((64, 512), (128, 1024)) for b in (1, 64, 128) for s in (1, 2)]
ATOL, RTOL = 2e-3, 2e-2  # two bf16 outputs of the same function: a few units of bf16 rounding apart


def _decode_set(B: int, S: int, H: int, L: int, seed: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    kv, table = random_fp8_paged_cache(B, L, P, D, DV, g)
    logical = torch.rand(B * S, L, generator=g, device=device).topk(K, dim=1).indices.view(B, S, K)
    slots = slots_from_indices(logical, table, P).int()
    q = torch.randn(B, S, H, D, generator=g, device=device).to(torch.bfloat16)
    return {"q": q, "kv": kv, "slots": slots}


def _v4_decode_set(B: int, S: int, H: int, k2: int, seed: int, device) -> dict:
    """Window: the last 128 of 1024 tokens a sequence (pages of 256); entries: top-``k2`` of 8192 (pages of 64)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kv, table = random_model1_paged_cache(B, 1024, 256, V4_D, g)
    window = torch.arange(1024 - V4_WINDOW, 1024, device=device).expand(B, S, V4_WINDOW)
    entries, entry_table = random_model1_paged_cache(B, V4_ENTRIES, 64, V4_D, g)
    picked = torch.rand(B * S, V4_ENTRIES, generator=g, device=device).topk(k2, dim=1).indices.view(B, S, k2)
    return {"q": torch.randn(B, S, H, V4_D, generator=g, device=device).to(torch.bfloat16), "kv": kv,
            "slots": slots_from_indices(window, table, 256).int(), "entries": entries,
            "entry_slots": slots_from_indices(picked, entry_table, 64).int(),
            "sink": torch.randn(H, generator=g, device=device)}


def _prefill_set(T: int, L: int, H: int, seed: int, device, d: int = D, k: int = K, v4: bool = False) -> dict:
    """``T`` tokens of ``H`` heads, each over the top-``k`` of ``L`` bf16 rows ``d`` wide; ``extra``: the keywords
    both ops take besides (``v4``: a sink per head and per-token lengths)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kv, table = random_paged_cache(1, L, P, d, torch.bfloat16, g)
    logical = torch.rand(T, L, generator=g, device=device).topk(k, dim=1).indices
    slots = slots_from_indices(logical, table.expand(T, -1), P).int()
    q = torch.randn(T, H, d, generator=g, device=device).to(torch.bfloat16)
    extra = {}
    if v4:
        short = torch.rand(T, generator=g, device=device) < 0.25
        lengths = torch.where(short, torch.randint(k // 2, k + 1, (T,), generator=g, device=device), k)
        extra = {"attn_sink": torch.randn(H, generator=g, device=device), "topk_length": lengths.int()}
    return {"q": q, "kv": kv.flatten(0, 1), "slots": slots, "extra": extra}


def _disagreement(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, int]:
    """The largest absolute difference and how many elements differ beyond bf16 rounding (NaN counts)."""
    diff = (ours.float() - theirs.float()).abs()
    bad = ~(diff <= ATOL + RTOL * theirs.float().abs())
    return diff.nan_to_num(float("inf")).max().item(), int(bad.sum())


def _row(name: str, flops: float, ours, theirs, sets, device, ceilings: Ceilings) -> dict:
    """Check on the first set, then time both calls (graph replay over the rotated sets); a call that raises fails
    its row (named, with the error), not the report."""
    try:
        return _measured_row(name, flops, ours, theirs, sets, device, ceilings)
    except (RuntimeError, ValueError, triton.runtime.errors.OutOfResources) as exc:
        return {"case": name, "error": error_text(exc)}


def _measured_row(name: str, flops: float, ours, theirs, sets, device, ceilings: Ceilings) -> dict:
    ours_out, theirs_out = ours(sets[0])[0], theirs[0]()[0]
    largest, bad = _disagreement(ours_out.reshape(theirs_out.shape), theirs_out)
    ours_us = graph_time_us(ours, sets, device)
    theirs_us = graph_time_us(lambda i: theirs[i](), list(range(len(sets))), device)
    rate = ceilings.bf16_tflops * 1e12
    row = {"case": name, "ours_us": ours_us, "flashmla_us": theirs_us, "ours_over_flashmla": ours_us / theirs_us,
           "ours_of_bf16_rate": flops / (ours_us * 1e-6) / rate,
           "flashmla_of_bf16_rate": flops / (theirs_us * 1e-6) / rate, "max_abs_diff": largest}
    if bad:
        row["error"] = f"{bad} output elements differ beyond bf16 rounding (max abs {largest:.3g})"
    return row


def flashmla_report(device, ceilings: Ceilings | None) -> list[dict]:
    if torch.device(device).type != "cuda" or ceilings is None or flashmla.module() is None:
        return [{"skipped": "FlashMLA is not built here (scripts/flashmla_build.sh, on a GPU)"}]
    rows = []
    for B, S, H in DECODE:
        sets = rotation(lambda i: _decode_set(B, S, H, 32768, i, device), B * S * K * 656, device, max_sets=4)
        scale = D ** -0.5
        theirs = [flashmla.decode(s["q"], s["kv"], s["slots"], scale, DV) for s in sets]
        rows.append(_row(f"decode fp8 B={B} s_q={S} Hq={H}", 2.0 * B * S * H * K * (D + DV),
                         lambda s: sparse_attention_decode(s["q"], s["kv"], s["slots"], scale, DV, check_values=False),
                         theirs, sets, device, ceilings))
        del sets, theirs
        torch.cuda.empty_cache()
    for B, S, H, k2 in V4_DECODE:
        sets = rotation(lambda i: _v4_decode_set(B, S, H, k2, i, device), B * S * (V4_WINDOW + k2) * 584, device,
                        max_sets=4)
        scale = V4_D ** -0.5
        theirs = [flashmla.decode(s["q"], s["kv"], s["slots"], scale, V4_D, attn_sink=s["sink"],
                                  extra_kv_cache=s["entries"], extra_slots=s["entry_slots"]) for s in sets]
        rows.append(_row(f"decode V4 MODEL1 B={B} s_q={S} Hq={H} k={V4_WINDOW}+{k2}",
                         2.0 * B * S * H * (V4_WINDOW + k2) * 2 * V4_D,
                         lambda s: sparse_attention_decode(s["q"], s["kv"], s["slots"], scale, V4_D, check_values=False,
                                                           attn_sink=s["sink"], extra_kv_cache=s["entries"],
                                                           extra_indices=s["entry_slots"]),
                         theirs, sets, device, ceilings))
        del sets, theirs
        torch.cuda.empty_cache()
    for T, L, H, d, k, v4 in PREFILL:
        sets = rotation(lambda i: _prefill_set(T, L, H, i, device, d, k, v4), L * d * 2, device, max_sets=2)
        scale = d ** -0.5
        theirs = [flashmla.prefill(s["q"], s["kv"], s["slots"], scale, DV, **s["extra"]) for s in sets]
        rows.append(_row(f"prefill {'V4 ' if v4 else ''}bf16 T={T} L={L} Hq={H}" + (f" k={k}" if v4 else ""),
                         2.0 * T * H * k * (d + DV),
                         lambda s: sparse_attention_prefill(s["q"], s["kv"], s["slots"], scale, DV,
                                                            check_values=False, **s["extra"]),
                         theirs, sets, device, ceilings))
        del sets, theirs
        torch.cuda.empty_cache()
    return rows
