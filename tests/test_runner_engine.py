"""The runner's serving machinery on a tiny model: the scheduler (token budget, decode mixed with prefill chunks,
pages taken as sequences grow, preemption by free-and-recompute), batched sampling, padded decode steps (the CUDA
graph path's batches, run eagerly on the CPU), batch invariance, the block-level indexer path and the profile mode.

Whole generations run in the reference mode (fp32: fast, and a recomputed prefix gives the same greedy tokens);
the kernel-mode checks are single steps or short generations (the Triton interpreter is slow).
"""
import json
import shutil

import pytest
import torch

import tuning_db
from dsa_triton import registry
from dsa_triton.runtime import device_name
from model_runner import SamplingParams, build_engine, save_random_checkpoint, tiny_config
from model_runner.__main__ import main
from model_runner.cache_manager import CacheManager
from model_runner.cuda_graphs import DecodeGraphs, buckets
from model_runner.index_path import PathChoice
from model_runner.model import fp32_output_gemm, logits as lm_logits
from model_runner.ops import KernelOps, ReferenceOps
from model_runner.profiling import StepProfiler, op_group, profile_call
from model_runner.sampling import exponential_noise, sample, sample_tensors
from model_runner.scheduler import Scheduler
from model_runner.sequence import Sequence

CONFIG = tiny_config()  # vocab 128, page summaries of 32-dim indexer keys, top-k 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Many tiny ops: torch's thread pool only adds contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine_ckpt")
    save_random_checkpoint(CONFIG, folder, experts="mxfp4", seed=4)
    return folder


def engine(folder, mode="reference", **kwargs):
    kwargs = {"num_pages": 24, "page_size": 16, "max_seqs": 4, "max_seq_len": 64, "max_num_batched_tokens": 16,
              "dtype": torch.float32 if mode == "reference" else torch.float16, **kwargs}
    return build_engine(folder, mode=mode, device="cpu", **kwargs)


def random_requests(n, seed, max_prompt=40, max_new=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_prompt + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, CONFIG.vocab_size, (m,), generator=g).tolist() for m in lengths]
    params = [SamplingParams(max_new_tokens=int(m)) for m in torch.randint(2, max_new + 1, (n,), generator=g)]
    return prompts, params


# -- scheduler ---------------------------------------------------------------------------------------------------

def test_preemption_loses_nothing(checkpoint):
    """24 requests of mixed lengths, far more tokens than a 5-page cache holds: sequences are preempted (pages
    freed, recomputed later), and every request's tokens equal a run with a cache that never preempts; sampled
    requests too (their random streams do not depend on the schedule)."""
    prompts, params = random_requests(24, seed=11)
    params[3] = SamplingParams(max_new_tokens=9, temperature=0.8, top_k=20)
    params[7] = SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.9, seed=5)
    small = engine(checkpoint, num_pages=5, max_seqs=8)
    large = engine(checkpoint, num_pages=200, max_seqs=24, max_num_batched_tokens=64)
    assert sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params)) > 5 * 5 * 16  # 5x the cache
    got, want = small.run(prompts, params, progress=False), large.run(prompts, params, progress=False)
    assert small.scheduler.preemptions >= 3 and large.scheduler.preemptions == 0
    assert sum(s.preemptions > 0 for s in got) >= 2
    assert [s.output for s in got] == [s.output for s in want]
    assert [len(s.output) for s in got] == [p.max_new_tokens for p in params]
    assert all(r.tokens <= 16 for r in small.steps)
    assert small.cache.num_free_pages == 5 and not small.running and not small.waiting


def test_decode_goes_on_while_a_long_prompt_is_chunked(checkpoint):
    """Three short requests decode while a 60-token prompt is prefilled in chunks (8 tokens a step): every step in
    between holds a decode token of each request still decoding and a chunk of the long prompt (mixed steps)."""
    eng = engine(checkpoint, max_num_batched_tokens=8)
    short = [eng.add([3, 1, 4, 1], SamplingParams(max_new_tokens=12)) for _ in range(3)]
    long = eng.add(list(range(60)), SamplingParams(max_new_tokens=2))
    during = []
    while eng.scheduler.busy:
        pending, decoding = 0 < eng.scheduler.cached(long) < len(long.prompt), sum(not s.finished for s in short)
        eng.step()
        if pending and decoding:
            during.append((eng.steps[-1], decoding))
    assert sum(decoding == 3 for _, decoding in during) >= 8
    for record, decoding in during:  # each step: every decoding request's token, the rest of the budget prefill
        assert record.kind == "mixed" and record.decode_tokens == decoding and record.tokens == 8
    assert [len(s.output) for s in short] == [12] * 3 and len(long.output) == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduler_invariants(seed):
    """Random requests through the scheduler alone (a sampled token is 0): every step is non-empty and within the
    budget, its sequences hold pages for their tokens and no more, admission is first come first served, and every
    request completes with its pages given back."""
    cache = CacheManager(tiny_config(num_hidden_layers=1, first_k_dense_replace=1), num_pages=6, page_size=16,
                         max_seqs=4, max_seq_len=64, dtype=torch.float32, device="cpu")
    sched = Scheduler(cache, token_budget=12)
    prompts, params = random_requests(30, seed=seed, max_prompt=50, max_new=14)
    seqs = [Sequence(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
    for s in seqs:
        sched.add(s)
    admitted, steps = [], 0
    while sched.busy:
        step = sched.schedule()
        steps += 1
        assert step.chunks and step.tokens <= 12 and len({id(s) for s, _ in step.chunks}) == len(step.chunks)
        for s, n in step.chunks:
            assert 1 <= n <= sched.pending(s) and len(cache.pages(s.seq_id)) == -(-(sched.cached(s) + n) // 16)
            if sched.cached(s) == 0 and s.preemptions == 0:
                admitted.append(s.index)
        cache.place([(s.seq_id, n) for s, n in step.chunks])  # what the forward does
        sched.update(step, [0 if sched.pending(s) == 0 else None for s, _ in step.chunks])
        assert steps < 2000
    assert admitted == sorted(admitted) == list(range(30))
    assert [len(s.output) for s in seqs] == [p.max_new_tokens for p in params]
    assert cache.num_free_pages == 6 and sched.preemptions > 0


# -- sampling ----------------------------------------------------------------------------------------------------

def draws(logits, params, n, seed=9):
    """``n`` draws from one row of ``logits`` (one batch of n rows, draw counters 0..n-1)."""
    return torch.tensor(sample(logits.expand(n, -1), [params] * n, [seed] * n, list(range(n))))


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]])
    n = 4000
    for params, allowed in ((SamplingParams(temperature=0.7), range(8)),
                            (SamplingParams(temperature=1.0, top_k=3), (0, 1, 6)),
                            (SamplingParams(temperature=1.0, top_p=0.6), (0, 6))):
        probs = (logits[0] / params.temperature).softmax(0)
        keep = torch.zeros(8, dtype=torch.bool)
        keep[list(allowed)] = True
        want = torch.where(keep, probs, 0.0) / probs[keep].sum()
        freq = torch.bincount(draws(logits, params, n), minlength=8).float() / n
        assert (freq[~keep] == 0).all()
        assert (freq - want).abs().max() < 0.035, (params, freq, want)  # ~4 standard deviations


def test_sampling_is_seeded_per_request():
    """A row's token depends on its logits, seed and counter only: not on the other rows or their order."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 2
    params = [SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(), SamplingParams(temperature=0.5),
              SamplingParams(temperature=2.0, top_k=5), SamplingParams(temperature=1.0), SamplingParams()]
    seeds, counters = [1, 2, 3, 4, 5, 6], [0, 3, 7, 7, 2, 0]
    batch = sample(logits, params, seeds, counters)
    alone = [sample(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], counters[i:i + 1])[0] for i in range(6)]
    order = [4, 2, 0, 5, 1, 3]
    shuffled = sample(logits[order], [params[i] for i in order], [seeds[i] for i in order],
                      [counters[i] for i in order])
    assert batch == alone == [shuffled[order.index(i)] for i in range(6)]
    assert batch[1] == int(logits[1].argmax()) and batch[5] == int(logits[5].argmax())  # greedy rows
    uniform = torch.zeros(1, 50)
    streams = [draws(uniform, SamplingParams(temperature=1.0), 64, seed=s).tolist() for s in (1, 1, 2)]
    assert streams[0] == streams[1] != streams[2]
    assert len(set(streams[0])) > 20  # not stuck on a few tokens


def test_request_seed_sets_its_tokens(checkpoint):
    """A request's own seed (``SamplingParams.seed``) fixes its draws: the same tokens whatever the engine's seed
    and whatever shares its batch, other tokens with another seed."""
    prompt = list(range(3, 15))
    a, b = (SamplingParams(max_new_tokens=10, temperature=3.0, seed=s) for s in (11, 12))
    alone = engine(checkpoint, seed=0).generate([prompt], a, progress=False)[0]
    assert engine(checkpoint, seed=1).generate([prompt], a, progress=False)[0] == alone
    other = engine(checkpoint, seed=0).generate([prompt], b, progress=False)[0]
    assert sum(x != y for x, y in zip(alone, other)) >= 5  # near-uniform draws from 128 tokens
    prompts, _ = random_requests(2, seed=5)
    hot = SamplingParams(max_new_tokens=10, temperature=3.0)
    batch = engine(checkpoint, seed=2).generate([prompts[0], prompt, prompts[1], prompt], [hot, a, b, a],
                                                progress=False)
    assert batch[1] == batch[3] == alone


def test_exponential_noise():
    noise = exponential_noise(torch.tensor([0, 2 ** 40 + 3]), torch.tensor([5, 5]), 20000)
    assert noise.shape == (2, 20000) and (noise > 0).all() and noise.isfinite().all()
    assert abs(noise.mean().item() - 1) < 0.02 and abs(noise.var().item() - 1) < 0.06  # Exp(1)
    assert not torch.equal(noise[0], noise[1])
    greedy = sample_tensors(torch.randn(3, 9), torch.zeros(3), torch.zeros(3, dtype=torch.int64), torch.ones(3),
                            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), any_random=False)
    assert greedy.dtype == torch.int64


def test_sampling_params_are_checked():
    for bad in ({"top_k": -1}, {"seed": -3}, {"seed": 1.5}, {"top_p": 0}):
        with pytest.raises(Exception, match="sampling: need"):
            SamplingParams(**bad)


# -- batch invariance ------------------------------------------------------------------------------------------------

TIED = tiny_config(index_n_heads=1)  # one indexer head: about half of the scores are exactly 0.0 after the ReLU


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied_ckpt")
    save_random_checkpoint(TIED, folder, experts="mxfp4", seed=4)
    return folder


def count_boundary_ties(eng) -> list[int]:
    """Wrap the engine's top-k op; the list counts the rows whose k-th score ties with a score left out."""
    ties, topk = [0], eng.model.ops.topk

    def counted(scores, k, page_size, batch):
        n = batch.limits.long()
        s = scores.float().masked_fill(torch.arange(scores.shape[1]) >= n[:, None], float("-inf"))
        kth = s.topk(min(k, s.shape[1]), dim=1).values[:, -1:]
        ties[0] += int((((s >= kth).sum(1) > k) & (n > k)).sum())
        return topk(scores, k, page_size, batch)

    eng.model.ops.topk = counted
    return ties


def assert_batch_invariant(folder, mode, lengths, new_tokens, **kwargs):
    """Greedy: each prompt alone gives the tokens it gives in a batch with the others, in either order, though
    indexer scores tie at the top-k boundary (the top-k breaks ties by position, whatever the row's width)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TIED.vocab_size, (m,), generator=g).tolist() for m in lengths]
    params = SamplingParams(max_new_tokens=new_tokens)
    eng = engine(folder, mode, max_seqs=len(prompts), **kwargs)
    ties = count_boundary_ties(eng)
    batch = eng.generate(prompts, params, progress=False)
    assert ties[0] > 0  # the top-k had ties to break
    assert eng.generate(prompts[::-1], params, progress=False)[::-1] == batch
    assert [eng.generate([p], params, progress=False)[0] for p in prompts] == batch


def test_batch_invariance_greedy_reference_mode(tied_checkpoint):
    assert_batch_invariant(tied_checkpoint, "reference", (3, 9, 14, 22, 30, 37), 10)


def test_batch_invariance_greedy_kernel_mode(tied_checkpoint):
    """The Triton kernels (interpreted: short prompts, few tokens)."""
    assert_batch_invariant(tied_checkpoint, "kernel", (2, 7, 12), 4, max_num_batched_tokens=64, check_values=False)


# -- padded decode steps (the CUDA-graph path) ------------------------------------------------------------------

def test_buckets():
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_padded_decode_steps_give_the_same_tokens(checkpoint, monkeypatch):
    """Decode steps padded to their buckets (5 sequences, then fewer as they finish) give the same tokens as
    unpadded steps."""
    prompts, params = random_requests(5, seed=3, max_prompt=20)
    params = [SamplingParams(max_new_tokens=m) for m in (3, 5, 7, 7, 9)]
    plain = engine(checkpoint, max_seqs=6, max_num_batched_tokens=64)
    padded = engine(checkpoint, max_seqs=6, max_num_batched_tokens=64)
    padded.graphs = DecodeGraphs(padded.model, padded.cache, 6, capture=False)
    seen = []
    run = padded.graphs._run
    monkeypatch.setattr(padded.graphs, "_run", lambda b: seen.append(b) or run(b))
    assert padded.generate(prompts, params, progress=False) == plain.generate(prompts, params, progress=False)
    assert set(seen) == {6, 4, 1}  # 5 sequences decoding -> 6, then 4 and 3 -> 4, then the last one alone
    assert padded.cache.num_free_pages == plain.cache.num_free_pages - 1  # the scratch page


def test_padded_decode_step_kernel_mode(checkpoint):
    """One kernel-mode decode step of 3 sequences, unpadded and padded to 4 (graph-safe ops, value checks off):
    the same logits, and the padding row writes no cache row (poisoned slots stay NaN)."""
    eng = engine(checkpoint, mode="kernel", check_values=False, poison=True, max_num_batched_tokens=64)
    kernel_ops, eng.model.ops = eng.model.ops, ReferenceOps()
    seqs = [eng.add(p, SamplingParams(max_new_tokens=4)) for p in ([9, 8, 7, 6, 5], list(range(40, 49)),
                                                                    list(range(1, 21)))]
    eng.step()  # the three prompts in one prefill step (on the references: faster in the interpreter)
    eng.model.ops = kernel_ops
    assert all(eng.scheduler.decoding(s) for s in seqs)
    cache, model = eng.cache, eng.model
    ids, rows = [s.output[-1] for s in seqs], [s.seq_id for s in seqs]
    start = [cache.length(r) for r in rows]
    unpadded = model.forward(torch.tensor(ids), cache.prepare([(r, 1) for r in rows]), cache)
    kv_before = cache.layers[0].kv.clone()
    for r, n in zip(rows, start):
        cache._lens[r] = n  # the same step again: it rewrites the same rows
    graphs = DecodeGraphs(model, cache, 4, capture=False)
    padded = graphs.forward(ids, rows)
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=2e-3)
    assert torch.equal(padded.argmax(1), unpadded.argmax(1))
    for layer in cache.layers:
        assert layer.kv[graphs.scratch_page].isnan().all()  # the padding row wrote no latent row
    assert torch.equal(cache.layers[0].kv.nan_to_num(7.0), kv_before.nan_to_num(7.0))


# -- block-level indexer path ------------------------------------------------------------------------------------

class BlockChecked(KernelOps):
    """Kernel ops whose block path is checked against the reference composition on the same inputs."""
    calls = []

    def block_topk(self, q8, w, cache, batch, k, n_select):
        slots = super().block_topk(q8, w, cache, batch, k, n_select)
        ref = ReferenceOps.block_topk(q8, w, cache, batch, k, n_select)
        assert torch.equal(slots.sort(1).values, ref.sort(1).values)
        type(self).calls.append((batch.max_q, int(batch.limits.max())))
        return slots


def test_block_indexer_path_kernel_mode(checkpoint):
    """Two prompts of 40 and 37 tokens prefilled on the block path (references), then a decode step on it (kernels,
    checked against the references): 2 of 3 pages selected for the tokens past position 32."""
    eng = engine(checkpoint, mode="kernel", indexer_path={"decode": "block", "prefill": "block"},
                 max_num_batched_tokens=80)
    eng.model.ops = ReferenceOps()
    seqs = [eng.add(p, SamplingParams(max_new_tokens=2)) for p in (list(range(5, 45)), list(range(60, 97)))]
    eng.step()
    eng.model.ops = BlockChecked(check_values=True)
    BlockChecked.calls.clear()
    eng.step()
    assert BlockChecked.calls == [(1, 41)] * 3  # the decode step in each of the 3 layers
    assert [len(s.output) for s in seqs] == [2, 2]


def test_path_choice(tmp_path):
    """Per phase; the token path where the selected pages would cover the context; "auto" asks the op, which answers
    its tuned config's path: with the H200 records standing for this device's, the block path at batch 128 and 128K
    tokens (a study found it faster there), the token path at batch 1 and 32K, and in prefill."""
    class Batch:
        def __init__(self, max_q, num_cols, seqs):
            self.max_q, self.num_cols, self.cu_seqlens = max_q, num_cols, torch.zeros(seqs + 1)

    choice = PathChoice({"decode": "block", "prefill": "token"})  # 64 pages of 64 tokens selected for top-k 2048
    assert choice(Batch(1, 8192, 8), 64, 2048, 64, 128, "cpu") == "block"
    assert choice(Batch(1, 4096, 8), 64, 2048, 64, 128, "cpu") == "token"  # 64 pages: the whole context
    assert choice(Batch(7, 65536, 2), 64, 2048, 64, 128, "cpu") == "token"  # prefill
    auto = PathChoice({"decode": "auto", "prefill": "auto"})
    assert auto(Batch(1, 131072, 128), 64, 2048, 64, 128, "cpu") == "token"  # no record for this device
    with pytest.raises(ValueError, match="indexer_path"):
        PathChoice({"decode": "fast", "prefill": "token"})
    shutil.copy(tuning_db.DEFAULT_FOLDER / "nvidia-h200.csv", tmp_path / f"{device_name('cpu')}.csv")
    previous = registry.database()
    registry.use_database(str(tmp_path))
    try:
        assert auto(Batch(1, 131072, 128), 64, 2048, 64, 128, "cpu") == "block"
        assert auto(Batch(1, 32768, 1), 64, 2048, 64, 128, "cpu") == "token"
        assert auto(Batch(2, 131072, 128), 64, 2048, 64, 128, "cpu") == "token"  # prefill
    finally:
        registry.use_database(previous)


# -- logits, profile mode, CLI -----------------------------------------------------------------------------------

def test_logits_without_an_fp32_copy():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=g).half(), (torch.randn(128, 64, generator=g) / 8).half()
    assert not fp32_output_gemm(w)  # the CPU has no fp32-output GEMM: one GEMM in fp16
    out = lm_logits(x, w, False)
    assert out.dtype == torch.float32 and out.shape == (3, 128)
    torch.testing.assert_close(out, x.float() @ w.float().t(), rtol=2e-3, atol=2e-3)


def test_profile_mode(checkpoint, tmp_path, capsys):
    _, prof = profile_call(lambda: torch.randn(64, 64) @ torch.randn(64, 64), "cpu")
    assert any("matmul" in name for name in prof.ops) and prof.busy_us is None and prof.idle_fraction is None
    assert op_group("_sparse_attention_fwd") == "attention" and op_group("append_kernel") == "append"
    assert op_group("sm90_xmma_gemm_bf16") == "gemm (torch)" and op_group("aten::add") == "torch other"
    # the MoE prefill GEMM's name holds "gemm": still the MoE's
    assert op_group("_fused_gemm_kernel") == "moe" and op_group("_quantize_rows_kernel") == "moe"
    assert op_group("compress_kernel") == "compress"  # V4's compressors
    eng = engine(checkpoint, profile=True)
    assert isinstance(eng.profiler, StepProfiler)
    eng.generate([[1, 2, 3], list(range(30))], SamplingParams(max_new_tokens=3), progress=False)
    assert set(eng.profiler.profiles) == {"decode", "prefill"}
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text(json.dumps([5, 6, 7]) + "\n" + json.dumps({"prompt_token_ids": [1, 2], "top_k": 3,
                                                                   "temperature": 1.0, "seed": 7}) + "\n")
    assert main(["generate", "--model", str(checkpoint), "--prompts", str(prompts), "--out", str(out), "--mode",
                 "reference", "--max-new-tokens", "3", "--no-progress", "--profile", "--indexer-path", "auto",
                 "token"]) == 0
    stdout = capsys.readouterr().out
    assert "cuda graphs: off (no CUDA device" in stdout and "cache bytes per token:" in stdout
    assert "profile of a decode step" in stdout and "profile of a prefill step" in stdout
    assert [len(json.loads(line)["token_ids"]) for line in out.read_text().splitlines()] == [3, 3]
