"""Expert-parallel generation at DeepSeek-V3.2 layer shapes: one GPU against several (torchrun, NCCL).

    python scripts/ep_bench.py write DIR [--layers 3]            # random checkpoint: all 256 experts, MXFP4
    python -m torch.distributed.run --nproc-per-node 1 scripts/ep_bench.py run DIR --out one.json
    python -m torch.distributed.run --nproc-per-node 2 scripts/ep_bench.py run DIR --out two.json
    python scripts/ep_bench.py compare one.json two.json         # markdown table on stdout

``scripts/ep_bench.sh`` runs the four in one device call. ``write``: the V3.2 config (tuner/models/deepseek-v3.2.json)
with ``--layers`` layers (the first dense, the rest MoE with 256 MXFP4 experts, ~6 GB each) and a smaller vocabulary,
bf16 dense weights by :func:`model_runner.random_draws.random_tensor`'s rule, random MXFP4 experts by
:func:`model_runner.families.mla_dsa.random_experts`; one shard per layer. ``run``: the model runner in kernel mode
(bf16, value checks off), the same prompts on every world size (data parallel over the ranks), three passes: a
warm-up (compiles), a measured pass, and a pass with the device synchronized around every collective (their time).
Writes the tokens, each rank's prefill and decode throughput, collectives and memory plan. ``compare``: tokens equal
or not (and where they part), tokens/s per GPU against one GPU, the time in collectives.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsa_triton.runtime import default_device  # noqa: E402
from model_runner import ModelConfig, SamplingParams, build_engine, distributed, tiny_config  # noqa: E402
from model_runner.families.mla_dsa import dense_shapes, random_experts  # noqa: E402
from model_runner.loader import INDEX_FILE  # noqa: E402
from model_runner.random_draws import random_tensor  # noqa: E402

V32 = ROOT / "tuner" / "models" / "deepseek-v3.2.json"


def v32_config(layers: int, vocab: int, tiny: bool = False) -> ModelConfig:
    """DeepSeek-V3.2's layer shapes (``tiny``: the runner's tiny model, for a dry run of this script on a CPU)."""
    if tiny:
        return tiny_config(num_hidden_layers=layers, vocab_size=vocab)
    values = json.loads(V32.read_text())
    values.update(num_hidden_layers=layers, first_k_dense_replace=1, vocab_size=vocab, intermediate_size=18432,
                  rms_norm_eps=1e-6, max_position_embeddings=8192, norm_topk_prob=True, rope_theta=10000.0)
    return ModelConfig.from_dict(values)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write(args) -> None:
    from safetensors.torch import save_file

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = v32_config(args.layers, args.vocab, args.tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(args.seed)
    groups: dict[str, dict[str, tuple]] = {}
    for name, shape in dense_shapes(config).items():
        file = f"layer-{name.split('.')[2]}.safetensors" if name.startswith("model.layers.") else "trunk.safetensors"
        groups.setdefault(file, {})[name] = shape
    weight_map, start = {}, time.perf_counter()
    for file, shapes in groups.items():
        tensors = {name: random_tensor(name, shape, g).cpu() for name, shape in shapes.items()}
        layer = int(file.split("-")[1].split(".")[0]) if file.startswith("layer-") else None
        if layer is not None and config.is_moe_layer(layer):
            tensors.update({name: t.cpu() for name, t in random_experts(config, layer, g).items()})
        save_file(tensors, str(folder / file))
        weight_map.update(dict.fromkeys(tensors, file))
        print(f"wrote {file}: {sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30:.2f} GiB "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    config.to_json(folder / "config.json")
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def prompts_of(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lengths = [args.prompt_len - args.prompt_len // 16 * (i % 5) for i in range(args.prompts)]  # ragged prefill
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def run(args) -> None:
    parallel = distributed.setup()  # NCCL on cuda:LOCAL_RANK under torchrun with more than one process
    try:
        report = _run(args, parallel)
    finally:
        distributed.shutdown()
    if report is not None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


def _run(args, parallel) -> dict | None:
    config = ModelConfig.from_json(Path(args.folder) / "config.json")
    device = parallel.device if parallel else default_device()
    prompts = prompts_of(args, config.vocab_size)
    world, rank = (parallel.world_size, parallel.rank) if parallel else (1, 0)
    here = len(distributed.share(len(prompts), parallel)) if parallel else len(prompts)
    max_seq_len = args.prompt_len + args.new_tokens
    pages = -(-max_seq_len // args.page_size)
    start = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # (the interpreter: fp16)
    engine = build_engine(args.folder, mode="kernel", dtype=dtype, device=device, num_pages=here * pages,
                          page_size=args.page_size, max_seqs=here, max_seq_len=max_seq_len,
                          max_num_batched_tokens=args.chunk, check_values=False, parallel=parallel)
    load_seconds = time.perf_counter() - start
    params = [SamplingParams(max_new_tokens=args.new_tokens)] * len(prompts)
    passes = {}
    for name in ("warm-up", "measured", "collectives timed"):
        engine.steps.clear()
        if parallel:
            parallel.stats.update(collectives=0, bytes=0, seconds=0.0)
            parallel.timed = name == "collectives timed"
        synchronize(device)
        start = time.perf_counter()
        seqs = engine.run(prompts, params, progress=False)
        synchronize(device)
        wall = time.perf_counter() - start
        mine = {"throughput": engine.throughput(), "wall_s": wall,
                "collectives": dict(parallel.stats) if parallel else None}
        passes[name] = {"tokens": [s.output for s in seqs],
                        "ranks": parallel.all_gather(mine) if parallel else [mine]}
        if rank == 0:
            print(f"{name}: {wall:.2f} s; rank 0 {mine['throughput']}", flush=True)
    memory = parallel.all_gather(engine.memory) if parallel else [engine.memory]
    if rank != 0:
        return None
    return {"world_size": world, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "commit": os.environ.get("DSA_GIT_COMMIT", ""),
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "args": vars(args) | {"func": None},
            "load_s": load_seconds, "notes": engine.notes, "memory": memory,
            "same_tokens_every_pass": all(p["tokens"] == passes["warm-up"]["tokens"] for p in passes.values()),
            "passes": passes}


def per_gpu(report: dict, pass_name: str, kind: str) -> float:
    """Tokens/s per GPU: every rank's tokens over the slowest rank's seconds, divided by the GPUs."""
    ranks = report["passes"][pass_name]["ranks"]
    tokens = sum(r["throughput"][kind][0] for r in ranks)
    seconds = max(r["throughput"][kind][1] for r in ranks)
    return tokens / seconds / len(ranks) if seconds else 0.0


def compare(args) -> None:
    one, many = (json.loads(Path(f).read_text()) for f in (args.one, args.many))
    a, b = one["passes"]["measured"]["tokens"], many["passes"]["measured"]["tokens"]
    parted = [(i, next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), None)) for i, (p, q) in enumerate(zip(a, b))
              if p != q]
    print(f"## Expert parallel: {many['world_size']} GPUs vs 1 ({many['device']}, torch {many['torch']}, triton "
          f"{many['triton']}, commit {many['commit'] or '?'})\n")
    print(f"greedy tokens: {len(a) - len(parted)} of {len(a)} prompts identical"
          + (f"; parted (prompt, first token): {parted[:8]}" if parted else "") + "\n")
    print("| | 1 GPU | " + f"{many['world_size']} GPUs | per GPU ratio |\n| --- | --- | --- | --- |")
    for kind in ("prefill", "decode"):
        x, y = per_gpu(one, "measured", kind), per_gpu(many, "measured", kind)
        print(f"| {kind} tokens/s per GPU | {x:.0f} | {y:.0f} | {y / x if x else 0:.3f} |")
    for rank, r in enumerate(many["passes"]["collectives timed"]["ranks"]):
        c, steps = r["collectives"], sum(s for _, s in r["throughput"].values())
        print(f"| rank {rank}: collectives (device synchronized) | | {c['seconds']:.3f} s of {steps:.3f} s in steps "
              f"({100 * c['seconds'] / steps if steps else 0:.1f}%), {c['collectives']} calls, "
              f"{c['bytes'] / 2**20:.1f} MiB sent | |")
    for rank, plan in enumerate(many["memory"]):
        print(f"| rank {rank}: memory plan | {sum(one['memory'][0].values()) / 2**30:.2f} GiB | "
              f"{sum(plan.values()) / 2**30:.2f} GiB | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("folder")
    w.add_argument("--layers", type=int, default=3, help="the first dense, the others MoE")
    w.add_argument("--vocab", type=int, default=16384)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tiny", action="store_true", help="the runner's tiny model (a dry run on a CPU)")
    w.set_defaults(func=write)
    r = sub.add_parser("run")
    r.add_argument("folder")
    r.add_argument("--out", required=True)
    r.add_argument("--prompts", type=int, default=32)
    r.add_argument("--prompt-len", type=int, default=512)
    r.add_argument("--new-tokens", type=int, default=32)
    r.add_argument("--chunk", type=int, default=4096, help="max tokens per prefill step")
    r.add_argument("--page-size", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=run)
    c = sub.add_parser("compare")
    c.add_argument("one")
    c.add_argument("many")
    c.set_defaults(func=compare)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
