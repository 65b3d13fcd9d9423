"""Config sweep of the indexer kernels on one GPU: ``python -m dsa_triton.attention.sweep_indexer``.

For each stage (token-level decode and prefill logits, the page bounds, page selection, the logits
inside selected pages) and its realistic DeepSeek-V3.2 shape: every listed config is checked against
the reference on the same inputs and timed (``do_bench`` median; the short block-path stages replayed
from a CUDA graph, so the host's Python does not hide their time), fastest first, with the fraction of
the floor. ``--budget S`` stops starting new configs after S seconds (compiles dominate);
``--only a,b`` runs some stages. :func:`sweep` returns the rows.
"""
from __future__ import annotations

import argparse
import time

import torch

from .. import registry
from ..harness import floor_us, graph_us, measure_ceilings, time_us
from ..registry import Cost
from .block_scores import block_scores, selected_page_logits
from .block_scores_reference import gather_selected_torch, page_bounds_torch
from ..hostmath import cdiv
from .indexer import compare_logits
from .indexer_reference import indexer_logits_torch
from .page_select import select_pages

DECODE = {"B": 64, "Q": 1, "L": 131072, "P": 64, "H": 64, "DK": 128}
GRAPHED = ("bounds", "selected", "page_select")  # stages of a few tens of microseconds
_START = time.perf_counter()


def _logits(bm, bn, chunk, warps, stages):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "CHUNK": chunk, "num_warps": warps, "num_stages": stages}


def _bound(bn, chunk, warps, stages):
    return {**registry.get("indexer_block_path").default("decode", DECODE), "bound_BLOCK_N": bn,
            "bound_CHUNK": chunk, "bound_warps": warps, "bound_stages": stages}


def _selected(bn, chunk, warps, stages):
    return {**registry.get("indexer_block_path").default("decode", DECODE), "BLOCK_N": bn, "CHUNK": chunk,
            "num_warps": warps, "num_stages": stages}


STAGES = {
    "decode_q1": ("indexer_logits", "decode", DECODE, [
        _logits(1, 256, 4096, 8, 3), _logits(1, 128, 2048, 4, 3), _logits(1, 128, 4096, 4, 3),
        _logits(1, 256, 2048, 8, 3), _logits(1, 256, 8192, 8, 3)]),
    "decode_q2": ("indexer_logits", "decode", {**DECODE, "Q": 2}, [
        _logits(2, 64, 4096, 4, 3), _logits(1, 256, 4096, 8, 3), _logits(1, 128, 2048, 4, 3),
        _logits(1, 128, 4096, 4, 3), _logits(2, 64, 2048, 4, 3)]),
    "prefill": ("indexer_logits", "prefill", {"B": 1, "Q": 4096, "L": 16384, "P": 0, "H": 64, "DK": 128}, [
        _logits(2, 64, 16384, 4, 3), _logits(2, 64, 16384, 4, 4), _logits(2, 128, 16384, 8, 3),
        _logits(4, 64, 16384, 8, 3), _logits(4, 64, 16384, 8, 4), _logits(1, 128, 16384, 4, 3),
        _logits(2, 64, 16384, 8, 3)]),
    "prefill_paged": ("indexer_logits", "prefill", {"B": 1, "Q": 4096, "L": 16384, "P": 64, "H": 64, "DK": 128}, [
        _logits(2, 64, 16384, 4, 3), _logits(4, 64, 16384, 8, 3)]),
    "bounds": ("indexer_block_path", "decode", {**DECODE, "SEL": 64}, [
        _bound(64, 256, 4, 2), _bound(64, 128, 4, 2), _bound(32, 256, 4, 3), _bound(32, 128, 4, 3),
        _bound(64, 256, 4, 3), _bound(64, 512, 4, 2), _bound(64, 128, 8, 2), _bound(16, 128, 4, 4)]),
    "selected": ("indexer_block_path", "decode", {**DECODE, "SEL": 64}, [
        _selected(64, 512, 4, 3), _selected(64, 256, 4, 3), _selected(64, 512, 4, 2), _selected(128, 512, 4, 3),
        _selected(64, 1024, 4, 3), _selected(32, 256, 4, 3)]),
    "page_select": ("page_select", "decode", {"T": 64, "pages": 2048, "SEL": 64}, [
        {"TILE": 2048, "num_warps": 4}, {"TILE": 2048, "num_warps": 8}, {"TILE": 1024, "num_warps": 4},
        {"TILE": 2048, "num_warps": 2}]),
}


def _block_stage(name: str, inputs: dict):
    """``(run(config), reference, compare, cost)`` of one launch of the block path on its inputs."""
    q, w, P, L = inputs["q"], inputs["weights"], inputs["k"].shape[1], inputs["max_len"]
    kw = {"cu_seqlens_q": inputs["cu_seqlens_q"], "max_q": inputs["max_q"], "check_values": False}
    B, n_pages = inputs["cu_seqlens_q"].shape[0] - 1, cdiv(L, P)
    bounds_ref = page_bounds_torch(q, w, inputs["pmax"], inputs["pmin"], inputs["block_table"], inputs["limits"],
                                   P, n_pages, inputs["cu_seqlens_q"])
    if name == "bounds":
        def run(config):
            return block_scores(q, w, inputs["pmax"], inputs["pmin"], inputs["block_table"], inputs["seq_lens"],
                                inputs["limits"], P, num_cols=n_pages, config=config, **kw)
        cost = Cost(bytes=B * n_pages * 2 * q.shape[2] * inputs["pmax"].element_size())
        return run, bounds_ref, compare_logits, cost
    pages = select_pages(bounds_ref, inputs["n_select"])
    dense = indexer_logits_torch(q, w, inputs["k"], inputs["k_scale"], inputs["limits"], L,
                                 cu_seqlens_q=inputs["cu_seqlens_q"], block_table=inputs["block_table"])
    ref = gather_selected_torch(dense, pages, P, inputs["limits"])

    def run(config):
        return selected_page_logits(q, w, inputs["k"], inputs["k_scale"], inputs["block_table"], inputs["seq_lens"],
                                    inputs["limits"], pages, config=config, **kw)

    def compare(out, ref):
        if not torch.equal(out[1], ref[1]):
            return "positions differ"
        return compare_logits(out[0], ref[0])
    return run, ref, compare, Cost(bytes=pages.numel() * P * (q.shape[2] + 4 + 8))


def sweep(name: str, ceilings, budget_s: float) -> list[dict]:
    kernel, phase, shape, configs = STAGES[name]
    spec = registry.get(kernel)
    inputs = spec.make_inputs(phase, shape, torch.device("cuda"), 0)
    if name in ("bounds", "selected"):
        run, ref, compare, cost = _block_stage(name, inputs)
    else:
        run, ref, compare, cost = (lambda c: spec.run(inputs, c)), spec.reference(inputs), spec.compare, \
            spec.cost(phase, shape)
    floor, bound = floor_us(cost, ceilings)
    timer = graph_us if name in GRAPHED else lambda fn, device: time_us(fn, device, warmup_ms=10, rep_ms=40)
    rows = []
    for config in configs:
        if time.perf_counter() - _START > budget_s:
            rows.append({"config": config, "error": "skipped (time budget)"})
            continue
        try:
            error = compare(run(config), ref)
            us = timer(lambda: run(config), "cuda")
            rows.append({"stage": name, "config": config, "us": us, "of_floor": floor / us, "check": error or "ok"})
        except Exception as e:  # a config the compiler rejects or that runs out of resources
            rows.append({"config": config, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    if name == "page_select":
        rows.append({"config": "torch.topk + sort (baseline)", "check": "-",
                     "us": timer(lambda: spec.baseline(inputs), "cuda")})
    print(f"\n## {name}: {kernel} {phase} {shape}  floor {floor:.1f} us ({bound})", flush=True)
    for r in sorted(rows, key=lambda r: r.get("us", float("inf"))):
        if "us" in r:
            print(f"| {r['us']:9.1f} us | {r.get('of_floor', float('nan')):.2f} of floor | {r['check']} | {r['config']}")
        else:
            print(f"| {r['error']} | {r['config']}")
    del inputs
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_triton.attention.sweep_indexer")
    parser.add_argument("--only", default=",".join(STAGES), help="comma-separated stages")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds after which no new config starts")
    args = parser.parse_args(argv)
    ceilings = measure_ceilings("cuda")
    print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 {ceilings.bf16_tflops:.0f}, "
          f"fp8 {ceilings.fp8_tflops:.0f} TFLOP/s", flush=True)
    for name in args.only.split(","):
        sweep(name, ceilings, args.budget)
    print(f"\nsweep done in {time.perf_counter() - _START:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
