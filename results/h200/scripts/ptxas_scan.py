"""ptxas's view of the wgmma kernels at their GPU default configs, on the dev CPU (no GPU): the launches of a few
GPU bench shapes are recorded in the interpreter without running them (:func:`dsa_triton.aot.record_launches`),
then compiled for sm_90 in a second process with registers, spills, performance advisories (C7515: wgmma
serialized) and the SASS's wgmma / ARRIVE / DEPBAR counts. Session 3 of 2026-11-30: no advisory for the sparse
attention and indexer kernels; the MoE registers route's advisory is pinned by tests/test_sm90_compile.py.
Run from the repository root: ``python results/h200/scripts/ptxas_scan.py``."""
import torch

import dsa_triton  # noqa: F401  (registers the kernels; the interpreter is on without a GPU)
from dsa_triton import aot, registry

CASES = [("sparse_attention_decode", "decode", 1), ("sparse_attention_prefill", "prefill", 0),
         ("indexer_logits", "prefill", 0), ("indexer_logits", "decode", 0), ("indexer_block_path", "decode", 0)]


def main() -> None:
    records = []
    for name, phase, index in CASES:
        spec = registry.get(name)
        shape = spec.bench_shapes(phase, True)[index]
        with aot.record_launches(execute=False) as recorded:
            try:
                spec.run(spec.make_inputs(phase, shape, torch.device("cpu"), 0), spec.default(phase, shape))
            except (IndexError, RuntimeError, ValueError):  # host code read an output the skipped launch left
                pass
        records += recorded
    print("| kernel | warps | stages | constexprs | registers | spill B | GMMA | ARRIVE | DEPBAR | advisories |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for record, info in zip(records, aot.compile_in_subprocess(records, info=True)):
        constexprs = {k: v for k, v in record["values"].items() if k.isupper()}
        print(f"| {record['kernel']} | {record['num_warps']} | {record['num_stages']} | {constexprs} | "
              f"{info.get('registers')} | {info.get('spill_bytes')} | {info.get('gmma')} | {info.get('arrive')} | "
              f"{info.get('depbar')} | {info.get('advisories') or info['error'] or 'none'} |")


if __name__ == "__main__":
    main()
