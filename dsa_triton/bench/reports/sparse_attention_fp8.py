"""Sparse decode over the FP8 latent cache against the bf16 cache, at the same shapes in the same run."""
from __future__ import annotations

import torch

from dsa_triton.attention.formats import fp8_latent_bytes
from dsa_triton.attention.sparse_attention_spec import DECODE_SPEC
from dsa_triton.bench.harness import Ceilings, rotation, timed_us
from dsa_triton.registry import shape_text

MIN_RATE_OF_BF16 = 0.45  # the FP8 cache's decode must keep at least this fraction of the bf16 cache's rate


def fp8_cache_report(device, ceilings: Ceilings | None) -> list[dict]:
    """Per decode shape (GPU: the bench's B = 64 and B = 8, 128 heads, k = 2048): each cache's launch config,
    check against its own reference, bytes read per selected token (bf16: 2 D; FP8: its row, 656 for DSA) and
    time (CUDA-graph replay on the GPU, over input sets larger than L2), then the FP8 cache's rate as a fraction of
    the bf16 cache's (``bf16_us / fp8_us``) and whether it reaches ``MIN_RATE_OF_BF16``. A failed check is the row's
    ``error``."""
    gpu = torch.device(device).type == "cuda"
    shapes = [s for s in DECODE_SPEC.bench_shapes("decode", gpu) if s["fp8"]]
    shapes = shapes[:2] if gpu else shapes[-1:]
    rows = []
    for shape in shapes:
        row, errors = {"shape": shape_text(shape)}, []
        fp8_bytes = fp8_latent_bytes(shape["Dv"], shape["D"] - shape["Dv"])
        for name, fp8, row_bytes in (("bf16", 0, 2 * shape["D"]), ("fp8", 1, fp8_bytes)):
            cache_shape = {**shape, "fp8": fp8}
            config = DECODE_SPEC.launch_config("decode", cache_shape, device)
            sets = rotation(lambda i: DECODE_SPEC.make_inputs("decode", cache_shape, device, i),
                            DECODE_SPEC.cost("decode", cache_shape).bytes, device)
            check = DECODE_SPEC.compare(DECODE_SPEC.run(sets[0], config), DECODE_SPEC.reference(sets[0]))
            errors += [f"{name}: {check}"] if check else []
            us, how = timed_us(lambda s: DECODE_SPEC.run(s, config), sets, device)
            row |= {f"{name}_config": str(config), f"{name}_bytes_per_selected_token": row_bytes,
                    f"{name}_us": us, f"{name}_timing": how}
        row["fp8_rate_of_bf16"] = row["bf16_us"] / row["fp8_us"]
        if gpu:
            row["fp8_reaches_min_rate"] = row["fp8_rate_of_bf16"] >= MIN_RATE_OF_BF16
        if errors:
            row["error"] = "; ".join(errors)
        rows.append(row)
    return rows
