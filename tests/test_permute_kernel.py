"""sort_and_align (one Triton launch) against permute.sort_by_expert + align_blocks (torch), in the interpreter:
every output tensor equal, bit for bit, on fresh random routings (experts without slots, all slots on one
expert, E = 256 / 7 / 1, top_k 1 / 2 / 8, T = 0 / 1 / 5 / 64, block_m 1 / 8 / 16, int32 / int64 ids,
weights None / fp32 / fp16 / bf16, strided inputs), the torch fallbacks, the plan cache and argument checks.
The one output buffer comes from a poisoned allocation (-2), so an element the kernel misses shows."""
import importlib

import pytest
import torch

from dsa_triton import ConfigError
from dsa_triton.plans import PlanCache
from dsa_triton.moe import permute
from dsa_triton.moe.permute import sort_by_expert
from dsa_triton.moe.sort_and_align import sort_and_align
from dsa_triton.moe.sort_and_align_spec import SPEC, compare_permutations, permutation_tensors

op_module = importlib.import_module("dsa_triton.moe.sort_and_align")  # the module: dsa_triton.moe exports the function
from tests.poison import poisoned_allocations

WEIGHT_DTYPES = {"none": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def routing(tokens, experts, top_k, id_dtype, weights, seed, one_expert=False, distinct=True):
    """``(ids [T, top_k], weights [T, top_k] or None)``: top_k distinct experts per token (or repeats, or
    every slot on one expert), weights uniform in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    if one_expert:
        ids = torch.full((tokens, top_k), experts // 2)
    elif distinct:
        ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k]
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    dtype = WEIGHT_DTYPES[weights]
    w = None if dtype is None else torch.rand(tokens, top_k, generator=g).to(dtype)
    return ids.to(id_dtype), w


def torch_tensors(ids, weights, experts, block_m):
    return permutation_tensors(sort_by_expert(ids, weights, experts), block_m)  # aligned by sort.aligned


def assert_matches_torch(ids, weights, experts, block_m, **kwargs):
    with poisoned_allocations():
        sort = sort_and_align(ids, weights, experts, block_m, **kwargs)
    if block_m:
        assert block_m in sort._aligned  # filled by the launch, not on demand
    out = permutation_tensors(sort, block_m)
    ref = torch_tensors(ids, weights, experts, block_m)
    assert compare_permutations(out, ref) is None, compare_permutations(out, ref)
    if block_m:  # the GEMM reads element b * block_m of the buffer behind block_expert
        assert sort.aligned(block_m).block_expert.stride() == (block_m,)
    return sort


@pytest.mark.parametrize("tokens, experts, top_k, block_m, id_dtype, weights", [
    (5, 256, 8, 8, torch.int32, "fp32"),     # DeepSeek-V3.2 decode: most experts get no slot
    (64, 256, 8, 8, torch.int32, "fp32"),    # 512 slots
    (1, 256, 8, 16, torch.int64, "fp32"),
    (64, 7, 2, 16, torch.int64, "bf16"),     # every expert used, several blocks each
    (5, 7, 2, 1, torch.int32, "none"),       # block_m 1: no padding
    (5, 7, 1, 8, torch.int32, "fp16"),       # top_k 1
    (5, 1, 1, 8, torch.int64, "fp32"),       # one expert
    (1, 7, 2, None, torch.int32, "bf16"),    # sort only
])
def test_matches_torch(tokens, experts, top_k, block_m, id_dtype, weights):
    ids, w = routing(tokens, experts, top_k, id_dtype, weights, seed=tokens * 100 + experts + top_k)
    sort = assert_matches_torch(ids, w, experts, block_m)
    if weights == "fp32":  # a view of the router's weights, as sort_by_expert gives
        assert sort.slot_weight.data_ptr() == w.data_ptr()


def test_all_slots_on_one_expert_and_repeated_experts():
    ids, w = routing(6, 12, 3, torch.int32, "fp32", seed=1, one_expert=True)
    assert_matches_torch(ids, w, 12, 8)
    ids, w = routing(6, 12, 3, torch.int64, "bf16", seed=2, distinct=False)  # an expert twice in one token
    assert_matches_torch(ids, w, 12, 4)


def test_strided_ids_and_weights():
    g = torch.Generator().manual_seed(3)
    wide_ids = torch.randint(0, 9, (5, 7), generator=g, dtype=torch.int64)
    wide_w = torch.rand(5, 7, generator=g)
    assert_matches_torch(wide_ids[:, 1:4], wide_w[:, 1:4], 9, 8)  # row stride 7: weights copied in the kernel
    assert_matches_torch(wide_ids.t()[:3], wide_w.t()[:3], 9, 2)  # column-major


def test_unchecked_out_of_range_ids_stay_in_bounds():
    """check_ids=False: ids outside [0, E) give unspecified outputs but no access out of bounds: every slot
    lands once in the permutation, and only the in-range ones are counted per expert."""
    ids = torch.tensor([[0, 5], [-3, 2], [100, 1]], dtype=torch.int32)
    with poisoned_allocations():
        sort = sort_and_align(ids, torch.rand(3, 2), 8, 4, check_ids=False)
    assert sorted(sort.slot_row.tolist()) == list(range(6))
    assert int(sort.expert_offsets[-1]) == 4


def test_zero_tokens_take_the_torch_path(monkeypatch):
    monkeypatch.setattr(op_module, "_permute_kernel", None)  # a launch would fail
    ids, w = routing(0, 8, 2, torch.int32, "fp32", seed=0)
    assert_matches_torch(ids, w, 8, 8)


def test_above_the_bounds_the_torch_functions_run_without_a_launch(monkeypatch):
    monkeypatch.setattr(op_module, "_permute_kernel", None)
    monkeypatch.setattr(op_module, "_PLANS", PlanCache())
    ids, w = routing(513, 16, 8, torch.int32, "fp32", seed=4)  # 4104 slots > MAX_ROWS
    assert_matches_torch(ids, w, 16, 8)
    monkeypatch.setattr(op_module, "MAX_EXPERTS", 8)
    ids, w = routing(3, 9, 2, torch.int64, "none", seed=5)
    assert_matches_torch(ids, w, 9, 4)


def test_alignment_beyond_the_padding_tile_is_made_on_demand():
    ids, w = routing(5, 256, 8, torch.int32, "fp32", seed=6)
    with poisoned_allocations():
        sort = sort_and_align(ids, w, 256, 256)  # 256 experts x 256 padding rows: over MAX_PAD_TILE
    assert not sort._aligned
    assert compare_permutations(permutation_tensors(sort, 256), torch_tensors(ids, w, 256, 256)) is None


def test_the_filled_alignment_is_what_the_gemm_reads(monkeypatch):
    ids, w = routing(3, 10, 2, torch.int32, "fp32", seed=7)
    sort = sort_and_align(ids, w, 10, 8)
    monkeypatch.setattr(permute, "align_blocks", None)  # aligned(8) must not compute it again
    assert sort.aligned(8) is sort._aligned[8]


def test_plan_cache_hit_and_configs():
    for seed in (8, 9):  # same shapes: the second call reuses the plan, on new values
        ids, w = routing(6, 20, 4, torch.int32, "fp32", seed=seed)
        assert_matches_torch(ids, w, 20, 8)
    for warps in (1, 16):
        assert_matches_torch(ids, w, 20, 8, config={"num_warps": warps})
    with pytest.raises(ConfigError, match="num_warps"):
        sort_and_align(ids, w, 20, 8, config={"num_warps": 3})


@pytest.mark.parametrize("make, name", [
    (lambda ids, w: dict(topk_ids=ids.float()), "topk_ids"),
    (lambda ids, w: dict(topk_ids=ids[:, 0]), "topk_ids"),
    (lambda ids, w: dict(topk_ids=ids + 10), "topk_ids"),  # out of [0, E): check_ids reads them
    (lambda ids, w: dict(topk_ids=ids - 20), "topk_ids"),
    (lambda ids, w: dict(topk_weights=w[:, :1]), "topk_weights"),
    (lambda ids, w: dict(topk_weights=w.double()), "topk_weights"),
    (lambda ids, w: dict(num_experts=0), "num_experts"),
    (lambda ids, w: dict(num_experts=1), "topk_ids"),  # top_k 2 > E
    (lambda ids, w: dict(num_experts=10.0), "num_experts"),
    (lambda ids, w: dict(block_m=0), "block_m"),
    (lambda ids, w: dict(block_m=True), "block_m"),
])
def test_bad_arguments_raise_naming_them(monkeypatch, make, name):
    monkeypatch.setattr(op_module, "_permute_kernel", None)  # raised before any launch
    ids, w = routing(4, 10, 2, torch.int32, "fp32", seed=10)
    kwargs = dict(topk_ids=ids, topk_weights=w, num_experts=10, block_m=8) | make(ids, w)
    with pytest.raises(ValueError, match=name):
        sort_and_align(**kwargs)


def test_registry_entry_runs_and_its_compare_can_fail():
    for shape in SPEC.bench_shapes("decode", False):
        inputs = SPEC.make_inputs("decode", shape, "cpu", 11)
        out = SPEC.run(inputs, SPEC.launch_config("decode", shape, "cpu"))
        ref = SPEC.reference(inputs)
        assert SPEC.compare(out, ref) is None
        out["slot_row"] = out["slot_row"].flip(0)
        assert "slot_row" in SPEC.compare(out, ref)
    assert [s["T"] for s in SPEC.bench_shapes("decode", True)] == [1, 64, 256]
