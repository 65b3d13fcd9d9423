"""Compile this session's GPU-unrun kernels for the H200 (sm_90) on the dev CPU and count their SASS
(:mod:`dsa_triton.aot`; tests/test_sm90_compile.py does the same for every kernel the CPU bench shapes launch).
Used on 2026-11-30 (session 2) for the moe routing and permutation kernels and top-k's score histogram, and to
check that top-k's default kernels kept the SASS that was measured (identical, instruction for instruction, to
commit 4d53b4d's). Run from the repository root: ``python results/h200/scripts/sm90_compile.py``."""
import os

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, not the interpreter's (before dsa_triton loads)

from dsa_triton import aot  # noqa: E402
from dsa_triton.attention import topk  # noqa: E402
from dsa_triton.moe import permute_kernel, routing_kernel  # noqa: E402


def record(fn, types, values, num_warps):
    ints = {name: "i32" for name in fn.arg_names}
    return {"module": fn.fn.__module__, "kernel": fn.fn.__name__, "types": {**ints, **types}, "values": values,
            "aligned": list(types), "num_warps": num_warps, "num_stages": 3}  # pointers 16-byte aligned


def main() -> None:
    route_types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                   "scale": "fp32"}
    permute_fn = permute_kernel._permute_kernel
    permute_types = {n: "*fp32" if "weight" in n else "*i32" for n in permute_fn.arg_names if n.endswith("_ptr")}
    bound_types = {"scores": "*fp32", "lengths": "*i32", "work": "*i32"}
    cases = [
        record(routing_kernel._route_kernel, route_types, dict(SOFTMAX=0, HAS_BIAS=1, GROUPED=1, NORM=1, GROUPS=8,
                                                               GROUP_BLOCK=32, K_BLOCK=8, TOKENS=1), 1),
        record(routing_kernel._route_kernel, route_types, dict(SOFTMAX=1, HAS_BIAS=0, GROUPED=0, NORM=1, GROUPS=1,
                                                               GROUP_BLOCK=128, K_BLOCK=4, TOKENS=4), 1),
        record(permute_fn, permute_types, dict(WEIGHTS=2, ALIGN=1, M_BLOCK=16, E_BLOCK=256, PAD_BLOCK=8,
                                               TAIL_BLOCK=128, STEPS=5), 1),
        record(permute_fn, permute_types, dict(WEIGHTS=2, ALIGN=1, M_BLOCK=4096, E_BLOCK=256, PAD_BLOCK=8,
                                               TAIL_BLOCK=1024, STEPS=13), 16),
        record(topk._topk_bound_kernel, bound_types, dict(HAS_LENGTHS=1, GROUP=16, COLS=512, HIST_BITS=8,
                                                          SCORE_HIST=1), 4),
    ]
    for case in cases:
        kernel = aot.compile_for(case)
        constexprs = {k: v for k, v in case["values"].items() if k.isupper()}
        print(f"{case['kernel']} {constexprs} warps={case['num_warps']}: {len(aot.sass(kernel))} SASS instructions, "
              f"{kernel.metadata.shared} B shared")


if __name__ == "__main__":
    main()
