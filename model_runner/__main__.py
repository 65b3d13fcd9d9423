"""``python -m model_runner --config config.json --checkpoint folder --prompts 1,2,3 4,5``: greedy (or sampled)
generation for token-id prompts. Without ``--checkpoint`` a tiny random model is written to a temporary folder
(so it runs on a CPU in the Triton interpreter)."""
from __future__ import annotations

import argparse
import tempfile

import torch

from dsa_triton.runtime import default_device

from . import ModelConfig, SamplingParams, build_engine, save_random_checkpoint, tiny_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model_runner", description=__doc__)
    ap.add_argument("--config", help="config.json (default: the checkpoint's, else a tiny random model)")
    ap.add_argument("--checkpoint", help="folder with model.safetensors.index.json and shards")
    ap.add_argument("--prompts", nargs="+", default=["1,2,3,4,5,6,7,8,9,10,11,12", "5,4,3"],
                    help="token-id prompts, comma separated")
    ap.add_argument("--mode", choices=("kernel", "reference"), default="kernel")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--eos", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256, help="max tokens per prefill step")
    ap.add_argument("--skip-checks", action="store_true", help="no per-op value checks (host syncs) in kernel mode")
    args = ap.parse_args(argv)

    device = default_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # interpreter: no bf16 tl.dot
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if args.config:
            config = ModelConfig.from_json(args.config)
        elif checkpoint:
            config = ModelConfig.from_json(f"{checkpoint}/config.json")
        else:
            config = tiny_config()
        if checkpoint is None:
            save_random_checkpoint(config, tmp, seed=args.seed)
            checkpoint = tmp
        engine = build_engine(config, checkpoint, mode=args.mode, dtype=dtype, device=device,
                              num_pages=args.num_pages, page_size=args.page_size, max_seqs=len(args.prompts),
                              max_seq_len=args.max_seq_len, max_num_batched_tokens=args.chunk, seed=args.seed,
                              check_values=not args.skip_checks)
        prompts = [[int(t) for t in p.split(",")] for p in args.prompts]
        params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.eos)
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            print(f"{','.join(map(str, prompt))} -> {','.join(map(str, out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
