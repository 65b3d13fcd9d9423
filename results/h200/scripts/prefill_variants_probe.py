"""H200 probe (session 6 of 2026-11-30; ``overlap_probe.py`` for its first three calls): variants of the prefill
grouped GEMM's config around the stored one, each checked against the reference and timed with the tuner's
evaluator, then the tuner's ``finalize`` re-times the three fastest with the default and the baseline in one run
and the record goes to the database ($DSA_TUNING_DB). Modes:

- ``overlap``: the row-scaled workspace route at T = 16384, the conversion on a side stream (OVERLAP=1) or on the
  main stream (0), at the stored stage size, half and double it;
- ``routes``: T = 16384, the stored config, it with OVERLAP flipped, and the registers route at the two tiles
  that won T = 4096 (timed over 100 ms a config instead of 40: the two routes were within a few percent);
- ``tiles``: the registers route at T = 4096 with the tiles the session-4 sweep left out
  or lost with before the interleaved k order (128 x 128 / 4 warps won gate_up T=4096 in session 6's re-tune).

Prints a table; run from the repository root on the GPU (on the CPU: ``--cpu``, tiny shapes, nothing stored)."""
import sys

import torch

from dsa_triton.moe.fp8_grouped_gemm import SPEC, route_config
from tuner.objective import Evaluator
from tuner.tune import finalize
from tuning_db.database import Database
from tuning_db.records import config_text

GATE_UP, DOWN = {"E": 256, "N": 4096, "K": 7168}, {"E": 256, "N": 7168, "K": 2048}
SHAPES = {"overlap": [{"M": 131072, **GATE_UP}, {"M": 131072, **DOWN}],
          "tiles": [{"M": 32768, **GATE_UP}, {"M": 32768, **DOWN}],
          "routes": [{"M": 131072, **GATE_UP}, {"M": 131072, **DOWN}]}
CPU_SHAPES = [{"M": 600, "E": 2, "N": 64, "K": 256}]
TILES = [(64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4), (64, 256, 8), (128, 256, 8)]


def overlap_variants(stored: dict) -> list[dict]:
    stage = stored["EXPERTS_PER_STAGE"]
    return [{**stored, "EXPERTS_PER_STAGE": s, "OVERLAP": o} for s in (stage, stage // 2, stage * 2) for o in (1, 0)]


def tile_variants(stored: dict, tiles=TILES) -> list[dict]:
    base = route_config(stored, 1)
    return [{**base, "BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st, "UNROLL": 1, "W_SMEM": 0}
            for m, n, w in tiles for st in (3, 4)]


def route_variants(stored: dict) -> list[dict]:
    flipped = [{**stored, "OVERLAP": 1 - stored["OVERLAP"]}] if not stored["IN_REGISTERS"] else []
    return flipped + tile_variants(stored, [(128, 128, 4), (128, 256, 8)])


def main(mode: str, cpu: bool) -> None:
    dev = torch.device("cpu" if cpu else "cuda")
    budget = (0, 1, 0, 1) if cpu else (10, 100 if mode == "routes" else 40, 25, 100)
    db = Database()
    print("| gemm | M | config | us | vs stored |")
    print("|---|---|---|---|---|")
    for shape in CPU_SHAPES if cpu else SHAPES[mode]:
        name = "gate_up" if shape["K"] > shape["N"] else "down"
        stored = SPEC.launch_config("prefill", shape, dev)
        if mode == "overlap":
            if stored["IN_REGISTERS"]:  # OVERLAP is a workspace-route knob
                stored = route_config(stored, 0, row_scaled=1)
            variants = overlap_variants(stored)
        else:
            variants = route_variants(stored) if mode == "routes" else tile_variants(stored)
        configs = [stored] + [c for i, c in enumerate(variants) if c != stored and c not in variants[:i]]
        configs = [c for c in configs if SPEC.is_valid(c, shape)]
        evaluator = Evaluator(SPEC, "prefill", shape, dev, budget[0], budget[1])
        failed = {config_text(c): evaluator.check(c) for c in configs}
        configs = [c for c in configs if failed[config_text(c)] is None]
        times = evaluator.time_all(configs, budget[0], budget[1])
        for c, t in zip(configs, times):
            print(f"| {name} | {shape['M']} | {config_text(c)} | {t:.1f} | {times[0] / t:.3f} |", flush=True)
        for text, outcome in failed.items():
            if outcome is not None:
                print(f"| {name} | {shape['M']} | {text} | failed: {outcome.detail[:120]} | - |")
        ranked = sorted(zip(configs, times), key=lambda ct: ct[1])
        record = finalize(evaluator, ranked, len(configs), budget[2], budget[3])
        print(f"record {name} M={shape['M']}: {record.config} {record.median_us} us, default {record.default_us}, "
              f"baseline {record.baseline_us} ({record.timing})", flush=True)
        if not cpu:
            db.add([record])
        del evaluator


if __name__ == "__main__":
    modes = [m for m in SHAPES if m in sys.argv[1:]]
    main(modes[0] if modes else "overlap", "--cpu" in sys.argv)
