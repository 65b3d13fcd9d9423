"""DeepSeek-V4's indexer logits over compressed keys (dt.v4_indexer_logits, Triton interpreter, fp16) against the
PyTorch oracle (transformers' DeepseekV4IndexerScorer), and its top-k with dt.topk_indices: odd head counts and
widths, pages of 4 and 8, sequences of several rows (a prefill chunk) and of one (decode), rows that see no entry
yet; unused key slots and every buffer the op allocates are NaN. Bad arguments raise a ValueError naming them
before any launch."""
import pytest
import torch

import dsa_triton as dt
from dsa_triton.attention.compress_entries_reference import paged_slots
from dsa_triton.attention.indexer_logits_spec import compare_logits
from dsa_triton.attention.sparse_attention_spec import random_paged_cache
from dsa_triton.attention.topk_indices_reference import topk_indices_torch
from dsa_triton.attention.v4_indexer_logits_reference import v4_indexer_logits_torch

from .poison import check_registry_entry, poisoned_allocations


def problem(lens, rows, P, H=5, DK=24, M=4, seed=0):
    """Sequences of ``lens[b]`` tokens whose last ``rows[b]`` are queries: keys of their ``lens[b] // M`` entries
    (NaN elsewhere), queries, weights, limits ``(position + 1) // M``; the op's arguments."""
    g = torch.Generator().manual_seed(seed)
    entries = [n // M for n in lens]
    k, table = random_paged_cache(len(lens), max(max(entries), 1), P, DK, torch.float16, g)
    for b, n in enumerate(entries):  # keys past a sequence's entries: NaN
        k.view(-1, DK)[paged_slots(table[b], torch.arange(n, table.shape[1] * P), P)] = float("nan")
    limits = torch.tensor([(p + 1) // M for n, r in zip(lens, rows) for p in range(n - r, n)], dtype=torch.int32)
    T = sum(rows)
    return dict(q=torch.randn(T, H, DK, generator=g).half(), weights=torch.randn(T, H, generator=g) * H ** -0.5, k=k,
                limits=limits, block_table=table, seq_lens=torch.tensor(entries, dtype=torch.int32),
                softmax_scale=DK ** -0.5, cu_seqlens_q=torch.tensor([0] + rows).cumsum(0).int())


ARGS = ("q", "weights", "k", "limits", "block_table", "seq_lens", "softmax_scale")


def reference(p: dict, num_cols: int) -> torch.Tensor:
    return v4_indexer_logits_torch(*[p[n] for n in ARGS[:5]], p["softmax_scale"], num_cols,
                                   cu_seqlens_q=p["cu_seqlens_q"])


@pytest.mark.parametrize("lens, rows, P", [([29, 7, 14], [9, 1, 14], 4), ([33, 50], [1, 1], 8), ([3], [3], 4)])
def test_matches_the_reference_and_topk_picks_its_entries(lens, rows, P):
    p = problem(lens, rows, P)
    with poisoned_allocations():
        out = dt.v4_indexer_logits(*[p[n] for n in ARGS], cu_seqlens_q=p["cu_seqlens_q"])
        L = out.shape[1]
        assert L == max(lens) // 4
        picks = dt.topk_indices(out, 5, p["limits"]) if L else None
    ref = reference(p, L)
    assert compare_logits(out, ref) is None
    if picks is not None:
        want = topk_indices_torch(ref, 5, p["limits"])
        assert [set(r) for r in picks.tolist()] == [set(r) for r in want.tolist()]
        assert bool((picks < p["limits"][:, None]).all())  # never an entry a token does not see


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_registry_entry(phase):
    check_registry_entry("v4_indexer_logits", phase, 7)


def test_bad_arguments():
    p = problem([29, 7], [2, 1], 4)
    call = lambda **k: dt.v4_indexer_logits(*[{**p, **k}[n] for n in ARGS],  # noqa: E731
                                             cu_seqlens_q={**p, **k}["cu_seqlens_q"], num_cols=k.get("num_cols"))
    call()
    table = p["block_table"].clone()
    table[0, 1] = 99
    for changes, message in (
            ({"q": p["q"].float()}, "q: dtype"), ({"k": p["k"].float()}, "k: dtype"),
            ({"k": p["k"][:, :3]}, "k: page size"), ({"k": p["k"][..., :8]}, "k: last dimension"),
            ({"weights": p["weights"][:, :2]}, "weights"), ({"limits": p["limits"].long()}, "limits: dtype"),
            ({"limits": p["limits"] + 2}, "limits: a row's limit"), ({"limits": p["limits"] - 9}, "limits: must be"),
            ({"cu_seqlens_q": torch.tensor([0, 3, 2], dtype=torch.int32)}, "cu_seqlens_q"),
            ({"block_table": table}, "block_table"), ({"seq_lens": p["seq_lens"].long()}, "seq_lens: dtype"),
            ({"softmax_scale": float("nan")}, "softmax_scale"), ({"softmax_scale": True}, "softmax_scale"),
            ({"num_cols": -1}, "num_cols")):
        with pytest.raises(ValueError, match="^" + message):
            call(**changes)
