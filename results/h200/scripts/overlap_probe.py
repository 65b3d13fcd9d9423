"""H200 probe (session 6 of 2026-11-30): the prefill GEMM's workspace route at T = 16384, the conversion on a side
stream (OVERLAP=1) or on the main stream (0), at the stored stage size, half and double it. Times each variant with
the tuner's evaluator (checked against the reference first), then lets the tuner's ``finalize`` re-time the three
fastest with the default and the baseline in one run and stores that record in the database ($DSA_TUNING_DB).
Prints a table; run from the repository root on the GPU (on the CPU: ``--cpu``, tiny shapes, nothing stored)."""
import sys

import torch

from dsa_triton.moe.fp8_grouped_gemm import SPEC
from tuner.objective import Evaluator
from tuner.tune import finalize
from tuning_db.database import Database
from tuning_db.records import config_text

GPU_SHAPES = [{"M": 131072, "E": 256, "N": 4096, "K": 7168}, {"M": 131072, "E": 256, "N": 7168, "K": 2048}]
CPU_SHAPES = [{"M": 600, "E": 2, "N": 64, "K": 256}]


def variants(stored: dict, shape: dict) -> list[dict]:
    stage = stored["EXPERTS_PER_STAGE"]
    out = [{**stored, "EXPERTS_PER_STAGE": s, "OVERLAP": o} for s in (stage, stage // 2, stage * 2) for o in (1, 0)]
    return [c for c in out if SPEC.is_valid(c, shape)]


def main(cpu: bool) -> None:
    dev = torch.device("cpu" if cpu else "cuda")
    budget = (0, 1, 0, 1) if cpu else (10, 40, 25, 100)
    db = Database()
    print("| gemm | config | us | vs stored |")
    print("|---|---|---|---|")
    for shape in CPU_SHAPES if cpu else GPU_SHAPES:
        name = "gate_up" if shape["K"] > shape["N"] else "down"
        stored = SPEC.launch_config("prefill", shape, dev)
        if stored["IN_REGISTERS"]:  # OVERLAP is a workspace-route knob
            stored = {**stored, "IN_REGISTERS": 0, "W_SMEM": 0, "UNROLL": 1, "ROW_SCALED": 1}
        evaluator = Evaluator(SPEC, "prefill", shape, dev, budget[0], budget[1])
        configs = variants(stored, shape)
        failed = {config_text(c): evaluator.check(c) for c in configs}
        configs = [c for c in configs if failed[config_text(c)] is None]
        times = evaluator.time_all(configs, budget[0], budget[1])
        base = times[0]
        for c, t in zip(configs, times):
            print(f"| {name} | {config_text(c)} | {t:.1f} | {base / t:.3f} |", flush=True)
        for text, outcome in failed.items():
            if outcome is not None:
                print(f"| {name} | {text} | failed: {outcome.detail[:120]} | - |")
        ranked = sorted(zip(configs, times), key=lambda ct: ct[1])
        record = finalize(evaluator, ranked, len(configs), budget[2], budget[3])
        print(f"record {name}: {record.config} {record.median_us} us, default {record.default_us}, "
              f"baseline {record.baseline_us} ({record.timing})", flush=True)
        if not cpu:
            db.add([record])
        del evaluator


if __name__ == "__main__":
    main("--cpu" in sys.argv)
