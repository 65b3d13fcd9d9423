"""One sparse attention launch of ``scripts/gluon_attention.py``'s timing rows, called ``--reps`` times: the program
a profiler runs (``PROFILE_KERNEL=seesaw PROFILE_SCRIPT=scripts/attention_profile.py bash scripts/gpu_session.sh
profile --cache fp8``: Nsight Compute of the second launch).

``python scripts/attention_profile.py [--cache bf16|fp8] [--kernel triton|seesaw|seesaw:MODULE] [--rows R]
[--reps N]``: R index rows of 128 heads, k = 2048 over a 128K-slot cache, at the script's config for the kernel.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gluon_attention import config_for, make_inputs, runner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--kernel", default="seesaw")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    fp8 = args.cache == "fp8"
    q, kv, slots = make_inputs(args.rows, 1, 128, 2048, 131072, 7, odd=False, fp8=fp8)
    config = config_for(args.kernel, args.rows, 128, 2048, fp8=fp8)
    call = runner(args.kernel, q, kv, slots, config)
    for _ in range(args.reps):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
