"""DeepSeek-V4's compressors (dt.compress_entries, Triton interpreter, fp16) against their PyTorch oracle: CSA's 4:1
with the overlap and HCA-like ratios without, odd widths (a row padded to the next power of two), pages that windows
cross, sequences that start at 0 (window 0's empty overlap), close several windows or none; the window stream holds
only the last ``c m - 1`` cached tokens (older pages given back) and every other slot of both caches is NaN, so a stray
read or write shows. A sequence fed in chunks and decode steps gets the entries of one pass, bit for bit; bad
arguments raise a ValueError naming them before anything is written."""
from pathlib import Path

import pytest
import torch

import dsa_triton as dt
from dsa_triton import registry
from dsa_triton.attention.compress_entries_reference import compress_entries_torch, paged_slots
from dsa_triton.attention.compress_entries_spec import TENSORS, compare_entries, random_step
from tuner import shapes as sh

from .poison import poisoned_allocations

CASES = {  # (starts, new tokens) of each sequence, D, R, M, C, P
    "csa": ([0, 6, 17, 3], [9, 1, 6, 0], 48, 8, 4, 2, 4),
    "hca": ([5, 16, 0], [20, 3, 7], 40, 4, 8, 1, 8),
    "one_page_of_many": ([31], [1], 24, 12, 16, 1, 4),
}


def split(inputs: dict) -> tuple[list, dict]:
    return [inputs[k] for k in TENSORS], {k: inputs[k] for k in ("ratio", "overlap", "eps")}


@pytest.mark.parametrize("case", CASES)
def test_matches_the_reference(case):
    starts, counts, *dims = CASES[case]
    inputs = random_step(starts, counts, *dims, torch.float16, torch.Generator().manual_seed(1))
    args, kw = split(inputs)
    before, ref = inputs["entries"].clone(), inputs["entries"].clone()
    compress_entries_torch(*args[:5], ref, *args[6:], **kw)
    with poisoned_allocations():
        dt.compress_entries(*args, **kw)
    assert compare_entries(inputs["entries"], ref) is None  # (NaN alike: the same slots written)
    M = dims[2]
    closed = sum((s + n) // M - s // M for s, n in zip(starts, counts))
    assert int((before.isnan() & ~ref.isnan()).any(-1).sum()) == closed > 0
    bad = inputs["entries"].clone()
    bad[~bad.isnan()] *= 1.01
    assert compare_entries(bad, ref) is not None


def test_registry_entry():
    spec = registry.get("compress_entries")
    for phase in spec.phases:
        for shape in spec.bench_shapes(phase, False):
            inputs = spec.make_inputs(phase, shape, torch.device("cpu"), 3)
            before = inputs["entries"].clone()
            ref = spec.reference(inputs)
            assert spec.compare(spec.run(inputs, spec.default(phase, shape)), ref) is None
            assert int((before.isnan() & ~ref.isnan()).any(-1).sum()) > 0  # entries closed in the step


@pytest.mark.parametrize("overlap", [True, False])
def test_chunks_and_decode_steps_give_the_entries_of_one_pass(overlap):
    """Two sequences of 23 and 18 tokens fed in steps of uneven chunks (a sequence may sit a step out), the window
    stream written after each step as the runner does: the same entries as one pass, bit for bit, kernel and
    oracle alike."""
    D, R, M, C, P = 48, 8, 4 if overlap else 8, 2 if overlap else 1, 4
    g = torch.Generator().manual_seed(5)
    lens, steps = [23, 18], [(5, 3), (1, 7), (9, 0), (1, 1), (7, 7)]
    whole = random_step([0, 0], lens, D, R, M, C, P, torch.float16, g)
    table = torch.arange(12, dtype=torch.int32).view(2, 6)  # both streams: 6 pages of 4 a sequence
    window = [torch.full((12, P, C * D), float("nan"), dtype=torch.float16) for _ in range(2)]
    results = {}
    for op in (dt.compress_entries, compress_entries_torch):
        one_pass = torch.full((12, P, D), float("nan"), dtype=torch.float16)
        args = dict(whole, window_table=table, entry_table=table, entries=one_pass, kv_window=window[0],
                    gate_window=window[1])
        op(*[args[k] for k in TENSORS], **{k: args[k] for k in ("ratio", "overlap", "eps")})
        stepped, done = torch.full_like(one_pass, float("nan")), [0, 0]
        kv_w, gate_w = (torch.full_like(w, float("nan")) for w in window)
        for counts in steps:
            rows = torch.cat([torch.arange(done[b], done[b] + n) + sum(lens[:b]) for b, n in enumerate(counts)])
            step = dict(args, kv=whole["kv"][rows], gate=whole["gate"][rows], entries=stepped, kv_window=kv_w,
                        gate_window=gate_w, cu_seqlens=torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32),
                        seq_lens=torch.tensor([d + n for d, n in zip(done, counts)], dtype=torch.int32))
            op(*[step[k] for k in TENSORS], **{k: step[k] for k in ("ratio", "overlap", "eps")})
            for b, n in enumerate(counts):  # the runner keeps the step's inputs in the window stream
                slots = paged_slots(table[b], torch.arange(done[b], done[b] + n), P)
                src = rows[sum(counts[:b]):sum(counts[:b]) + n]
                kv_w.view(-1, C * D)[slots], gate_w.view(-1, C * D)[slots] = whole["kv"][src], whole["gate"][src]
                done[b] += n
        assert torch.equal(stepped.nan_to_num(7.0), one_pass.nan_to_num(7.0))
        results[op] = one_pass
    assert int((~one_pass.isnan()).any(-1).sum()) == sum(n // M for n in lens)
    assert compare_entries(*results.values()) is None


def bad_cases(inputs: dict):
    """(changes to the arguments, the message the ValueError starts with)."""
    kv, table = inputs["kv"], inputs["window_table"]
    bad_window = table.clone()
    bad_window[2, 3] = -1  # a page sequence 2's closing window reads (positions 12..15: its overlap)
    bad_entry = inputs["entry_table"].clone()
    bad_entry[0, 0] = 999
    return [
        ({"kv": kv.double()}, "kv: dtype"), ({"kv": kv[:, :-2], "gate": inputs["gate"][:, :-2]}, "kv: expected"),
        ({"overlap": False}, "kv: expected"), ({"overlap": 1}, "overlap: must be a bool"),
        ({"gate": inputs["gate"][:-1]}, "gate: dimension 0"),
        ({"kv_window": inputs["kv_window"][..., :-2]}, "kv_window: expected"),
        ({"gate_window": inputs["gate_window"][1:]}, "gate_window: shape and strides"),
        ({"entries": inputs["entries"].float()}, "entries: dtype"),
        ({"cu_seqlens": inputs["cu_seqlens"].long()}, "cu_seqlens: dtype"),
        ({"cu_seqlens": inputs["cu_seqlens"].flip(0)}, "cu_seqlens: must rise"),
        ({"seq_lens": inputs["seq_lens"] - 2}, "seq_lens: a sequence has fewer tokens"),
        ({"seq_lens": inputs["seq_lens"][:-1]}, "seq_lens: dimension 0"),
        ({"window_table": bad_window}, "window_table: a page a closing window reads"),
        ({"window_table": table[:2]}, "window_table: expected"),
        ({"entry_table": bad_entry}, "entry_table: a page a new entry goes to"),
        ({"entry_table": inputs["entry_table"][:, :1]}, "entry_table: a page a new entry goes to"),
        ({"ape": inputs["ape"][:-1]}, "ape: dimension 0"), ({"norm_weight": inputs["norm_weight"][1:]}, "norm_weight"),
        ({"cos": inputs["cos"][:2], "sin": inputs["sin"][:2]}, "cos: 2 rows"),
        ({"sin": inputs["sin"][:, 1:]}, "sin: dimension 1"), ({"cos": inputs["cos"][:, :0]}, "cos: expected"),
        ({"ratio": 0}, "ratio: must be an integer"), ({"ratio": 4.0}, "ratio: must be an integer"),
        ({"eps": 0.0}, "eps: must be"), ({"eps": True}, "eps: must be"),
        ({"max_q": 2}, "max_q: a sequence has more than 2"), ({"max_q": -1}, "max_q: must be"),
        ({"config": {"BLOCK_S": 64, "num_warps": 4}}, "compress_entries: BLOCK_S=64"),
    ]


def csa_step(seed: int = 2) -> dict:
    return random_step(*CASES["csa"], torch.float16, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("index", range(len(bad_cases(csa_step()))))
def test_bad_arguments_raise_before_anything_is_written(index):
    inputs = csa_step()
    changes, message = bad_cases(inputs)[index]
    args = {**inputs, **changes}
    before = inputs["entries"].clone()
    with pytest.raises(ValueError, match="^" + message):
        dt.compress_entries(*[args[k] for k in TENSORS], **{k: args[k] for k in ("ratio", "overlap", "eps")},
                            max_q=args["max_q"], config=args.get("config"))
    assert torch.equal(inputs["entries"].nan_to_num(7.0), before.nan_to_num(7.0))


def test_jobs_from_a_v4_config_only():
    """DeepSeek-V4-Flash's config poses the three compressors' shapes (and the indexer's logits); a V3.2 config none."""
    flash = sh.load_model_config(Path(__file__).resolve().parents[1] / "model_runner/configs/deepseek-v4-flash.json")
    shapes = sh.model_shapes(registry.get("compress_entries"), "decode", flash, batches=(8,))
    assert {(s["D"], s["M"], s["C"]) for s in shapes} == {(512, 4, 2), (128, 4, 2), (512, 128, 1)}
    assert {(s["H"], s["DK"]) for s in sh.model_shapes(registry.get("v4_indexer_logits"), "decode", flash,
                                                          batches=(8,), contexts=(8192,))} == {(64, 128)}
    for name in ("compress_entries", "v4_indexer_logits"):
        assert sh.model_shapes(registry.get(name), "decode", sh.load_model_config("deepseek-v3.2")) == []
