"""``python -m model_runner``: offline batch generation from a checkpoint folder, and tiny random checkpoints.

    python -m model_runner generate --model DIR --prompts IN.jsonl --out OUT.jsonl
    python -m model_runner generate --model CONFIG.json --random-weights [--layers 4] --prompts IN.jsonl --out OUT.jsonl
    python -m model_runner make-tiny DIR [--arch deepseek_v32|glm_moe_dsa|deepseek_v4] [--experts mxfp4|bf16|fp8]
    python -m model_runner plan --model CONFIG.json [--context 1048576] [--memory-gib 80]

``generate`` prints what loading did, whether decode steps replay from CUDA graphs and the memory plan, shows a
progress bar of generated tokens and closes with the throughput of prefill, decode and mixed steps (and, with
``--profile``, where the time of one decode step and one prefill step went). File formats: :mod:`.batch_io`. Any
error is one line on stderr, exit status 2. ``--random-weights``: no checkpoint, random weights at the config's
widths for ``--layers`` layers drawn on the device (:mod:`.random_weights`); prompts are token ids, no EOS stops
them. ``--stats FILE``: the model build and generation times, throughput, each step's time and the notes as JSON.
Prompts are checked against the config before the model loads: token ids in the vocabulary, prompt + new tokens
within ``max_position_embeddings`` (else an error naming the prompt; ``--truncate left`` keeps its last tokens).
Ctrl-C ends the command with one line, "interrupted", exit status 130.

Under ``torchrun --nproc-per-node N`` ``generate`` runs expert parallel and data parallel (:mod:`.distributed`):
each rank loads its experts and runs its share of the prompts; rank 0 prints (its memory plan, every rank's
throughput and time in collectives) and writes the one output file, all prompts in order.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dsa_triton.hostmath import cdiv
from dsa_triton.runtime import default_device

from .build import build_engine, config_file
from .errors import RunnerError
from .families import read_config
from .index_path import PATHS
from .memory import bytes_per_token, config_plan, format_plan
from .sampling import SamplingParams
from .batch_io import TRUNCATE, fit_requests, read_requests, write_results
from .cache_manager import KV_CACHE_FORMATS
from .distributed import Solo, setup, share, shutdown
from .tiny import ARCHS, DEFAULT_ARCH, DENSE_FORMATS, EXPERT_FORMATS, make_tiny
from .tokenizer import eos_token_ids, load_tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
RANDOM_LAYERS = 4  # --random-weights: one dense layer and three MoE layers of a DeepSeek-V3-style config


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m model_runner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for every prompt of a JSON-lines file")
    gen.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer.json); "
                     "with --random-weights a config.json or a folder holding one")
    gen.add_argument("--random-weights", action="store_true",
                     help="no checkpoint: random weights at the config's widths, drawn on the device")
    gen.add_argument("--layers", type=int, default=None,
                     help="with --random-weights: layers of the model, the config's dense layers capped to one, "
                          f"then MoE layers (default {RANDOM_LAYERS})")
    gen.add_argument("--prompts", required=True, help="JSON lines: token ids, text, or objects with settings")
    gen.add_argument("--out", required=True, help="JSON lines written here, one per prompt")
    gen.add_argument("--mode", choices=("kernel", "reference"), default="kernel",
                     help="Triton kernels, or their pure-PyTorch references")
    gen.add_argument("--dtype", choices=DTYPES, default=None,
                     help="activation dtype (default bfloat16 on a GPU, float16 in the interpreter)")
    gen.add_argument("--index-precision", choices=("fp8", "activation"), default=None,
                     help="indexer q/k: FP8 after a Hadamard rotation (DeepSeek), or the activation dtype (HF); "
                          "default: the model family's (fp8 for V3.2 and GLM-5, activation for V4)")
    gen.add_argument("--kv-cache", choices=KV_CACHE_FORMATS, default="activation",
                     help="latent cache rows in the activation dtype, or DeepSeek's FP8 layout (656 bytes a token "
                          "for 512 + 64 instead of 1152 in bf16; dequantized inside the attention kernels)")
    gen.add_argument("--dequantize-fp8", action="store_true",
                     help="dequantize FP8 projections at load (default: keep FP8, blockwise-FP8 GEMM)")
    gen.add_argument("--max-new-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's EOS ids")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--truncate", choices=TRUNCATE, default=None,
                     help="a prompt whose tokens + new tokens exceed the model's max_position_embeddings keeps its "
                          "last tokens (left: its first tokens go; default: such a prompt is an error)")
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--max-seqs", type=int, default=16, help="sequences running at once")
    gen.add_argument("--max-seq-len", type=int, default=None, help="default: the longest prompt + its new tokens")
    gen.add_argument("--num-pages", type=int, default=None, help="default: enough for --max-seqs such sequences")
    gen.add_argument("--chunk", type=int, default=256,
                     help="token budget of a step (decode tokens and prefill chunks together)")
    gen.add_argument("--skip-checks", action="store_true", help="no per-op value checks (host syncs) in kernel mode")
    gen.add_argument("--indexer-path", choices=PATHS, nargs=2, default=("token", "token"),
                     metavar=("DECODE", "PREFILL"),
                     help=f"indexer path of decode and of prefill steps, each one of {', '.join(PATHS)} "
                          f"(auto: the tuning database's choice)")
    gen.add_argument("--no-cuda-graphs", action="store_true",
                     help="run decode steps eagerly (default: replay them from CUDA graphs where possible)")
    gen.add_argument("--profile", action="store_true",
                     help="profile one decode step and one prefill step (torch.profiler) and print the split")
    gen.add_argument("--no-progress", action="store_true")
    gen.add_argument("--stats", default=None, help="write the build and generation times, throughput by step kind "
                     "and the engine's notes here (JSON)")
    gen.add_argument("--time-collectives", action="store_true",
                     help="under torchrun: synchronize the device around each collective to time them")
    gen.set_defaults(func=generate)
    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (Hugging Face layout, tokenizer)")
    tiny.add_argument("folder")
    tiny.add_argument("--experts", choices=EXPERT_FORMATS, default="mxfp4")
    tiny.add_argument("--dense", choices=DENSE_FORMATS, default="bf16")
    tiny.add_argument("--shards", type=int, default=1, help="1: one model.safetensors; more: shards and an index")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH, help="the model family (config.json's model_type)")
    tiny.set_defaults(func=lambda args: make_tiny(args.folder, args.experts, args.dense, args.shards, args.seed,
                                                  args.arch))
    plan = sub.add_parser("plan", help="a config's cache bytes per layer type, per token and per sequence, and the "
                                       "tokens that fit in a memory (no weights loaded)")
    plan.add_argument("--model", required=True, help="a config.json or a folder holding one")
    plan.add_argument("--context", type=int, default=1 << 20, help="tokens of one sequence (default 1M)")
    plan.add_argument("--memory-gib", type=float, default=80.0, help="the memory the caches may take")
    plan.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the caches' dtype")
    plan.set_defaults(func=lambda args: print("\n".join(config_plan(
        config_file(args.model), args.context, int(args.memory_gib * 2**30), DTYPES[args.dtype]))))
    return ap


def generate(args) -> None:
    if args.layers is not None and not args.random_weights:
        raise RunnerError("--layers: only with --random-weights (a checkpoint has its layers)")
    if args.random_weights:
        if not config_file(args.model).is_file():
            raise RunnerError(f"model: {args.model} is neither a config.json nor a folder holding one")
        tokenizer, stop = None, ()
    else:
        if not Path(args.model, "config.json").is_file():
            raise RunnerError(f"model: {args.model} is not a checkpoint folder (no config.json)")
        tokenizer = load_tokenizer(args.model)
        stop = () if args.ignore_eos else eos_token_ids(args.model)
    defaults = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, stop, args.top_k)
    requests = read_requests(args.prompts, defaults, tokenizer)
    config = read_config(config_file(args.model))  # the prompts' limits, before the model loads
    positions = getattr(config, "max_position_embeddings", None)  # not every family's config names one
    truncated = fit_requests(requests, config.vocab_size, positions, args.truncate)
    parallel = setup()  # None unless launched by torchrun with more than one process
    try:
        _generate(args, requests, tokenizer, parallel, truncated)
    finally:
        shutdown()


def _generate(args, requests, tokenizer, parallel, truncated: int = 0) -> None:
    device = parallel.device if parallel else default_device()
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float16
    max_seq_len = args.max_seq_len or max(len(r.token_ids) + r.params.max_new_tokens for r in requests)
    here = len(share(len(requests), parallel or Solo()))  # this rank's prompts
    max_seqs = max(1, min(args.max_seqs, here))
    num_pages = args.num_pages or max_seqs * cdiv(max_seq_len, args.page_size)
    start = time.perf_counter()
    engine = build_engine(args.model, mode=args.mode, dtype=dtype, device=device, num_pages=num_pages,
                          page_size=args.page_size, max_seqs=max_seqs, max_seq_len=max_seq_len,
                          max_num_batched_tokens=args.chunk, seed=args.seed, check_values=not args.skip_checks,
                          index_precision=args.index_precision, dequantize_fp8=args.dequantize_fp8,
                          kv_cache=args.kv_cache, indexer_path=dict(zip(("decode", "prefill"), args.indexer_path)),
                          cuda_graphs=not args.no_cuda_graphs, profile=args.profile,
                          random_layers=(RANDOM_LAYERS if args.layers is None else args.layers)
                          if args.random_weights else None, parallel=parallel)
    build_s = time.perf_counter() - start
    lead = parallel is None or parallel.rank == 0  # the process that prints and writes
    totals = parallel.all_gather(sum(engine.memory.values())) if parallel else []
    if lead:
        ranks = f" (rank 0 of {parallel.world_size} shown)" if parallel else ""
        print(f"model {args.model}: {args.mode} mode, {str(dtype).replace('torch.', '')} on {device}, indexer "
              f"{engine.model.index_precision}, kv cache {args.kv_cache}; {len(requests)} prompts{ranks}")
        for note in engine.notes:
            print(f"note: {note}")
        if truncated:
            print(f"note: --truncate {args.truncate}: {truncated} of {len(requests)} prompts keep only their last "
                  f"tokens (max_position_embeddings)")
        print(f"cuda graphs: {engine.graphs_note}")
        print("\n".join(format_plan(engine.memory)))
        print(f"  cache bytes per token: {bytes_per_token(engine.cache)}", flush=True)
        if totals:
            print("memory plan totals by rank: " + ", ".join(f"{t / 2**20:.2f}" for t in totals) + " MiB", flush=True)
    prompts, params, names = ([r.token_ids for r in requests], [r.params for r in requests],
                              [r.name for r in requests])
    if parallel is not None:
        parallel.timed = args.time_collectives
    start = time.perf_counter()
    seqs = engine.run(prompts, params, progress=not args.no_progress, names=names)
    run_s = time.perf_counter() - start
    reports = (parallel.all_gather((engine.throughput(), dict(parallel.stats))) if parallel
               else [(engine.throughput(), None)])
    if not lead:
        return
    write_results(args.out, seqs, tokenizer)
    if args.stats:
        summary = {"build_s": build_s, "run_s": run_s, "notes": engine.notes, "cuda_graphs": engine.graphs_note,
                   "memory_mib": sum(engine.memory.values()) / 2**20,
                   "steps": [{"kind": r.kind, "tokens": r.tokens, "seconds": r.seconds} for r in engine.steps],
                   "throughput": [{kind: {"tokens": tokens, "seconds": seconds}
                                   for kind, (tokens, seconds) in throughput.items()} for throughput, _ in reports]}
        Path(args.stats).write_text(json.dumps(summary, indent=1) + "\n")
    for rank, (throughput, stats) in enumerate(reports):
        who = f"rank {rank}: " if parallel else ""
        for kind, (tokens, seconds) in throughput.items():
            print(f"{who}{kind}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds if seconds else 0:.1f} "
                  f"tokens/s)")
        if stats:
            timing = f"{stats['seconds']:.2f} s" + ("" if args.time_collectives else " (host time)")
            print(f"{who}collectives: {stats['collectives']} calls, {stats['bytes'] / 2**20:.2f} MiB sent, {timing}")
    if engine.scheduler.preemptions:
        print(f"preemptions: {engine.scheduler.preemptions} (recomputed; no token lost)")
    if engine.profiler is not None:
        print("\n".join(engine.profiler.lines()))
    print(f"wrote {len(seqs)} results to {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except (RunnerError, ValueError, OSError) as exc:  # dsa_triton's argument checks raise ValueError
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
