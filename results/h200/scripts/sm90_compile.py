"""Compile kernels for the H200 (sm_90) on a machine without a GPU: Triton's bundled ptxas turns them into cubins,
so lowering errors, shared memory and SASS show before a GPU session. Run from the repository root:
``python results/h200/scripts/sm90_compile.py``. Used on 2026-11-30 (session 2) for the kernels written without a
GPU (moe routing, moe permutation, top-k's score histogram) and to check that top-k's default kernels kept the
SASS that was measured (identical instruction for instruction to commit 4d53b4d's)."""
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter's (set before dsa_triton loads)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """``fn`` (a ``@triton.jit`` kernel) compiled for sm_90: ``types`` maps each runtime argument to a Triton type
    string (``"*fp32"``, ``"i32"``...), ``constexprs`` the constexpr arguments to values."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs), target=H200,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass(kernel) -> list[str]:
    """The SASS instructions of a compiled kernel (cuobjdump, bundled with Triton)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [line.split("/*")[2].split(";")[0].strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def main() -> None:
    from dsa_triton.attention.topk import _topk_bound_kernel
    from dsa_triton.moe.permute_kernel import _permute_kernel
    from dsa_triton.moe.routing_kernel import _route_kernel

    ints = lambda fn: {name: "i32" for name in fn.arg_names}
    route_types = {**ints(_route_kernel), "logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
                   "ids_ptr": "*i32", "scale": "fp32"}
    permute_types = {**ints(_permute_kernel), "weights_ptr": "*fp32", "weight_ptr": "*fp32",
                     **{n: "*i32" for n in _permute_kernel.arg_names if n.endswith("_ptr") and "weight" not in n}}
    bound_types = {**ints(_topk_bound_kernel), "scores": "*fp32", "lengths": "*i32", "work": "*i32"}
    cases = [
        (_route_kernel, route_types, dict(SOFTMAX=0, HAS_BIAS=1, GROUPED=1, NORM=1, GROUPS=8, GROUP_BLOCK=32,
                                          K_BLOCK=8, TOKENS=1), 1),
        (_route_kernel, route_types, dict(SOFTMAX=1, HAS_BIAS=0, GROUPED=0, NORM=1, GROUPS=1, GROUP_BLOCK=128,
                                          K_BLOCK=4, TOKENS=4), 1),
        (_permute_kernel, permute_types, dict(WEIGHTS=2, ALIGN=1, M_BLOCK=16, E_BLOCK=256, PAD_BLOCK=8,
                                              TAIL_BLOCK=128, STEPS=5), 1),
        (_permute_kernel, permute_types, dict(WEIGHTS=2, ALIGN=1, M_BLOCK=4096, E_BLOCK=256, PAD_BLOCK=8,
                                              TAIL_BLOCK=1024, STEPS=13), 16),
        (_topk_bound_kernel, bound_types, dict(HAS_LENGTHS=1, GROUP=16, COLS=512, HIST_BITS=8, SCORE_HIST=1), 4),
    ]
    for fn, types, constexprs, warps in cases:
        kernel = compile_sm90(fn, types, constexprs, num_warps=warps)
        print(f"{fn.__name__} {constexprs} warps={warps}: {len(sass(kernel))} SASS instructions, "
              f"{kernel.metadata.shared} B shared")


if __name__ == "__main__":
    main()
