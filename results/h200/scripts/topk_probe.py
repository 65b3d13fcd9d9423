"""One-off H200 probe (2026-11-30, session 2): why the bench row of topk_indices at [64, 131072] (causal lengths,
block table, row_to_seq) took 131.7 us eager while topk_speed (plain scores) took 60.4 us. Times each argument
set eager (one input set and rotated sets) and in CUDA graphs. Run from the repository root."""
import torch

from dsa_triton.attention.topk import _make_inputs, topk_indices
from dsa_triton.harness import graph_time_us, rotation, time_rotating

dev = torch.device("cuda")
for T in (64, 1):
    shape = {"T": T, "L": 131072, "k": 2048}
    sets = rotation(lambda i: _make_inputs("any", shape, dev, i), 4.0 * T * 131072, dev)
    variants = {
        "plain": ("scores", "k"),
        "lengths": ("scores", "k", "lengths"),
        "table": ("scores", "k", "block_table", "page_size", "row_to_seq"),
        "lengths+table": ("scores", "k", "lengths", "block_table", "page_size", "row_to_seq"),
    }
    print(f"T={T}: {len(sets)} rotated sets")
    print("| variant | eager 1 set | eager rotated | graph rotated | torch.topk eager rotated |")
    torch_us = time_rotating(lambda s: torch.topk(s["scores"], 2048, dim=1), sets, dev)
    for name, keys in variants.items():
        call = lambda s, keys=keys: topk_indices(**{k: s[k] for k in keys}, check_values=False)
        one = time_rotating(call, sets[:1], dev)
        rot = time_rotating(call, sets, dev)
        graph = graph_time_us(call, sets, dev)
        print(f"| {name} | {one:.1f} | {rot:.1f} | {graph:.1f} | {torch_us:.1f} |", flush=True)
