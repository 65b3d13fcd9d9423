"""End-to-end speed of the model runner at DeepSeek-V3.2 layer widths (random weights), written as a results file;
``--model CONFIG.json`` measures another family's config instead (DeepSeek-V4-Flash; every part but preemption).

Model: hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, indexer 64 x 128 with top-k 2048, 256 MXFP4
experts top-8 in 8 groups (4 chosen) + 1 shared, 1 dense + 3 MoE layers, vocabulary 129280, bf16, 64-token pages,
kernel mode with value checks off. Weights are drawn on the device (:mod:`model_runner.random_weights`, no
checkpoint file); caches are filled with the append op (random latent rows and indexer keys), not by a prefill.
With ``--model``: the config's widths with ``--layers`` layers (default 3; the family's ``reduced`` picks them: for
V4 one sliding-window, one CSA and one HCA layer, the first hash-routed, the others top-k routed), built through the
family as ``python -m model_runner generate --random-weights`` builds it; its caches (V4: the window's last tokens
with the compressors' inputs, every CSA / HCA entry and indexer key) are filled with random rows at the slots the
cache manager gives them, the sequences grown and placed through it (:func:`fill_streams`); the per-op split has no
floors (they are the V3.2 ops' costs). Results: ``runner_bench-<config name>-<part>-...``.

Parts (``--part``, several allowed; each writes ``runner_bench-<part>-<device>-<date>.json|md`` under ``--out``):

- ``decode``: contexts ``--contexts`` (4K, 32K, 128K) x batches ``--batches`` (1, 8, 64, 128): tokens/s of decode
  steps replayed from CUDA graphs (the engine's whole step: host preparation, replay, greedy sampling), the replay's
  GPU time against the sum of its kernels' GPU times (profiled), eager steps and a reference-mode step (batches up to
  8) for comparison, graph logits against an eager step of the same tokens, the replay's mean GPU time
  (``replay_ms``, with its min and max; against the kernels' GPU time a replay over as many profiled replays;
  ``replays_bitwise_equal``: whether two replays of the same inputs gave the same logits), and the per-op split with
  each op's
  fraction of its floor (bytes over the copy bandwidth or FLOPs over the matmul rate, measured in the same run; the
  MoE layers' expert bytes those of the experts an eager step reached, ``active_experts`` a layer: with uniform
  routing's count, 222 of 256 at batch 64, the MoE showed 1.30 of its floor on the H200; random weights reach 133,
  and the MoE 0.74 of that floor);
- ``decode-1m``: the same at batch 1 and a 1,048,576-token context;
- ``prefill``: one 4K and one 16K prompt in ``--chunk``-token steps: tokens/s (timed without the profiler), the
  per-op split of the first chunk (from a profiled warm-up run), a reference-mode run of the 4K prompt (512-token
  chunks);
- ``preemption``: 256 requests of mixed lengths through a cache smaller than their tokens, against a cache that
  holds them all, on a small model of the same structure: reference mode (fp32: every token equal) and kernel mode
  (bf16: equal tokens counted; where a request's tokens part, the logit gap of the two tokens in the large-cache
  run, so a near-tie shows as one, against the largest logit difference of the two runs where they share a prefix:
  the two schedules batch differently, so bf16 sums round differently; and the large-cache run repeated, to show
  that one schedule reproduces its own tokens).

Run on the GPU machine (each call well under 10 minutes; ``--budget-s`` stops a part early with a note):

    python scripts/runner_bench.py --part decode --contexts 4096 32768 --out $OUT
    python scripts/runner_bench.py --part decode --contexts 131072 --out $OUT
    python scripts/runner_bench.py --part decode-1m prefill --out $OUT
    python scripts/runner_bench.py --part preemption --out $OUT
    python scripts/runner_bench.py --model model_runner/configs/deepseek-v4-flash.json --part decode \\
        --contexts 32768 1048576 --batches 1 64 --out $OUT

A (context, batch) whose caches the memory plan (:func:`model_runner.memory.memory_plan`, plus ``HEADROOM``) puts
over the GPU's free memory is skipped with a note. ``--tiny`` runs every part on a tiny model at tiny sizes (with
``--model``: its family's tiny config; the CPU check of this script; no numbers to keep).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsa_triton as dt  # noqa: E402
from dsa_triton import registry  # noqa: E402
from dsa_triton.attention.cache import page_items  # noqa: E402
from dsa_triton.bench.harness import floor_us, measure_ceilings  # noqa: E402
from dsa_triton.bench.results import write_results  # noqa: E402
from dsa_triton.hostmath import cdiv  # noqa: E402
from dsa_triton.moe.fused_moe_gemm_spec import expected_active_experts  # noqa: E402
from dsa_triton.registry import Cost  # noqa: E402
from model_runner import RopeConfig, tiny_config  # noqa: E402
from model_runner.build import config_file  # noqa: E402
from model_runner.cache_manager import CacheManager  # noqa: E402
from model_runner.cuda_graphs import DecodeGraphs  # noqa: E402
from model_runner.engine import Engine  # noqa: E402
from model_runner.families import family_of, read_config  # noqa: E402
from model_runner.memory import memory_plan  # noqa: E402
from model_runner.ops import KernelOps, ReferenceOps  # noqa: E402
from model_runner.profiling import StepProfiler, profile_call  # noqa: E402
from model_runner.random_weights import random_weights, reduced  # noqa: E402
from model_runner.sampling import SamplingParams, sample  # noqa: E402
import model_runner.engine as engine_module  # noqa: E402

PAGE = 64
FILL_CHUNK = 1 << 16  # tokens a fill grows a sequence by at a time (a window's pages: sized for it)
HEADROOM = 3 << 30  # bytes beyond the memory plan a shape needs: activations, graph pools, the allocator's slack
YARN = RopeConfig(theta=10000.0, type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                  beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def v32_config(layers: int = 4):
    return tiny_config(vocab_size=129280, hidden_size=7168, num_hidden_layers=layers, first_k_dense_replace=1,
                       intermediate_size=18432, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                       n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5, norm_topk_prob=True, index_n_heads=64, index_head_dim=128,
                       index_topk=2048, rms_norm_eps=1e-6, max_position_embeddings=163840, rope=YARN)


def small_config():
    """The preemption part's model: every structural feature, small widths."""
    return tiny_config(vocab_size=2048, hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1,
                       intermediate_size=512, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64,
                       qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=16,
                       num_experts_per_tok=4, moe_intermediate_size=128, n_group=4, topk_group=2,
                       index_n_heads=8, index_head_dim=64, index_topk=64)


def model_config(args):
    """The config measured: ``--model``'s with ``--layers`` layers (default 3) at every width, else
    :func:`v32_config` (default 4 layers); ``--tiny``: that family's tiny config."""
    if args.model is None:
        return tiny_config() if args.tiny else v32_config(args.layers or 4)
    config = read_config(config_file(args.model))
    return family_of(config).tiny_config() if args.tiny else reduced(config, args.layers or 3)


def build_model(c, dtype, device, ops, seed=0):
    """``c``'s model of its family with random weights (its default indexer precision)."""
    family = family_of(c)
    return family.build_model(c, random_weights(c, dtype, device, seed), ops,
                              index_precision=family.index_precisions[0])


def build_cache(c, seqs: int, tokens: int, dtype, device) -> CacheManager:
    """Caches (``c``'s family's layout) for ``seqs`` sequences of up to ``tokens`` tokens, pages of ``PAGE``;
    ``device`` "meta": their sizes only (the memory plan), nothing allocated."""
    family = family_of(c)
    layout = family.cache_layout(c, index_precision=family.index_precisions[0], kv_cache="activation",
                                 step_tokens=FILL_CHUNK)
    return CacheManager(c, seqs * cdiv(tokens, PAGE) + 2, PAGE, seqs, tokens, dtype, device, layout=layout)


def fill(cache: CacheManager, seqs: list[int], length: int, margin: int, seed: int = 1, chunk_pages: int = 1024):
    """Sequences ``seqs`` hold ``length`` random tokens in every layer (the append op, page by page) and pages for
    ``margin`` more."""
    g = torch.Generator(cache.device).manual_seed(seed)
    c_latent = cache.layers[0].kv.shape[-1]
    c_index = cache.layers[0].ik.shape[-1]
    for s in seqs:
        cache.grow(s, length + margin)
        pages = cache.pages(s)[:cdiv(length, cache.page_size)]
        for first in range(0, len(pages), chunk_pages):
            part = pages[first:first + chunk_pages]
            start = first * cache.page_size
            n = min(len(part) * cache.page_size, length - start)
            items = torch.tensor(page_items(0, start, n, pages, cache.page_size), dtype=torch.int32,
                                 device=cache.device)
            for layer in cache.layers:
                kv = torch.randn(n, c_latent, generator=g, device=cache.device).to(layer.kv.dtype)
                ik = torch.randn(n, c_index, generator=g, device=cache.device)
                dt.append_tokens(layer.kv, layer.ik, layer.ik_scale, layer.summaries, kv, ik, items,
                                 check_values=False)
        cache.place([(s, length)])


def fill_streams(cache: CacheManager, seqs: list[int], length: int, seed: int = 1):
    """:func:`fill` for a layout of streams (DeepSeek-V4's: ``layout.widths(layer)`` ``{array: (stream, width)}``):
    sequences ``seqs`` are grown and placed ``FILL_CHUNK`` tokens at a time (a window gives its pages back as they
    go), then every entry a step at ``length`` reads gets random rows: each stream's from its first read on (the
    window: the last ``keep`` tokens' rows and compressor inputs; the compressed streams: every entry and indexer
    key), at the slots of the stream's block table; the window's pages no step reads are given back, and a page
    added (decode steps grow the sequences as they go: the window keeps a few pages a sequence, not a margin)."""
    g = torch.Generator(cache.device).manual_seed(seed)
    P = cache.page_size
    for s in seqs:
        for start in range(0, length, FILL_CHUNK):
            n = min(FILL_CHUNK, length - start)
            cache.grow(s, start + n)
            cache.place([(s, n)])
        for name, pages in cache.streams.items():
            j = torch.arange(pages.stream.first_read(length), pages.stream.entries(length), device=cache.device)
            slots = pages.block_table[s, j // P].long() * P + j % P
            for layer, storage in enumerate(cache.layers):
                for array, (stream, width) in cache.layout.widths(layer).items():
                    if stream == name:
                        storage[array][slots] = torch.randn(len(j), width, generator=g, device=cache.device,
                                                            dtype=storage[array].dtype)
        cache.grow(s, length + cache.page_size)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_step(graphs: DecodeGraphs | None, model, cache: CacheManager, ids: list[int], rows: list[int]):
    """One engine decode step of ``rows`` (greedy): grow, forward (graph or eager), sample; returns the tokens."""
    for r in rows:
        cache.grow(r, cache.length(r) + 1)
    if graphs is not None:
        logits = graphs.forward(ids, rows)
    else:
        logits = model.forward(torch.tensor(ids, device=cache.device), cache.prepare([(r, 1) for r in rows]), cache)
    params = [SamplingParams()] * len(rows)
    return sample(logits, params, [0] * len(rows), [0] * len(rows))


def rewind(cache: CacheManager, rows: list[int], lengths: list[int]) -> None:
    """Set the cached lengths back (the next step rewrites the same positions): for comparing two runs of a step."""
    for r, n in zip(rows, lengths):
        cache._lens[r] = n  # the bench's own use of the manager's bookkeeping


def timed_steps(fn, n: int, device) -> float:
    """Median wall milliseconds of ``fn()`` over ``n`` calls (each ends synchronized: sampling reads the tokens)."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def replay_times(graph, n: int) -> list[float]:
    """GPU milliseconds of each of ``n`` calls of ``graph.replay()`` (CUDA events)."""
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


# -- floors --------------------------------------------------------------------------------------------------------

def _scaled(cost: Cost, k: float) -> Cost:
    return Cost(cost.bytes * k, cost.flops * k, cost.flop_dtype)


def _sum(*costs: Cost) -> Cost:
    return Cost(sum(c.bytes for c in costs), sum(c.flops for c in costs), "bf16")


def step_floors(c, batch: int, tokens: int, context: int, phase: str,
                active_experts: float | None = None) -> dict[str, Cost]:
    """The work of one step by op group, all layers: ``tokens`` new tokens of ``batch`` sequences at ``context``
    (decode: one token a sequence). The registry's costs of the ops; torch GEMMs: their weights read once and
    ``2 x rows x weights`` FLOPs (the MoE layer's cost counts its router and shared expert). The MoE layer's
    expert bytes are those of ``active_experts`` experts a layer when given (counted in the step), else of the
    experts uniform routing would reach."""
    L, P, n_layers = c.num_hidden_layers, PAGE, c.num_hidden_layers
    moe_layers = sum(c.is_moe_layer(i) for i in range(n_layers))
    spec = registry.get
    decode = phase == "decode"
    latent = c.latent_dim
    out = {
        "append": _scaled(spec("append_tokens").cost(phase, {"B": batch if decode else 1, "N": tokens, "P": P,
                                                             "D": latent, "Dr": 0, "DK": c.index_head_dim, "fp8": 0,
                                                             "ctx": context}), L),
        "indexer": _scaled(spec("indexer_logits").cost("decode" if decode else "prefill", {
            "B": batch, "Q": 1 if decode else tokens, "L": context, "P": P, "H": c.index_n_heads,
            "DK": c.index_head_dim}), L),
        "top-k": _scaled(spec("topk_indices").cost("any", {"T": tokens, "L": context, "k": c.index_topk}), L),
        "attention": _scaled(spec("sparse_attention_decode").cost("decode", {
            "B": batch, "H": c.num_attention_heads, "S": 1, "D": latent, "Dv": c.kv_lora_rank, "k": c.index_topk,
            "P": P, "logical": 0, "fp8": 0}) if decode else spec("sparse_attention_prefill").cost("prefill", {
                "T": tokens, "H": c.num_attention_heads, "D": latent, "Dv": c.kv_lora_rank, "k": c.index_topk,
                "L": context, "P": P, "logical": 0, "fp8": 0}), L),
        "moe": _scaled(moe_cost(c, tokens, phase, active_experts), moe_layers),
    }
    H, D = c.num_attention_heads, c.hidden_size
    per_layer = (D * c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim + D * latent
                 + H * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + H * c.v_head_dim * D
                 + c.q_lora_rank * c.index_n_heads * c.index_head_dim + D * c.index_head_dim)
    dense = per_layer * L + 3 * D * c.intermediate_size * (L - moe_layers)
    lm_head = c.vocab_size * D
    out["gemm (torch)"] = _sum(Cost(2 * dense, 2 * tokens * dense), Cost(2 * lm_head, 2 * batch * lm_head))
    return out


def moe_cost(c, tokens: int, phase: str, active_experts: float | None) -> Cost:
    """One MoE layer's cost (``moe_forward``'s), its expert bytes moved to ``active_experts`` experts when given."""
    shape = {"T": tokens, "E": c.n_routed_experts, "top_k": c.num_experts_per_tok, "hidden": c.hidden_size,
             "I": c.moe_intermediate_size, "n_group": c.n_group, "topk_group": c.topk_group}
    cost = registry.get("moe_forward").cost("decode" if phase == "decode" else "prefill", shape)
    if active_experts is None:
        return cost
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size * 17 / 32  # MXFP4 bytes of one expert
    return Cost(cost.bytes + (active_experts - expected_active_experts(shape)) * per_expert, cost.flops,
                cost.flop_dtype)


class ExpertCounter:
    """The step's ops, unchanged, plus the count of distinct experts each MoE layer routes its tokens to (what its
    expert bytes scale with): V3.2's router logits and ``dt.route_topk`` once more, beside the layer's own op; V4's
    expert ids as its layer passes them."""

    def __init__(self, ops):
        self.ops, self.counts = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def moe(self, x, router, *experts, routing, router_bias):
        _, ids = dt.route_topk(x.float() @ router.float().t(), routing, router_bias, check_values=False)
        self.counts.append(int(torch.unique(ids).numel()))
        return self.ops.moe(x, router, *experts, routing=routing, router_bias=router_bias)

    def routed_experts(self, x, ids, *args):
        self.counts.append(int(torch.unique(ids).numel()))
        return self.ops.routed_experts(x, ids, *args)


def op_rows(label: dict, groups: dict[str, float], floors: dict[str, Cost], ceilings) -> list[dict]:
    """One row per op group: GPU ms, share, floor ms and the fraction of it reached."""
    total = sum(groups.values()) or 1.0
    rows = []
    for group, us in groups.items():
        row = {**label, "op": group, "gpu_ms": us / 1e3, "share": us / total}
        if group in floors and ceilings is not None:
            f_us, bound = floor_us(floors[group], ceilings)
            row.update(floor_ms=f_us / 1e3, bound=bound, floor_fraction=f_us / us if us else None)
        rows.append(row)
    return rows


# -- parts ---------------------------------------------------------------------------------------------------------

def show(section: str, row: dict) -> None:
    """A row as soon as it is measured (a call cut short still leaves these lines in its output)."""
    print(section, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def compare_runs(run, base) -> tuple[int, list[float], float]:
    """Between two runs of the same requests (each ``(sequences, engine, logits by (seed, counter), seconds)``): how
    many requests produced the same tokens; for each request whose tokens part, the logit gap in ``base`` between
    its token and ``run``'s at the first position they differ (a near-tie shows as a small gap); and the largest
    difference of the two runs' logits at any position whose prefix both runs share (the numerical noise between
    the two schedules, against which the gaps are read)."""
    equal, gaps, noise = 0, [], 0.0
    for a, b in zip(run[0], base[0]):
        shared = next((i for i, (x, y) in enumerate(zip(a.output, b.output)) if x != y), len(b.output) - 1)
        for i in range(shared + 1):
            noise = max(noise, (run[2][(a.seed, i)] - base[2][(b.seed, i)]).abs().max().item())
        if a.output == b.output:
            equal += 1
            continue
        logits = base[2][(b.seed, shared)]
        gaps.append((logits[b.output[shared]] - logits[a.output[shared]]).item())
    return equal, gaps, noise


class Bench:
    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float16
        self.config = model_config(args)
        self.v32 = self.config.model_type == "deepseek_v32"  # the V3.2 fill (append op) and floors
        self.started = time.perf_counter()
        self.ceilings = measure_ceilings(self.device) if self.cuda else None
        self.model = None

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def kernel_model(self):
        if self.model is None:
            self.model = build_model(self.config, self.dtype, self.device, KernelOps(check_values=False))
        return self.model

    def fitting(self, tokens: int, batches: list[int]) -> tuple[list[int], dict[int, str]]:
        """Those of ``batches`` whose caches for sequences of ``tokens`` tokens fit the free memory (the memory plan
        of the caches and a step's workspaces, plus ``HEADROOM``), and why each of the others is skipped."""
        free, fit, skipped = self.free_memory(), [], {}
        for B in batches:
            plan = memory_plan({}, build_cache(self.config, B, tokens, self.dtype, "meta"), self.kernel_model(), B)
            need = sum(plan.values()) + HEADROOM
            show("memory plan", {"tokens": tokens, "batch": B, "need_gib": need / 2**30,
                                 "free_gib": None if free is None else free / 2**30})
            if free is None or need <= free:
                fit.append(B)
            else:
                skipped[B] = (f"skipped: needs {need / 2**30:.1f} GiB (memory plan of the caches and workspaces + "
                              f"{HEADROOM / 2**30:.0f} GiB), {free / 2**30:.1f} GiB free")
        return fit, skipped

    def free_memory(self) -> int | None:
        """Free GPU bytes once the allocator's cache is given back (None on a CPU)."""
        if not self.cuda:
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def decode(self, contexts: list[int], batches: list[int]) -> dict[str, list[dict]]:
        rows, ops_rows, notes = [], [], []
        model, c = self.kernel_model(), self.config
        margin = 4 * PAGE
        for L in contexts:
            if self.over_budget():
                notes.append({"context": L, "note": "skipped: over --budget-s"})
                continue
            fit, skipped = self.fitting(L + margin, batches)
            notes += [{"context": L, "batch": B, "note": why} for B, why in skipped.items()]
            if not fit:
                continue
            cache = graphs = None
            try:
                cache = build_cache(c, max(fit), L + margin, self.dtype, self.device)
                seq_rows = [cache.allocate(0) for _ in range(max(fit))]
                t0 = time.perf_counter()
                if self.v32:
                    fill(cache, seq_rows, L, margin)
                else:
                    fill_streams(cache, seq_rows, L)
                sync(self.device)
                fill_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                graphs = DecodeGraphs(model, cache, max(fit), capture=self.cuda, sizes=fit)
                capture_s = time.perf_counter() - t0
                for B in fit:
                    if self.over_budget():
                        notes.append({"context": L, "batch": B, "note": "skipped: over --budget-s"})
                        continue
                    try:
                        row, groups = self.decode_one(model, cache, graphs, seq_rows[:B], L)
                        row.update(fill_s=fill_s, capture_s=capture_s)
                        rows.append(row)
                        show("decode", row)
                        floors = step_floors(c, B, B, L, "decode", row["active_experts"]) if self.v32 else {}
                        ops_rows += op_rows({"context": L, "batch": B}, groups, floors, self.ceilings)
                        for r in ops_rows[-len(groups):]:
                            show("decode ops", r)
                    except Exception as exc:  # one failing shape must not cost the others
                        notes.append({"context": L, "batch": B, "note": f"error: {exc!r}"[:400]})
                        traceback.print_exc()
            except Exception as exc:  # nor a context whose caches cannot be set up
                notes.append({"context": L, "note": f"error: {exc!r}"[:400]})
                traceback.print_exc()
            finally:
                del graphs, cache
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()
        return {"decode": rows, "decode ops": ops_rows, "decode notes": notes}

    def decode_one(self, model, cache, graphs, rows, L):
        B, device = len(rows), self.device
        g = torch.Generator().manual_seed(B)
        ids = lambda: torch.randint(0, self.config.vocab_size, (B,), generator=g).tolist()  # noqa: E731
        steps = self.args.steps
        for _ in range(3):
            decode_step(graphs, model, cache, ids(), rows)
        graph_ms = timed_steps(lambda: decode_step(graphs, model, cache, ids(), rows), steps, device)
        row = {"context": L, "batch": B, "bucket": graphs.bucket(B), "graph_step_ms": graph_ms,
               "graph_tokens_per_s": B / graph_ms * 1e3}
        # the same step eagerly and from the graph: logits compared
        tokens, start = ids(), [cache.length(r) for r in rows]
        for r in rows:
            cache.grow(r, cache.length(r) + 1)
        eager_logits = model.forward(torch.tensor(tokens, device=device), cache.prepare([(r, 1) for r in rows]),
                                     cache)
        rewind(cache, rows, start)
        graph_logits = graphs.forward(tokens, rows).clone()
        row["graph_vs_eager_max_abs"] = (graph_logits - eager_logits).abs().max().item()
        row["graph_vs_eager_argmax_equal"] = bool(torch.equal(graph_logits.argmax(1), eager_logits.argmax(1)))
        eager_ms = timed_steps(lambda: decode_step(None, model, cache, ids(), rows), max(3, steps // 4), device)
        row.update(eager_step_ms=eager_ms, eager_tokens_per_s=B / eager_ms * 1e3, graph_speedup=eager_ms / graph_ms)
        counter = ExpertCounter(model.ops)  # one eager step with the experts it reaches counted
        kernel_ops, model.ops = model.ops, counter
        try:
            decode_step(None, model, cache, ids(), rows)
        finally:
            model.ops = kernel_ops
        row["active_experts"] = statistics.mean(counter.counts) if counter.counts else None
        _, eager_prof = profile_call(lambda: decode_step(None, model, cache, ids(), rows), device)
        row["eager_gpu_idle"] = eager_prof.idle_fraction
        groups = eager_prof.groups()
        if self.cuda:
            graph, graph_out = graphs.graphs[graphs.bucket(B)]
            times = replay_times(graph, steps)
            row.update(replay_ms=statistics.mean(times), replay_min_ms=min(times), replay_max_ms=max(times))
            last = graph_out.clone()  # whether replays of the same inputs are bitwise equal (the top-k's output
            graph.replay()  # order is not deterministic: attention then sums in another order)
            row["replays_bitwise_equal"] = bool(torch.equal(last, graph_out))
            # the kernels of as many replays, profiled: their GPU time a replay
            _, prof = profile_call(lambda: [graph.replay() for _ in range(steps)], device)
            kernel_ms = (prof.op_us / steps or eager_prof.op_us) / 1e3
            row.update(kernel_sum_ms=kernel_ms, replay_over_kernel_sum=row["replay_ms"] / kernel_ms,
                       graph_gpu_idle=prof.idle_fraction, kernels_seen_in_replay=bool(prof.op_us))
            groups = {op: us / steps for op, us in prof.groups().items()} if prof.op_us else groups
        if B <= self.args.reference_max_batch and L <= self.args.reference_max_context:
            kernel_ops, model.ops = model.ops, ReferenceOps()
            try:
                ref_ms = timed_steps(lambda: decode_step(None, model, cache, ids(), rows), 1, device)
            finally:
                model.ops = kernel_ops
            row.update(reference_step_ms=ref_ms, speedup_vs_reference=ref_ms / graph_ms)
        row["context_at_end"] = cache.length(rows[0])
        return row, groups

    def prefill(self, lengths: list[int]) -> dict[str, list[dict]]:
        rows, ops_rows, notes = [], [], []
        model, c = self.kernel_model(), self.config
        for n in lengths:
            if self.over_budget():
                notes.append({"prompt": n, "note": "skipped: over --budget-s"})
                continue
            for mode in ("kernel", "reference"):
                if mode == "reference" and n > self.args.reference_max_prompt:
                    continue
                chunk = self.args.chunk if mode == "kernel" else min(self.args.chunk, 512)
                cache = build_cache(c, 1, n + PAGE, self.dtype, self.device)
                ops, model.ops = model.ops, (model.ops if mode == "kernel" else ReferenceOps())
                try:
                    prompt = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                    profiled = None
                    if mode == "kernel":  # a profiled warm-up prompt: compiles and tuning lookups out of the timing,
                        profiled = Engine(model, cache, chunk, profiler=StepProfiler())  # the first chunk's split
                        profiled.generate([prompt[: min(n, 2 * chunk)]], SamplingParams(max_new_tokens=1),
                                          progress=False)
                    eng = Engine(model, cache, chunk)  # timed without the profiler
                    eng.generate([prompt], SamplingParams(max_new_tokens=1), progress=False)
                    steps = [r for r in eng.steps if r.prefill_tokens]
                    seconds = sum(r.seconds for r in steps)
                    rows.append({"prompt": n, "mode": mode, "chunk": chunk, "steps": len(steps), "seconds": seconds,
                                 "tokens_per_s": n / seconds})
                    show("prefill", rows[-1])
                    if profiled is not None:
                        tokens, prof = profiled.profiler.profiles["prefill"]
                        rows[-1]["first_chunk_gpu_idle"] = prof.idle_fraction
                        floors = step_floors(c, 1, tokens, tokens, "prefill") if self.v32 else {}
                        ops_rows += op_rows({"prompt": n, "chunk_tokens": tokens}, prof.groups(), floors,
                                            self.ceilings)
                        for r in ops_rows[-len(prof.groups()):]:
                            show("prefill ops", r)
                except Exception as exc:
                    notes.append({"prompt": n, "mode": mode, "note": f"error: {exc!r}"[:400]})
                    traceback.print_exc()
                finally:
                    model.ops = ops
                    del cache
                    gc.collect()
        kernel = {r["prompt"]: r["tokens_per_s"] for r in rows if r["mode"] == "kernel"}
        for r in rows:
            if r["mode"] == "reference" and r["prompt"] in kernel:
                r["kernel_speedup"] = kernel[r["prompt"]] / r["tokens_per_s"]
        return {"prefill": rows, "prefill ops (first chunk)": ops_rows, "prefill notes": notes}

    def preemption(self) -> dict[str, list[dict]]:
        c = tiny_config() if self.args.tiny else small_config()
        n_req = 24 if self.args.tiny else 256
        g = torch.Generator().manual_seed(5)
        lengths = torch.randint(4, 41 if self.args.tiny else 200, (n_req,), generator=g).tolist()
        prompts = [torch.randint(0, c.vocab_size, (m,), generator=g).tolist() for m in lengths]
        params = [SamplingParams(max_new_tokens=int(m)) for m in torch.randint(2, 33, (n_req,), generator=g)]
        need = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
        page = 16
        small_pages = 5 if self.args.tiny else 80
        rows = []
        for mode, dtype in (("reference", torch.float32), ("kernel", self.dtype)):
            if mode == "kernel" and self.args.tiny and not self.cuda:
                continue  # the interpreter: too slow for a whole batch (the CPU tests cover kernel steps)
            ops = ReferenceOps() if mode == "reference" else KernelOps(check_values=False)
            model = build_model(c, dtype, self.device, ops, seed=3)
            runs = {}
            large = ("large", cdiv(need, page) + n_req, n_req)
            # kernel mode: the large-cache run twice (does one schedule reproduce its own tokens?)
            again = [("large again", *large[1:])] if mode == "kernel" else []
            for name, pages, max_seqs in [("small", small_pages, 64), large, *again]:
                cache = CacheManager(c, pages, page, max_seqs, 256, dtype, self.device)
                eng = Engine(model, cache, 256)
                if self.cuda and mode == "kernel":
                    eng.graphs = DecodeGraphs(model, cache, max_seqs, capture=True)
                logged = {}
                real_sample = engine_module.sample

                def keep(logits, params_, seeds, counters, _log=logged):
                    out = real_sample(logits, params_, seeds, counters)
                    for row, seed, counter in zip(logits, seeds, counters):
                        _log[(seed, counter)] = row.float().cpu()
                    return out
                engine_module.sample = keep
                try:
                    t0 = time.perf_counter()
                    seqs = eng.run(prompts, params, progress=False)
                    seconds = time.perf_counter() - t0
                finally:
                    engine_module.sample = real_sample
                runs[name] = (seqs, eng, logged, seconds)
            small, large = runs["small"], runs["large"]
            equal, gaps, noise = compare_runs(small, large)
            rows.append({"mode": mode, "requests": n_req, "tokens": need, "cache_tokens_small": small_pages * page,
                         "preemptions": small[1].scheduler.preemptions,
                         "requests_preempted": sum(s.preemptions > 0 for s in small[0]),
                         "complete": all(len(s.output) == p.max_new_tokens for s, p in zip(small[0], params)),
                         "requests_equal": equal, "parted_max_logit_gap": max(gaps) if gaps else None,
                         "shared_prefix_logit_max_abs": noise,
                         "preempted_requests_equal": sum(a.output == b.output for a, b in zip(small[0], large[0])
                                                         if a.preemptions > 0),
                         "small_s": small[3], "large_s": large[3]})
            if "large again" in runs:
                equal_again, gaps_again, noise_again = compare_runs(runs["large again"], large)
                rows[-1].update(large_runs_equal=equal_again,
                                large_runs_parted_max_logit_gap=max(gaps_again) if gaps_again else None,
                                large_runs_logit_max_abs=noise_again)
            show("preemption", rows[-1])
        return {"preemption": rows}


def model_note(args, c) -> str:
    """What a results file's note says of the model ``c``."""
    if args.tiny:
        return "a tiny model" if args.model is None else f"a tiny {c.model_type} model"
    moe = sum(map(c.is_moe_layer, range(c.num_hidden_layers)))
    if args.model is None:
        return f"DeepSeek-V3.2 layer widths, {c.num_hidden_layers - moe} dense + {moe} MoE layers, random weights"
    layers = (" / ".join(f"{a} + {m}" for a, m in zip(c.layer_types, c.mlp_layer_types)) if hasattr(c, "layer_types")
              else f"{c.num_hidden_layers - moe} dense + {moe} MoE")
    return f"{args.model} ({c.model_type}) widths, {c.num_hidden_layers} layers ({layers}), random weights"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", required=True, choices=("decode", "decode-1m", "prefill", "preemption"))
    ap.add_argument("--model", default=None, help="a config.json (or a folder holding one) to measure instead of "
                    "the V3.2 widths, e.g. model_runner/configs/deepseek-v4-flash.json")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the model (default 4 for V3.2, 3 with --model: its family's reduced config)")
    ap.add_argument("--out", default="results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    ap.add_argument("--prompts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--chunk", type=int, default=4096, help="token budget of a prefill step")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per shape")
    ap.add_argument("--reference-max-batch", type=int, default=8)
    ap.add_argument("--reference-max-context", type=int, default=1 << 20)
    ap.add_argument("--reference-max-prompt", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=420,
                    help="no new shape starts after this many seconds (a device call ends at 600)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model at tiny sizes (checks this script on a CPU)")
    args = ap.parse_args(argv)
    if args.model is not None and "preemption" in args.part:
        ap.error("--part preemption: the V3.2 small model only (no --model)")
    if args.tiny:
        args.contexts, args.batches, args.prompts = [40], [3], [40]
        args.chunk, args.steps = 16, 2
    bench = Bench(args)
    for part in args.part:
        if part == "decode":
            sections = bench.decode(args.contexts, args.batches)
        elif part == "decode-1m":
            sections = bench.decode([64 if args.tiny else 1 << 20], [1])
        elif part == "prefill":
            sections = bench.prefill(args.prompts)
        else:
            sections = bench.preemption()
        note = (f"runner_bench {part}: {model_note(args, bench.config)}, {str(bench.dtype).replace('torch.', '')}, "
                f"pages of {PAGE}; ceilings {bench.ceilings}")
        for note_row in next((rows for name, rows in sections.items() if name.endswith("notes")), []):
            show("note", note_row)
        name = f"runner_bench-{part}" if args.model is None else f"runner_bench-{Path(args.model).stem}-{part}"
        print(f"wrote {write_results(args.out, name, sections, note=note)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
