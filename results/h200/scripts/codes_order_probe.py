"""H200 probe for the next step on the prefill registers route (NOTES, "Next GPU session"): what do the scattered
16-bit shared-memory reads of the MXFP4 codes cost? A variant of ``_fused_gemm_kernel`` reads each row's 32
quarters of a 128-k group as if repacked thread-major (``reshape [N, 4, 8] -> permute -> reshape``: 8 shared
loads a step instead of 36 in the sm_90 SASS), built from the kernel's own source with that one line added and
swapped into the module for the timed calls. On the natural-order weights used here its result is wrong (the
relative error column shows it): the timing is the point. If it is much faster, build the repack. Prints a table;
run from the repository root (on the CPU: tiny shapes in the interpreter, to check that the probe runs)."""
import importlib
import importlib.util
import inspect
import sys
import tempfile
import textwrap

import torch

from dsa_triton.harness import time_us
from dsa_triton.moe.fp8_grouped_gemm import SPEC, fp8_grouped_gemm, route_config
from dsa_triton.moe.mxfp4 import realistic_mxfp4
from dsa_triton.moe.prefill_report import routed_rows

# the registers route's default tile when this probe and occupancy_probe ran (session 5; 128 x 128 since session 6)
SESSION5_TILE = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}

gemm_module = importlib.import_module("dsa_triton.moe.fp8_grouped_gemm")  # (dsa_triton.moe's name is the op)

ANCHOR = "        d = tl.minimum(ref[:, None] - s.to(tl.int32), 11)"
PERMUTED = "        codes = tl.reshape(tl.permute(tl.reshape(codes, [BLOCK_N, 4, 8]), (0, 2, 1)), [BLOCK_N, 32])\n"


def variant_kernel():
    """``_fused_gemm_kernel`` with the thread-major read of the codes, compiled from a temporary module."""
    source = inspect.getsource(gemm_module._fused_gemm_kernel.fn)
    assert source.count(ANCHOR) == 1, "the kernel changed: update the probe's anchor line"
    header = textwrap.dedent("""\
        import triton
        import triton.language as tl
        from dsa_triton.moe.convert import e4m3_words, reference_scale, words_to_fp8
        from dsa_triton.moe.fp8_grouped_gemm import _tile
        """)
    path = tempfile.NamedTemporaryFile("w", suffix="_codes_order.py", delete=False)
    path.write(header + "\n\n" + source.replace(ANCHOR, PERMUTED + ANCHOR))  # the source keeps its @triton.jit
    path.close()
    spec = importlib.util.spec_from_file_location("codes_order_variant", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module._fused_gemm_kernel


def main() -> None:
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    cases = [("gate_up", 4096, 4096, 7168), ("down", 4096, 7168, 2048)] if gpu else [("gate_up", 40, 128, 256)]
    experts = 256 if gpu else 3
    kernels = {"natural": gemm_module._fused_gemm_kernel, "thread-major read": variant_kernel()}
    print("| gemm | T | kernel | us | rel err vs natural |")
    print("|---|---|---|---|---|")
    for name, t, n, k in cases:
        offsets, x = routed_rows(t, experts, 8 if gpu else 2, k, dev, t + n, torch.bfloat16 if gpu else torch.float16)
        blocks, scales = realistic_mxfp4((experts, n), k, dev, seed=1, outliers=0.0)
        shape = {"M": x.shape[0], "E": experts, "N": n, "K": k}
        config = {**route_config(SPEC.launch_config("prefill", shape, dev), 1), **SESSION5_TILE}
        config = SPEC.validate(config if SPEC.is_valid(config, shape) else {**config, "BLOCK_M": 16, "BLOCK_N": 64,
                                                                              "num_stages": 2}, shape)
        reference = None
        for label, kernel in kernels.items():
            gemm_module._fused_gemm_kernel = kernel
            try:
                y = fp8_grouped_gemm(x, offsets, blocks, scales, config=config).float()
                reference = y if reference is None else reference
                err = float((y - reference).norm() / reference.norm())
                us = time_us(lambda: fp8_grouped_gemm(x, offsets, blocks, scales, config=config), dev) if gpu \
                    else float("nan")
            finally:
                gemm_module._fused_gemm_kernel = kernels["natural"]
            print(f"| {name} | {t} | {label} | {us:.1f} | {err:.3g} |", flush=True)


if __name__ == "__main__":
    main()
