"""Small-batch sparse decode latency (B = 1, 8): eager and CUDA-graph time against the selected rows' byte floor."""
from __future__ import annotations

import torch

from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC as SPEC
from dsa_triton.bench.harness import Ceilings, floor_us, graph_us, rotation, time_rotating
from dsa_triton.registry import shape_text


def decode_latency_report(device, ceilings: Ceilings | None) -> list[dict]:
    """Small-batch decode (B = 1, 8) against the byte floor (bytes / copy rate): eager calls (host overhead
    included) and the same calls replayed from a CUDA graph (kernels only), over input sets larger than L2."""
    gpu = torch.device(device).type == "cuda"
    base = SPEC.bench_shapes("decode", gpu)[0 if gpu else -1]
    rows = []
    for B in (1, 8) if gpu else (1, 2):
        shape = {**base, "B": B}
        cost = SPEC.cost("decode", shape)
        config = SPEC.launch_config("decode", shape, device)
        sets = rotation(lambda i: SPEC.make_inputs("decode", shape, device, i), cost.bytes, device)
        row = {"shape": shape_text(shape), "config": str(config),
               "bytes_MB": cost.bytes / 1e6,
               "eager_us": time_rotating(lambda s: SPEC.run(s, config), sets, device),
               "graph_us": graph_us(lambda: [SPEC.run(s, config) for s in sets], device) / len(sets)}
        if ceilings is not None:
            byte_floor = cost.bytes / (ceilings.copy_tbps * 1e12) * 1e6
            floor, bound = floor_us(cost, ceilings)
            row |= {"byte_floor_us": byte_floor, "graph_of_byte_floor": byte_floor / row["graph_us"],
                    "eager_of_byte_floor": byte_floor / row["eager_us"], "floor_us": floor, "bound": bound}
        rows.append(row)
    return rows
