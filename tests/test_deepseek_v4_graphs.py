"""DeepSeek-V4's decode steps on the CUDA-graph path (:mod:`model_runner.cuda_graphs`), run eagerly on the CPU
(``capture=False``), in kernel mode with value checks off: padded to their bucket they give the tokens of unpadded
steps, their padding rows write only the scratch pages, and a padded step (V4's and V3.2's) reads nothing on the host.

The tiny V4 (FP8 projections, MXFP4 experts) has CSA 4:1 with an indexer keeping 3 entries, HCA 8:1 and a window of
8; prompts of 30, 21 and 5 tokens (3 sequences: bucket 4) decode 3 tokens, each sequence closing a CSA and an HCA
window on the way. The prompts are prefilled on the references (the interpreter is slow), the decode steps run the
Triton kernels.
"""
import pytest
import torch

from model_runner import SamplingParams, build_engine, save_random_checkpoint, tiny_config as v32_tiny_config
from model_runner.cuda_graphs import DecodeGraphs, unavailable_reason
from model_runner.families.deepseek_v4.config import CSA, HCA, tiny_config
from model_runner.ops import ReferenceOps
from tests.host_reads import host_access
from tests.threads import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(range(3, 33)), [100, 4, 4, 18, 77, 1, 36, 9, 9, 50, 2, 7, 8, 90, 11, 12, 13, 40, 41, 42, 5],
           [55, 3, 9, 120, 6]]  # 30, 21, 5 tokens: the 3 decode steps reach 33, 24, 8 (CSA and HCA windows close)
STEPS = 3
V4_SIZES = dict(num_pages=16, page_size=8, max_seq_len=48)
V32_SIZES = dict(num_pages=24, page_size=16, max_seq_len=64)


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4_graphs")
    save_random_checkpoint(tiny_config(hidden_size=128, o_lora_rank=128), folder, experts="mxfp4", dense="fp8",
                           seed=2)
    return folder


@pytest.fixture(scope="module")
def v32_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v32_graphs")
    save_random_checkpoint(v32_tiny_config(), folder, experts="mxfp4", seed=4)
    return folder


def prefilled(folder, sizes: dict, **kwargs):
    """A kernel-mode engine (fp16, value checks off, poisoned caches) with :data:`PROMPTS` prefilled in one step on
    the references, its sequences, and a :class:`DecodeGraphs` for 4 sequences (scratch pages taken; not the
    engine's yet)."""
    eng = build_engine(folder, mode="kernel", dtype=torch.float16, device="cpu", max_seqs=4, max_num_batched_tokens=64,
                       poison=True, check_values=False, **sizes, **kwargs)
    kernel_ops, eng.model.ops = eng.model.ops, ReferenceOps()
    seqs = [eng.add(p, SamplingParams(max_new_tokens=STEPS + 1)) for p in PROMPTS]
    eng.step()
    eng.model.ops = kernel_ops
    assert all(eng.scheduler.decoding(s) for s in seqs)
    return eng, seqs, DecodeGraphs(eng.model, eng.cache, 4, capture=False)


def decode(eng, seqs) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every decode step to the end: the tokens and each step's logits (as the model returned them)."""
    logs, forward = [], eng.model.forward
    eng.model.forward = lambda *args: logs.append(forward(*args)) or logs[-1]
    while eng.scheduler.busy:
        eng.step()
    return [s.output for s in seqs], logs


def written(eng, layer: int, name: str) -> int:
    """Rows of ``name`` in ``layer``'s storage that hold a value (the cache is poisoned with NaN)."""
    return int((~eng.cache.layers[layer][name].isnan().all(1)).sum())


def scratch_rows(graphs: DecodeGraphs, eng, name: str, layer: int) -> torch.Tensor:
    """Which rows of ``layer``'s array ``name`` are the scratch page of its stream (bool ``[rows]``)."""
    stream, _ = eng.cache.layout.widths(layer)[name]
    P, page = eng.cache.page_size, graphs.scratch[stream]
    rows = torch.zeros(eng.cache.layers[layer][name].shape[0], dtype=torch.bool)
    rows[page * P:(page + 1) * P] = True
    return rows


def test_padded_decode_steps_give_the_tokens_of_unpadded_steps(v4_checkpoint, monkeypatch):
    """3 sequences in bucket 4 over 3 decode steps: the same tokens, logits within fp16 rounding, finite logits
    in the padding row, whose block-table rows are the scratch pages; every cache row equal to the unpadded run's
    but the scratch pages', which the unpadded run never writes; the padding row wrote no compressed entry. Every
    sequence closed a CSA and an HCA window in the steps."""
    plain, plain_seqs, _ = prefilled(v4_checkpoint, V4_SIZES)  # its scratch pages taken too: the same pages
    padded, padded_seqs, graphs = prefilled(v4_checkpoint, V4_SIZES)
    padded.graphs = graphs
    seen, run = [], graphs._run
    monkeypatch.setattr(graphs, "_run", lambda b: seen.append(b) or run(b))
    compressed = [padded.model.config.layer_types.index(kind) for kind in (CSA, HCA)]
    before = [written(padded, i, "entries") for i in compressed]
    want, plain_logs = decode(plain, plain_seqs)
    got, padded_logs = decode(padded, padded_seqs)
    assert seen == [4] * STEPS
    assert got == want
    assert [written(padded, i, "entries") for i in compressed] == [n + len(PROMPTS) for n in before]
    for unpadded, step in zip(plain_logs, padded_logs):
        assert step.shape == (4, unpadded.shape[1]) and torch.isfinite(step[3]).all()
        torch.testing.assert_close(step[:3], unpadded, rtol=0, atol=2e-3)
    for name, table in graphs.batch(4).tables.items():  # the last step's batch: its padding row, every stream
        assert (table[3] == graphs.scratch[name]).all()  # reads and writes only the scratch pages
    for i, (unpadded, storage) in enumerate(zip(plain.cache.layers, padded.cache.layers)):
        for name, rows in storage.items():
            scratch = scratch_rows(graphs, padded, name, i)
            assert unpadded[name][scratch].isnan().all()
            torch.testing.assert_close(rows[~scratch], unpadded[name][~scratch], rtol=0, atol=2e-3, equal_nan=True)
            if name in ("entries", "index_keys"):
                assert rows[scratch].isnan().all()  # no window of a padding row closes


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v32"])
def test_a_padded_decode_step_reads_nothing_on_the_host(family, v4_checkpoint, v32_checkpoint):
    """After a warm-up step (plans, launch configs, the MoE scales' ranges), a padded decode step (bucket 4)
    reads no device value on the host and touches no file: it can be captured."""
    folder, sizes = (v4_checkpoint, V4_SIZES) if family == "deepseek_v4" else (v32_checkpoint, V32_SIZES)
    eng, seqs, graphs = prefilled(folder, sizes)
    ids, rows = [s.output[-1] for s in seqs], [s.seq_id for s in seqs]
    for r in rows:
        eng.cache.grow(r, eng.cache.length(r) + 2)
    graphs.forward(ids, rows)
    with host_access() as (counter, reads):
        graphs.forward(ids, rows)
    assert not counter.syncing() and not reads, (counter.syncing(), reads)


def test_the_host_read_detector_catches_reads():
    """Each way of reading a device value on the host shows up (an int repeat count does not read)."""
    t = torch.arange(3)
    for read in (lambda: t.sum().item(), lambda: int(t[1]), lambda: bool(t[1] > 0), lambda: float(t[2]),
                 lambda: t.tolist(), lambda: t.nonzero(), lambda: t.repeat_interleave(t)):
        with host_access() as (counter, reads):
            read()
        assert counter.syncing() or reads
    with host_access() as (counter, reads):
        t.repeat_interleave(2)
    assert not counter.syncing() and not reads


def test_which_models_replay(v4_checkpoint, v32_checkpoint):
    """On a CUDA device: V4 and V3.2 (FP8 indexer) in kernel mode with checks off replay; reference mode, value
    checks and V3.2's activation-precision indexer do not."""
    cuda = torch.device("cuda")

    def reason(folder, **kwargs):
        kwargs = {"mode": "kernel", "dtype": torch.float16, "check_values": False, **kwargs}
        return unavailable_reason(build_engine(folder, device="cpu", **kwargs).model, cuda)

    assert reason(v4_checkpoint) is None and reason(v32_checkpoint) is None
    assert reason(v4_checkpoint, mode="reference", dtype=torch.float32).startswith("needs kernel mode")
    assert reason(v4_checkpoint, check_values=True).startswith("needs kernel mode")
    assert reason(v32_checkpoint, index_precision="activation").startswith("needs the FP8 indexer")
