"""One decode step of one DSA layer through ``torch.ops.dsa``: eager, compiled and replayed from a CUDA graph, each
checked against eager and timed (issue 15).

    python scripts/decode_step.py [--batches 1 64] [--contexts 4096 32768] [--out results] [--flat]
    python scripts/decode_step.py --tiny    # tiny widths: the CPU check of this script (Triton interpreter)

Two parts, written as one results file (``decode-step-<device>-<date>.json|md``, ``--flat``: straight into ``--out``):

- ``compile``: the module tests/test_library.py compiles (``DecodeStep``: indexer, top-k, sparse attention, MoE
  layer) under ``torch.compile(fullgraph=True)`` against eager, with inductor on the GPU (``aot_eager`` on the CPU);
- ``decode step``: per context and batch, one decode step of one layer at DeepSeek-V3.2 widths (``--tiny``:
  model_runner's tiny config) on the serving example's ``DSAAttentionBackend`` and ``MXFP4MoEMethod`` (static
  buffers, value checks off): append the new token's rows -> indexer logits (64 x 128 heads, FP8 q) -> top-2048
  physical slots -> sparse attention (128 heads, bf16 latent rows of 512 + 64, pages of 64) -> output projection
  (per head 512 -> 128, then 16384 -> 7168) and RMSNorm (the MoE layer's input norm) -> MoE layer (256 MXFP4
  experts of 2048, top-8 in 8 groups of which 4, scaling 2.5, one shared expert). Every sequence holds ``context``
  random tokens; weights are random (MXFP4 experts from model_runner.random_weights). Modes: ``eager``; ``compiled``
  (``torch.compile(step, fullgraph=True)``: inductor on the GPU, ``aot_eager`` on the CPU); ``graph`` (GPU: the
  eager step captured in a CUDA graph and replayed). The step is idempotent (it rewrites the same token), so every
  mode runs on the same state.

Checks. What a step writes (the new tokens' latent rows, indexer keys and scales, the lengths) is zeroed before the
call a mode is checked by. Eager: the latent rows and lengths written, every output finite (the logits exactly at
each sequence's positions), every slot a cache slot. Each other mode against eager: what it wrote equal; the top-k
slot sets equal; the largest error over eager's largest magnitude (at most 2e-2 in bf16, 1e-2 in fp16) of the
logits, the attention output and lse, the MoE layer's input ``x``, and of the MoE layer's output against eager's
on the mode's own ``x`` (``y_stage``). ``y`` end to end against eager's (``y_e2e``) is reported, not checked: the
top-k's order differs run to run on the GPU, so attention sums in another order, and a token whose router scores
nearly tie can then pick another expert (``rerouted``: tokens whose top-k experts differ). Any failed check or error
makes a FAILED row and exit status 1.

Latency: :func:`~dsa_triton.bench.harness.time_us` (``do_bench`` median after warm-up, L2 flushed between calls;
wall clock on the CPU) of the step (eager, compiled) and of ``graph.replay()``, each also over eager's. Rows are
printed as they come; ``--budget-s`` starts no new shape past that many seconds; a markdown table comes last.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import dsa_triton as dt  # noqa: E402
from dsa_triton.bench.harness import time_us  # noqa: E402
from dsa_triton.bench.results import dict_table, write_results  # noqa: E402
from dsa_triton.hostmath import cdiv  # noqa: E402
from dsa_triton.runtime import default_device  # noqa: E402
from model_runner import ModelConfig, tiny_config  # noqa: E402
from model_runner.families.mla_dsa import random_experts  # noqa: E402
from runner_bench import v32_config  # noqa: E402  (scripts/ is on the path of a script)
from serving_backend import DSAAttentionBackend, MXFP4MoEMethod, capture, new_inputs  # noqa: E402

ops = torch.ops.dsa
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}  # largest error over the largest magnitude
CHECKED = ("logits", "out", "lse", "x")  # outputs compared with eager's; y: on the mode's own x


@dataclass
class Setup:
    """What a run holds fixed: widths, page size, device, dtype, compile backend and the random source."""

    config: ModelConfig
    page: int
    device: torch.device
    dtype: torch.dtype
    backend: str
    g: torch.Generator

    def rand(self, *size: int, scale: float = 1.0) -> torch.Tensor:
        """fp32 ``N(0, scale^2)`` values of ``size`` on the device."""
        return torch.randn(*size, generator=self.g, device=self.device) * scale


def make_setup(tiny: bool) -> Setup:
    device = default_device()
    cuda = device.type == "cuda"
    return Setup(tiny_config() if tiny else v32_config(), 16 if tiny else 64, device,
                 torch.bfloat16 if cuda else torch.float16,  # the interpreter has no bf16 dots
                 "inductor" if cuda else "aot_eager", torch.Generator(device).manual_seed(0))


def failure(exc: Exception) -> str:
    traceback.print_exc()
    return f"FAILED: {type(exc).__name__}: {exc}"[:300]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|, both over the entries ``want`` has finite; NaN when ``got``'s finite entries
    are not the same ones (a NaN never passes a check)."""
    got, want = got.float(), want.float()
    finite = want.isfinite()
    if not torch.equal(got.isfinite(), finite):
        return float("nan")
    if not finite.any():
        return 0.0
    return ((got - want)[finite].abs().max() / want[finite].abs().max().clamp_min(1e-6)).item()


# -- part 1: tests/test_library.py's module -------------------------------------------------------------------------

def compile_module(setup: Setup) -> dict:
    """tests/test_library.py's ``DecodeStep`` compiled (fullgraph) on ``setup``'s backend, against eager: one row."""
    row = {"module": "tests/test_library.py DecodeStep", "backend": setup.backend, "device": setup.device.type}
    try:
        from tests.test_library import decode_step_case

        torch._dynamo.reset()
        module, args = decode_step_case(setup.device)
        eager = module(*args)
        compiled = torch.compile(module, backend=setup.backend, fullgraph=True)(*args)
        row["rel_err"] = rel_err(compiled, eager)
        ok = bool(eager.isfinite().all()) and row["rel_err"] <= TOL[eager.dtype]
        row["status"] = "ok" if ok else "FAILED: not finite, or compiled != eager"
    except Exception as exc:  # a failure is the row's
        row["status"] = failure(exc)
    return row


# -- part 2: one decode step of one layer ---------------------------------------------------------------------------

class OutputProjection:
    """Attention output ``[B, H, d_v]`` -> values ``[B, H, v_head]`` (MLA's per-head up-projection) -> ``[B, hidden]``
    (o_proj) -> RMSNorm (the MoE layer's input norm, which keeps the router's scores token-dependent)."""

    def __init__(self, setup: Setup):
        c, rand, dtype = setup.config, setup.rand, setup.dtype
        H, d_v, v_head = c.num_attention_heads, c.kv_lora_rank, c.v_head_dim
        self.w_uv = rand(H, d_v, v_head, scale=d_v ** -0.5).to(dtype)
        self.w_o = rand(H * v_head, c.hidden_size, scale=(H * v_head) ** -0.5).to(dtype)
        self.norm = (1 + rand(c.hidden_size, scale=0.1)).to(dtype)
        self.eps = c.rms_norm_eps

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        values = torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)
        return F.rms_norm(values.flatten(1) @ self.w_o, self.norm.shape, self.norm, self.eps)


def build_moe(setup: Setup) -> MXFP4MoEMethod:
    """Random router (fp32, with its correction bias), MXFP4 experts and a bf16 shared expert."""
    c, rand, dtype = setup.config, setup.rand, setup.dtype
    H, I, E = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts
    shared = I * c.n_shared_experts
    routing = dt.RoutingConfig("deepseek", top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                               norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)
    layer = c.first_k_dense_replace  # the first MoE layer
    experts = {name.rsplit(".", 1)[1]: w for name, w in random_experts(c, layer, setup.g).items()}
    return MXFP4MoEMethod(rand(E, H, scale=H ** -0.5), rand(E, scale=0.1),
                          (experts["gate_up_proj_blocks"], experts["gate_up_proj_scales"]),
                          (experts["down_proj_blocks"], experts["down_proj_scales"]),
                          rand(2 * shared, H, scale=H ** -0.5).to(dtype),
                          rand(H, shared, scale=shared ** -0.5).to(dtype), routing)


def build_attention(setup: Setup, batch: int, context: int) -> DSAAttentionBackend:
    """``batch`` sequences of ``context`` random tokens in paged caches with a page for the step's token, and the
    step's inputs (positions ``context``) in the static buffers."""
    c, rand = setup.config, setup.rand
    attn = DSAAttentionBackend(batch, setup.page, cdiv(context + 1, setup.page), heads=c.num_attention_heads,
                               kv_dim=c.latent_dim, d_v=c.kv_lora_rank, index_heads=c.index_n_heads,
                               index_dim=c.index_head_dim, top_k=c.index_topk, dtype=setup.dtype,
                               device=setup.device)
    for seq in range(batch):
        attn.admit(seq)
        attn.prefill(seq, rand(context, c.latent_dim).to(setup.dtype), rand(context, c.index_head_dim))
    new_inputs(attn, rand)
    return attn


def layer_step(attn: DSAAttentionBackend, proj: OutputProjection, moe: MXFP4MoEMethod) -> dict[str, torch.Tensor]:
    """Append -> indexer logits ``[B, max_len]`` -> slots ``[B, k]`` -> attention ``out [B, H, d_v]``, ``lse [B, H]``
    -> MoE input ``x [B, hidden]`` -> MoE output ``y [B, hidden]``. Device work only."""
    step = attn.decode_step()
    x = proj(step["out"])
    return {**step, "x": x, "y": moe.forward(x)}


def new_slots(attn: DSAAttentionBackend) -> torch.Tensor:
    """The physical cache slot of each sequence's new token: ``[B]`` int64."""
    return attn.new_token_pages().long() * attn.P + attn.positions % attn.P


def written(attn: DSAAttentionBackend) -> dict[str, torch.Tensor]:
    """What a step writes besides its outputs: the new tokens' latent rows, indexer key bytes and scales, and the
    lengths."""
    slots = new_slots(attn)
    return {"kv": attn.kv.flatten(0, 1)[slots], "ik": attn.ik.view(torch.uint8).flatten(0, 1)[slots],
            "ik_scale": attn.ik_scale.flatten()[slots], "seq_lens": attn.seq_lens.clone()}


def scrub(attn: DSAAttentionBackend) -> None:
    """Zero what a step writes (:func:`written`), so that a mode which does not write it shows."""
    slots = new_slots(attn)
    attn.kv.flatten(0, 1)[slots] = 0
    attn.ik.view(torch.uint8).flatten(0, 1)[slots] = 0
    attn.ik_scale.flatten()[slots] = 0
    attn.seq_lens.zero_()


def eager_status(attn: DSAAttentionBackend, ref: dict) -> str:
    """"ok" when the new latent rows and the lengths are written, every output is finite (the logits exactly at
    each sequence's positions) and each row's slots are ``min(k, length)`` cache slots, -1 padded."""
    bad = [k for k in ("out", "lse", "x", "y") if not ref[k].isfinite().all()]
    state = written(attn)
    if not (torch.equal(state["kv"], attn.new_kv) and torch.equal(state["seq_lens"], attn.positions + 1)):
        bad.append("append")
    positions = torch.arange(attn.max_len, device=attn.seq_lens.device)
    if not torch.equal(ref["logits"].isfinite(), positions < attn.seq_lens[:, None]):
        bad.append("logits")
    slots = ref["slots"]
    valid = (slots >= 0).sum(1) == attn.seq_lens.clamp(max=attn.top_k)
    if not (valid.all() and (slots < attn.kv.shape[0] * attn.P).all()):
        bad.append("slots")
    return "FAILED: not written, finite or valid: " + ", ".join(bad) if bad else "ok"


def routed(moe: MXFP4MoEMethod, x: torch.Tensor) -> torch.Tensor:
    """The experts each token of ``x`` picks, sorted: ``[T, top_k]``."""
    logits = x.float() @ moe.router_weight.float().t()
    return ops.route_topk(logits, moe.router_bias, **moe.routing, check_values=False)[1].sort(1).values


def compare(got: dict, want: dict, state: dict, ref_state: dict, moe: MXFP4MoEMethod, tol: float) -> dict:
    """A mode's outputs and :func:`written` state against eager's (the module docstring's checks): ``status``, the
    errors, ``y_e2e``."""
    errors = {f"{k}_err": rel_err(got[k], want[k]) for k in CHECKED}
    errors["y_stage_err"] = rel_err(got["y"], moe.forward(got["x"]))
    failed = [k for k, e in errors.items() if not e <= tol]
    slots_equal = torch.equal(got["slots"].sort(1).values, want["slots"].sort(1).values)
    failed += [] if slots_equal else ["slots"]
    failed += [f"written {k}" for k in state if not torch.equal(state[k], ref_state[k])]
    rerouted = int((routed(moe, got["x"]) != routed(moe, want["x"])).any(1).sum())
    return {"status": "FAILED: " + ", ".join(failed) if failed else "ok", **errors, "slots_equal": slots_equal,
            "y_e2e_err": rel_err(got["y"], want["y"]), "rerouted": rerouted}


def compiled(step, setup: Setup):
    """The step through ``torch.compile(fullgraph=True)`` for this shape alone, compiled (called once)."""
    torch._dynamo.reset()  # drops the last shape's graphs (and the tensors they hold)
    fn = torch.compile(step, backend=setup.backend, fullgraph=True, dynamic=False)
    fn()
    return fn


def graphed(step, setup: Setup):
    """The warm eager step captured in a CUDA graph: a call replays it and returns its (static) outputs."""
    graph, outputs = capture(step)

    def replay():
        graph.replay()
        return outputs
    return replay


def run_shape(setup: Setup, proj: OutputProjection, moe: MXFP4MoEMethod, batch: int, context: int) -> list[dict]:
    """One row per mode at ``batch`` x ``context``: status, milliseconds, over eager, the check's errors. Before the
    call a mode is checked by, what the step writes is zeroed (:func:`scrub`)."""
    label = {"batch": batch, "context": context}
    attn = build_attention(setup, batch, context)
    step = lambda: layer_step(attn, proj, moe)  # noqa: E731
    step()  # warm-up: kernels, plans, launch configs, the experts' scale ranges
    scrub(attn)
    ref = step()
    ref_state = written(attn)
    eager = {**label, "mode": "eager", "status": eager_status(attn, ref), "ms": time_us(step, setup.device) / 1e3}
    if eager["status"] == "ok":
        eager["vs_eager"] = 1.0
    show(eager)
    rows = [eager]
    modes = [("compiled", compiled)] + ([("graph", graphed)] if setup.device.type == "cuda" else [])
    for mode, make in modes:
        row = {**label, "mode": mode}
        try:
            run = make(step, setup)
            scrub(attn)
            got = run()
            row.update(compare(got, ref, written(attn), ref_state, moe, TOL[setup.dtype]))
            row["ms"] = time_us(run, setup.device) / 1e3
            if eager["status"] == "ok":
                row["vs_eager"] = row["ms"] / eager["ms"]
        except Exception as exc:  # a failure is the row's; the other modes still run
            row["status"] = failure(exc)
        show(row)
        rows.append(row)
    return rows


def show(row: dict) -> None:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def release(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summary(compile_rows: list[dict], step_rows: list[dict]) -> str:
    """The short table: the compiled module's status, then milliseconds and ratio to eager per shape and mode."""
    lines = [f"| {r['module']} | {r['backend']} | {r['status']} |" for r in compile_rows]
    keys = ("batch", "context", "mode", "ms", "vs_eager", "status")
    return "\n".join(["| module | backend | status |", "|---|---|---|", *lines, "",
                      dict_table([{k: r.get(k, "") for k in keys} for r in step_rows])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 64 (--tiny: 1 3)")
    parser.add_argument("--contexts", type=int, nargs="+", help="tokens in each sequence; default 4096 32768 "
                        "(--tiny: 40)")
    parser.add_argument("--tiny", action="store_true", help="model_runner's tiny widths (the CPU check)")
    parser.add_argument("--budget-s", type=float, default=280, help="no new shape starts after this many seconds")
    parser.add_argument("--out", default="results", help="where the results files go")
    parser.add_argument("--flat", action="store_true", help="write straight into --out (no <device>/<date> folders)")
    args = parser.parse_args(argv)
    batches = args.batches or ([1, 3] if args.tiny else [1, 64])
    contexts = args.contexts or ([40] if args.tiny else [4096, 32768])
    started = time.perf_counter()
    setup = make_setup(args.tiny)
    compile_rows = [compile_module(setup)]
    show(compile_rows[0])
    release(setup.device)
    proj, moe = OutputProjection(setup), build_moe(setup)
    step_rows = []
    for context in contexts:
        for batch in batches:
            if time.perf_counter() - started > args.budget_s:
                step_rows.append({"batch": batch, "context": context, "status": "skipped: over --budget-s"})
                continue
            try:
                step_rows += run_shape(setup, proj, moe, batch, context)
            except Exception as exc:  # building the shape or its eager step failed
                step_rows.append({"batch": batch, "context": context, "mode": "eager", "status": failure(exc)})
            release(setup.device)
    c = setup.config
    widths = "tiny" if args.tiny else "DeepSeek-V3.2"
    note = (f"{widths} widths: {c.num_attention_heads} heads, latent {c.kv_lora_rank} + {c.qk_rope_head_dim}, "
            f"indexer {c.index_n_heads} x {c.index_head_dim} top-{c.index_topk}, pages of {setup.page}, hidden "
            f"{c.hidden_size}, {c.n_routed_experts} MXFP4 experts of {c.moe_intermediate_size} top-"
            f"{c.num_experts_per_tok} ({c.n_group} groups, {c.topk_group} chosen) + {c.n_shared_experts} shared; "
            f"{str(setup.dtype).removeprefix('torch.')}; compiled with {setup.backend}; tolerance "
            f"{TOL[setup.dtype]} of the largest magnitude; {time.perf_counter() - started:.0f} s")
    path = write_results(args.out, "decode-step", {"compile": compile_rows, "decode step": step_rows}, note=note,
                         flat=args.flat)
    print(f"wrote {path}\n{note}\n")
    print(summary(compile_rows, step_rows))
    return 1 if any(r["status"].startswith("FAILED") for r in compile_rows + step_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
