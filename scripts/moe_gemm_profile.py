"""One MoE prefill GEMM case of the ``moe_prefill`` report, called ``--reps`` times: the program a profiler runs
(``ncu --kernel-name regex:_fused_gemm_kernel --launch-skip 1 --launch-count 1 python scripts/moe_gemm_profile.py``;
``gpu_session.sh profile`` does so).

``python scripts/moe_gemm_profile.py [--gemm gate_up|down] [--tokens T] [--config JSON] [--reps N]``: T tokens routed
to 8 of 256 experts as the report routes them, the default config unless ``--config`` lays entries over it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_triton.bench.reports.moe_prefill import routed_rows  # noqa: E402
from dsa_triton.moe.fp8_grouped_gemm import fp8_grouped_gemm  # noqa: E402
from dsa_triton.moe.fp8_grouped_gemm_spec import SPEC  # noqa: E402
from dsa_triton.moe.mxfp4_spec import realistic_mxfp4  # noqa: E402

SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}  # (N, K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gemm", choices=sorted(SHAPES), default="gate_up")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--config", default="{}", help="JSON entries laid over the default config")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda")
    n, k = SHAPES[args.gemm]
    offsets, x = routed_rows(args.tokens, 256, 8, k, device, args.tokens + n)
    blocks, scales = realistic_mxfp4((256, n), k, device, seed=1, outliers=0.0)
    shape = {"M": x.shape[0], "E": 256, "N": n, "K": k}
    config = {**SPEC.launch_config("prefill", shape, device), **json.loads(args.config)}
    print("config", json.dumps(config), flush=True)
    for _ in range(args.reps):
        fp8_grouped_gemm(x, offsets, blocks, scales, config=config, check_values=False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
