"""Host time of the attention ops' launch paths: ``python -m dsa_triton.bench.hostprof [--device cuda] [names]``.

Every Triton launch is replaced by a no-op, so what is timed is the op's Python: argument checks, config
lookup, allocations, launch arguments. Inputs are uninitialised tensors of DeepSeek-V3.2 decode shapes
(value checks off and sizes given, as in CUDA graphs and hot loops). On the CPU, ``torch.empty`` keeps its
blocks like the CUDA caching allocator (the CPU allocator maps and unmaps outputs over 32 MB every call).
Prints the best per-call time of 15 rounds of 200 calls, and the launches each call made.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, Iterator

import torch
import triton.runtime.jit as jit

import dsa_triton as dt


@contextlib.contextmanager
def stubbed_launches(counter: list[int], device: torch.device) -> Iterator[None]:
    """``kernel[grid](...)`` counts into ``counter[0]`` instead of launching (and, on the CPU, cached blocks)."""
    getitem, empty = jit.KernelInterface.__getitem__, torch.empty
    blocks = {}

    def cached_empty(*size, **kw):
        empty(1, dtype=kw.get("dtype"), device=kw.get("device"))  # the host cost of a small allocation
        key = (size, kw.get("dtype"), str(kw.get("device")))
        if key not in blocks:
            blocks[key] = empty(*size, **kw)
        return blocks[key]

    def launch(*args, **kwargs):
        counter[0] += 1

    jit.KernelInterface.__getitem__ = lambda self, grid: launch
    if device.type == "cpu":
        torch.empty = cached_empty
    try:
        yield
    finally:
        jit.KernelInterface.__getitem__, torch.empty = getitem, empty


def cases(device: torch.device) -> Iterator[tuple[str, Callable[[], object]]]:
    """(name, call) of each op at decode shapes: B=64 sequences of L=131072 tokens in 64-token pages, 64 x 128
    indexer heads, 64 pages selected; top-2048 of [T, 131072]; sparse decode with 128 heads of 576 / 512; a
    decode step's append of 64 tokens."""
    B, L, P, H, DK, SEL = 64, 131072, 64, 64, 128, 64
    e = dict(device=device)
    num_pages = B * (L // P) + 1
    q, w = torch.empty(B, H, DK, dtype=torch.float8_e4m3fn, **e), torch.empty(B, H, **e)
    k, k_scale = torch.empty(num_pages, P, DK, dtype=torch.float8_e4m3fn, **e), torch.empty(num_pages, P, **e)
    summaries = torch.empty(num_pages, 2, DK, dtype=torch.bfloat16, **e)
    pmax, pmin = summaries[:, 0], summaries[:, 1]
    table = torch.arange(B * (L // P), dtype=torch.int32, **e).view(B, L // P)
    lens = torch.full((B,), L, dtype=torch.int32, **e)
    cu = torch.arange(B + 1, dtype=torch.int32, **e)
    fast = dict(cu_seqlens_q=cu, max_q=1, check_values=False)
    pages = torch.zeros(B, SEL, dtype=torch.int32, **e)
    bounds = torch.empty(B, L // P, **e)
    yield "block_indexer_logits", lambda: dt.block_indexer_logits(q, w, k, k_scale, pmax, pmin, table, lens, lens,
                                                                  SEL, max_len=L, **fast)
    yield "block_scores", lambda: dt.block_scores(q, w, pmax, pmin, table, lens, lens, P, num_cols=L // P, **fast)
    yield "select_pages", lambda: dt.select_pages(bounds, SEL)
    yield "selected_page_logits", lambda: dt.selected_page_logits(q, w, k, k_scale, table, lens, lens, pages, **fast)
    yield "indexer_logits", lambda: dt.indexer_logits(q, w, k, k_scale, lens, block_table=table, seq_lens=lens,
                                                      num_cols=L, **fast)
    for T in (1, 64):
        args = (torch.empty(T, L, **e), 2048, lens[:T])
        yield f"topk_indices T={T}", (lambda args=args, bt=table[:T]: dt.topk_indices(
            *args, block_table=bt, page_size=P, check_values=False))
    kv = torch.empty(8192, P, 576, dtype=torch.bfloat16, **e)
    ik, ik_scale = torch.empty(8192, P, DK, dtype=torch.float8_e4m3fn, **e), torch.empty(8192, P, **e)
    cache = (kv, ik, ik_scale, torch.empty(8192, 2, DK, dtype=torch.bfloat16, **e))
    new = (torch.zeros(B, 576, dtype=torch.bfloat16, **e), torch.zeros(B, DK, dtype=torch.bfloat16, **e))  # finite: checked
    items = torch.stack([torch.arange(B), torch.ones(B, dtype=torch.long), torch.arange(B) * 7, torch.arange(B) % P],
                        1).int().to(device)  # decode: one token per sequence, each on its own page
    for check in (True, False):
        yield f"append_tokens B={B} check_values={check}", (lambda check=check: dt.append_tokens(
            *cache, *new, items, **({} if check else {"check_values": False})))
    for b in (1, 8):
        qd = torch.empty(b, 128, 576, dtype=torch.bfloat16, **e)
        idx = torch.zeros(b, 2048, dtype=torch.int32, **e)
        yield f"sparse_attention_decode B={b}", (lambda qd=qd, idx=idx: dt.sparse_attention_decode(
            qd, kv, idx, 0.1352, check_values=False))
        yield f"sparse_attention_decode B={b} block_table", (lambda qd=qd, idx=idx, bt=table[:b]: dt.sparse_attention_decode(
            qd, kv, idx, 0.1352, block_table=bt, check_values=False))


def host_times(device: torch.device, names: list[str] = (), calls: int = 200, rounds: int = 15) -> list[dict]:
    """One row per op: best microseconds per call over ``rounds`` of ``calls``, and the launches of a call."""
    rows, counter = [], [0]
    with stubbed_launches(counter, device):
        for name, call in cases(device):
            if names and not any(n in name for n in names):
                continue
            call()
            counter[0] = 0
            call()
            launches, best = counter[0], float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                best = min(best, (time.perf_counter() - start) / calls * 1e6)
            rows.append({"op": name, "host_us": round(best, 1), "launches": launches})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dsa_triton.bench.hostprof")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("names", nargs="*", help="only ops whose name contains one of these")
    args = parser.parse_args()
    for row in host_times(torch.device(args.device), args.names):
        print(f"{row['op']:40s} {row['host_us']:8.1f} us  ({row['launches']} launches stubbed)")


if __name__ == "__main__":
    main()
