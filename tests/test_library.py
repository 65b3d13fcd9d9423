"""The custom ops under torch.ops.dsa (interpreter): opcheck of every op, a compiled graph equal to eager, the
check_values switch, the serving example."""
import contextlib
import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import dsa_triton as dt
from dsa_triton.library import HOST_READS, OPS, config_json, routing_kwargs
from dsa_triton.linear.formats import quantize_fp8_blockwise

from .host_reads import host_access
from .poison import poison_

D, DV, DK, H_IDX, P = 48, 32, 32, 4, 16  # latent row, value width, indexer dims and heads, page size
DEEPSEEK = dt.RoutingConfig("deepseek", top_k=2, n_group=3, topk_group=2, routed_scaling_factor=2.5)


def rng(seed):
    return torch.Generator().manual_seed(seed)


def cache_with(lens, seed=0, num_pages=8, device="cpu"):
    """A poisoned paged cache (fp16 latent rows, FP8 indexer keys) holding ``lens[b]`` random tokens of sequence b."""
    g = rng(seed)
    cache = dt.PagedCache(num_pages, P, len(lens), 4, D, DK, torch.float16, device, poison=True)
    n = sum(lens)
    cache.append(range(len(lens)), lens, torch.randn(n, D, generator=g).half().to(device),
                 torch.randn(n, DK, generator=g).to(device))
    return cache


def queries(T, g):
    q8, scale = dt.fp8_quantize_rows(torch.randn(T, H_IDX, DK, generator=g))
    return q8, torch.randn(T, H_IDX, generator=g) * scale * (H_IDX * DK) ** -0.5


def attention_inputs(seed=0, device="cpu"):
    """Two decode rows (one per sequence) over a cache of 40 and 23 tokens (the cache on ``device``, the rows on the
    CPU)."""
    g = rng(seed)
    cache = cache_with([40, 23], seed, device=device)
    q, w = queries(2, g)
    limits = cache.seq_lens.clone()
    return g, cache, q, w, limits


def mxfp4(shape, k, g, scale=1.0, device="cpu"):
    return dt.mxfp4_quantize((torch.randn(*shape, k, generator=g) * scale).to(device))


def moe_layer(tokens=3, experts=6, hidden=64, inter=32, seed=0, device="cpu"):
    """A MoE layer's input and weights, the MXFP4 experts on ``device`` (quantized there), the rest on the CPU."""
    g = rng(seed)
    gu_b, gu_s = mxfp4((experts, 2 * inter), hidden, g, hidden ** -0.5, device)
    dn_b, dn_s = mxfp4((experts, hidden), inter, g, inter ** -0.5, device)
    x = torch.randn(tokens, hidden, generator=g).half()
    router = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    bias = torch.randn(experts, generator=g) * 0.1
    shared = (torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).half(), \
        (torch.randn(hidden, inter, generator=g) * inter ** -0.5).half()
    return x, router, (gu_b, gu_s, dn_b, dn_s), bias, shared


def sort_of(tokens, experts, top_k, g):
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.int()
    return dt.sort_by_expert(ids, torch.rand(tokens, top_k, generator=g), experts)


# -- one (args, kwargs) per op ----------------------------------------------------------------------------------

def case_append_tokens():
    g = rng(1)
    cache = cache_with([20], 1)
    # 5 tokens at positions 20..24 of sequence 0: its page 1 (slots 4..8)
    items = torch.tensor([[0, 5, int(cache.block_table[0, 1]), 4]], dtype=torch.int32)
    new = (torch.randn(5, D, generator=g).half(), torch.randn(5, DK, generator=g))
    return (cache.kv, cache.ik, cache.ik_scale, cache.summaries, *new, items), {}


def case_indexer_logits():
    _, cache, q, w, limits = attention_inputs()
    return (q, w, cache.ik, cache.ik_scale, limits, 48), dict(
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), block_table=cache.block_table,
        seq_lens=cache.seq_lens, max_q=1)


def case_block_scores():
    _, cache, q, w, limits = attention_inputs()
    return (q, w, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits, P, 3), {}


def case_select_pages():
    bounds = torch.randn(2, 7, generator=rng(2))
    bounds[1, 4:] = float("-inf")
    return (bounds, 3), {}


def case_block_indexer_logits():
    _, cache, q, w, limits = attention_inputs()
    return (q, w, cache.ik, cache.ik_scale, cache.pmax, cache.pmin, cache.block_table, cache.seq_lens, limits,
            2, 40), dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_q=1)


def case_topk_indices():
    g = rng(3)
    return (torch.randn(2, 40, generator=g), 16), dict(lengths=torch.tensor([40, 5], dtype=torch.int32))


def case_sparse_attention_decode():
    g, cache, _, _, _ = attention_inputs()
    q = torch.randn(2, 4, D, generator=g).half()
    idx = torch.stack([torch.randperm(40, generator=g)[:12], torch.randperm(23, generator=g)[:12]]).int()
    idx[1, 8:] = -1
    return (q, cache.kv, idx, D ** -0.5, DV, cache.block_table), {}


def case_sparse_attention_prefill():
    g, cache, _, _, _ = attention_inputs()
    q = torch.randn(3, 4, D, generator=g).half()
    idx = torch.randint(0, 40, (3, 10), generator=g, dtype=torch.int32)
    return (q, cache.kv, idx, D ** -0.5, DV, cache.block_table[:1]), {}


def case_mxfp4_quantize():
    return (torch.randn(2, 5, 64, generator=rng(4)),), {}


def case_mxfp4_dequantize():
    blocks, scales = mxfp4((2, 5), 64, rng(5))
    return (blocks, scales, torch.float16), {}


def case_mxfp4_to_fp8():
    return mxfp4((3, 4), 160, rng(6)), {}


def case_mxfp4_to_fp8_out():
    blocks, scales = mxfp4((3, 4), 160, rng(6))
    w = torch.zeros(3, 4, 160, dtype=torch.float8_e4m3fn)
    return (blocks, scales, w, torch.zeros(3, 4, 2)), {}


def case_fp8_grouped_gemm():
    g = rng(7)
    blocks, scales = mxfp4((4, 24), 64, g, 0.1)
    offsets = torch.tensor([0, 3, 3, 9, 10], dtype=torch.int32)
    return (torch.randn(10, 64, generator=g).half(), offsets, blocks, scales, torch.zeros(1, dtype=torch.int32)), {}


def case_fused_moe_gemm():
    g = rng(8)
    blocks, scales = mxfp4((5, 48), 96, g, 0.1)
    sort = sort_of(3, 5, 2, g)
    x = torch.randn(3, 96, generator=g).half()
    return (x, sort.expert_offsets, sort.sorted_token, sort.sorted_expert, blocks, scales, 2), {}


def case_route_topk():
    g = rng(9)
    return (torch.randn(4, 6, generator=g), torch.randn(6, generator=g) * 0.1), routing_kwargs(DEEPSEEK)


def case_swiglu():
    return (torch.randn(3, 16, generator=rng(10)).half(),), dict(dtype=torch.float32, class_major=True)


def case_moe_forward():
    x, router, experts, bias, shared = moe_layer()
    return (x, router, *experts, bias, *shared), routing_kwargs(DEEPSEEK)


def case_fp8_blockwise_linear():
    g = rng(11)
    weight, scale = quantize_fp8_blockwise(torch.randn(40, 150, generator=g) * 150 ** -0.5)
    return (torch.randn(3, 150, generator=g).half(), weight, scale), {}


# -- the out variants: the plain op's case with a poisoned ``out`` where the schema has it ------------------------

def schema_names(name: str) -> list[str]:
    """The argument names of ``torch.ops.dsa.<name>``'s registered schema."""
    return [a.name for a in OPS[name].default._schema.arguments]


def out_at(name: str) -> int:
    """Where ``out`` is among ``<name>_out``'s arguments."""
    return schema_names(f"{name}_out").index("out")


RENAMED = {"mode": "routing_mode"}  # plain arguments an out variant names otherwise (moe_forward_out's docstring)


def with_out(name: str, shape, dtype):
    """``<name>_out``'s case from ``<name>``'s: the arguments ``out`` gives (those the out variant lacks) dropped, a
    poisoned ``out`` of ``shape`` and ``dtype`` inserted at its place in the schema."""
    def case():
        args, kwargs = CASES[name]()
        kept = set(schema_names(f"{name}_out"))
        args = [a for arg, a in zip(schema_names(name), args) if arg in kept]
        kwargs = {RENAMED.get(k, k): v for k, v in kwargs.items() if RENAMED.get(k, k) in kept}
        at = out_at(name)
        return (*args[:at], poison_(torch.empty(shape, dtype=dtype)), *args[at:]), kwargs
    return case


def plain_call(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The plain op's ``(args, kwargs)`` of an ``<name>_out`` call (:func:`with_out` undone): ``out`` taken out and
    what it gives put back, as the custom ops' contract says: a size is its width, a dtype its dtype."""
    at, back = out_at(name), {v: k for k, v in RENAMED.items()}
    out, kwargs = args[at], {back.get(k, k): v for k, v in kwargs.items()}
    given = set(schema_names(f"{name}_out"))
    for arg in schema_names(name):
        if arg not in given and arg not in kwargs:
            kwargs[arg] = out.dtype if arg.endswith("dtype") else out.shape[-1]
    return args[:at] + args[at + 1:], kwargs


case_indexer_logits_out = with_out("indexer_logits", (2, 48), torch.float32)
case_block_scores_out = with_out("block_scores", (2, 3), torch.float32)
case_select_pages_out = with_out("select_pages", (2, 3), torch.int32)
case_topk_indices_out = with_out("topk_indices", (2, 16), torch.int32)
case_mxfp4_dequantize_out = with_out("mxfp4_dequantize", (2, 5, 64), torch.float16)
case_fp8_grouped_gemm_out = with_out("fp8_grouped_gemm", (10, 24), torch.float16)
case_fused_moe_gemm_out = with_out("fused_moe_gemm", (6, 48), torch.float16)
case_swiglu_out = with_out("swiglu", (3, 4, 2), torch.float32)
case_moe_forward_out = with_out("moe_forward", (3, 64), torch.float16)
case_fp8_blockwise_linear_out = with_out("fp8_blockwise_linear", (3, 40), torch.float16)

CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}
OUT_OPS = sorted(name for name in OPS if f"{name}_out" in OPS and "out" in schema_names(f"{name}_out"))


# -- DeepSeek-V4's arguments: more cases of the same ops ----------------------------------------------------------

V4_D, V4_ROPE = 96, 32  # rows of 64 quantized (MODEL1) + 32 rope values; the values are all 96


def model1_pages(num_pages, g):
    """MODEL1 pages of random tokens (FlashMLA's page stride: not contiguous), the first page's bytes 0xFF (NaN)."""
    pages = dt.model1_cache(num_pages, P, V4_D - V4_ROPE, V4_ROPE, fill=0xFF)
    pages[1:] = dt.model1_quantize(torch.randn(num_pages - 1, P, V4_D, generator=g), V4_ROPE)
    return pages


def v4_case_sparse_attention_decode():
    """Two tokens per sequence with their own index sets: a window over MODEL1 pages (physical slots) and compressed
    entries over others, sinks, a length per sequence and per token."""
    g = rng(12)
    kv, kv2 = model1_pages(4, g), model1_pages(3, g)
    q = torch.randn(2, 2, 4, V4_D, generator=g).half()
    idx = (P + torch.randperm(3 * P, generator=g)[:24]).view(2, 2, 6).int()
    idx2 = (P + torch.randperm(2 * P, generator=g)[:20]).view(2, 2, 5).int()
    sink = torch.tensor([float("inf"), float("-inf"), 0.5, -1.0])
    return (q, kv, idx, V4_D ** -0.5, V4_D), dict(
        attn_sink=sink, topk_length=torch.tensor([6, 2], dtype=torch.int32), extra_kv_cache=kv2, extra_indices=idx2,
        extra_topk_length=torch.tensor([[5, 0], [3, 5]], dtype=torch.int32))


def v4_case_sparse_attention_prefill():
    """Three tokens over fp16 rows: logical positions through a block table per set."""
    g, cache, _, _, _ = attention_inputs(seed=4)
    q = torch.randn(3, 4, D, generator=g).half()
    idx = torch.randint(0, 40, (3, 10), generator=g, dtype=torch.int32)
    extra = torch.randint(0, 23, (3, 7), generator=g, dtype=torch.int32)
    return (q, cache.kv, idx, D ** -0.5, D, cache.block_table[:1]), dict(
        attn_sink=torch.randn(4, generator=g), topk_length=torch.tensor([10, 4, 0], dtype=torch.int32),
        extra_kv_cache=cache.kv, extra_indices=extra, extra_block_table=cache.block_table[1:2])


def v4_case_append_tokens():
    """Five rows into MODEL1 pages (no index keys)."""
    g = rng(13)
    items = torch.tensor([[0, 3, 1, 13], [3, 2, 2, 0]], dtype=torch.int32)
    return (model1_pages(3, g), None, None, None, torch.randn(5, V4_D, generator=g), None, items), dict(
        rope_dim=V4_ROPE)


V4_CASES = {name[len("v4_case_"):]: fn for name, fn in globals().items() if name.startswith("v4_case_")}
# (op, case) per opcheck: every op's case, and the DeepSeek-V4 ones
OPCHECKS = {**{name: (name, fn) for name, fn in CASES.items()}, **{f"{n}[v4]": (n, fn) for n, fn in V4_CASES.items()}}


def test_every_op_has_a_case():
    assert sorted(CASES) == sorted(OPS)


@contextlib.contextmanager
def float8_comparable():
    """opcheck's schema check compares inputs before and after with ``torch.allclose``, which CPU torch lacks for
    float8: compare float8 tensors by their bytes (exact) instead."""
    allclose = torch.allclose

    def patched(a, b, *args, **kwargs):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype == a.dtype:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    torch.allclose = patched
    try:
        yield
    finally:
        torch.allclose = allclose


@pytest.mark.parametrize("case", sorted(OPCHECKS))
def test_opcheck(case):
    """Every sub-test with the checks off (the path a compiled graph or a CUDA graph takes); the schema (declared
    mutations, no aliasing) with them on too, which runs the ``dt`` function with its value checks. Then, checks off
    and the shape warm (plan, launch config and scale ranges kept in memory), a call reads no device value on the
    host and touches no file: capturable in a CUDA graph."""
    name, make = OPCHECKS[case]
    args, kwargs = make()
    tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    with float8_comparable():
        torch.library.opcheck(OPS[name], args, dict(kwargs, check_values=False), test_utils=tests)
        torch.library.opcheck(OPS[name], args, dict(kwargs, check_values=True), test_utils=["test_schema"])
    if name in HOST_READS:  # the op's declared exception (these inputs and config need not avoid it)
        return
    OPS[name](*args, check_values=False, **kwargs)
    with host_access() as (counter, reads):
        OPS[name](*args, check_values=False, **kwargs)
    assert not counter.syncing() and not reads, (counter.syncing(), reads)


@pytest.mark.parametrize("name", OUT_OPS)
def test_an_out_variant_writes_what_the_op_returns(name):
    """``<op>_out`` fills every element of a poisoned ``out`` with the plain op's result (in place)."""
    args, kwargs = CASES[f"{name}_out"]()
    out = args[out_at(name)]
    plain_args, plain_kwargs = plain_call(name, args, kwargs)
    expected = OPS[name](*plain_args, check_values=False, **plain_kwargs)
    address = out.data_ptr()
    assert OPS[f"{name}_out"](*args, check_values=False, **kwargs) is None
    assert out.data_ptr() == address and out.dtype == expected.dtype and out.shape == expected.shape
    if name == "topk_indices":  # the order within a row may differ between runs
        out, expected = out.sort(1).values, expected.sort(1).values
    assert torch.equal(out, expected)


ROW_STRIDED = ("fp8_grouped_gemm", "fused_moe_gemm", "moe_forward")  # kernels that take out's row stride


@functools.lru_cache(maxsize=None)
def shared_out_case(name: str):
    """One ``<op>_out`` case per op for the tests that only write ``out`` (the inputs stay as they are)."""
    return CASES[f"{name}_out"]()


@pytest.mark.parametrize("name, check_values", [(n, False) for n in OUT_OPS] + [("mxfp4_dequantize", True)])
@pytest.mark.parametrize("bad", ["dtype", "rows", "row stride"])
def test_an_out_variant_checks_out(name, bad, check_values):
    """A wrong dtype or size is a ValueError naming ``out``, before any launch; a row stride is one where the kernels
    take it (and the result is right), else a ValueError too. (mxfp4_dequantize_out checks on its two paths.)"""
    args, kwargs = shared_out_case(name)
    at = out_at(name)
    out = args[at]
    if bad == "dtype":
        wrong = out.to(torch.float64)
    elif bad == "rows":
        wrong = poison_(torch.empty((out.shape[0] + 1, *out.shape[1:]), dtype=out.dtype))
    else:
        wrong = poison_(torch.empty(*out.shape[:-1], out.shape[-1] + 3, dtype=out.dtype))[..., :out.shape[-1]]
    before = wrong.clone()

    def call(target):
        return OPS[f"{name}_out"](*args[:at], target, *args[at + 1:], check_values=check_values, **kwargs)

    if bad == "row stride" and name in ROW_STRIDED:
        call(wrong)
        call(out)
        assert torch.equal(wrong, out)
        return
    with pytest.raises(ValueError, match="^out"):
        call(wrong)
    torch.testing.assert_close(wrong, before, rtol=0, atol=0, equal_nan=True)  # not written


class DecodeStep(torch.nn.Module):
    """One DSA decode step of a tiny layer through torch.ops.dsa: indexer logits over the paged FP8 keys, top-k
    (physical slots), sparse attention over the latent cache, an output projection, the MoE layer."""

    def __init__(self, k: int, max_len: int, seed: int = 0, device="cpu"):
        super().__init__()
        x, router, experts, bias, shared = moe_layer(seed=seed, device=device)
        hidden = x.shape[1]
        self.k, self.max_len = k, max_len
        self.register_buffer("w_o", (torch.randn(4 * DV, hidden, generator=rng(seed + 1)) * (4 * DV) ** -0.5).half())
        for name, t in zip(("router", "gu_b", "gu_s", "dn_b", "dn_s", "bias", "sh_gu", "sh_dn"),
                           (router, *experts, bias, *shared)):
            self.register_buffer(name, t)

    def forward(self, q_idx, w_idx, q, ik, ik_scale, kv, block_table, seq_lens, cu):
        dsa = torch.ops.dsa
        logits = dsa.indexer_logits(q_idx, w_idx, ik, ik_scale, seq_lens, self.max_len, cu_seqlens_q=cu,
                                    block_table=block_table, seq_lens=seq_lens, max_q=1, check_values=False)
        slots = dsa.topk_indices(logits, self.k, seq_lens, block_table=block_table, page_size=P, check_values=False)
        out, _ = dsa.sparse_attention_decode(q, kv, slots, D ** -0.5, DV, check_values=False)
        h = out.flatten(1) @ self.w_o
        return dsa.moe_forward(h, self.router, self.gu_b, self.gu_s, self.dn_b, self.dn_s, self.bias, self.sh_gu,
                               self.sh_dn, check_values=False, **routing_kwargs(DEEPSEEK))


def decode_step_case(device="cpu"):
    """``(module, args)``: a :class:`DecodeStep` (top-16 of 48 columns) and its arguments, two decode rows over
    caches of 40 and 23 tokens, on ``device`` (scripts/decode_step.py compiles it with inductor on the GPU)."""
    g, cache, q_idx, w_idx, _ = attention_inputs(seed=3, device=device)
    q = torch.randn(2, 4, D, generator=g).half()
    args = (q_idx, w_idx, q, cache.ik, cache.ik_scale, cache.kv, cache.block_table, cache.seq_lens,
            torch.tensor([0, 1, 2], dtype=torch.int32))
    return DecodeStep(k=16, max_len=48, device=device).to(device), tuple(a.to(device) for a in args)


def test_compiled_graph_equals_eager():
    step, args = decode_step_case()
    eager = step(*args)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    assert eager.shape == (2, 64) and eager.dtype == torch.float16 and torch.isfinite(eager).all()
    # the top-k order within a row may differ between runs: attention sums in another order
    torch.testing.assert_close(compiled, eager, rtol=2e-3, atol=2e-3)


def test_block_path_recipe_equals_the_token_path():
    """docs/integration.md's block-level recipe: with every page selected it attends to what the token path does."""
    g, cache, q_idx, w_idx, limits = attention_inputs(seed=5)
    q = torch.randn(2, 4, D, generator=g).half()
    fast = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_q=1, check_values=False)
    ops = torch.ops.dsa
    logits, positions, _ = ops.block_indexer_logits(q_idx, w_idx, cache.ik, cache.ik_scale, cache.pmax, cache.pmin,
                                                    cache.block_table, cache.seq_lens, limits, 4, 64, **fast)
    cols = ops.topk_indices(logits, 16, check_values=False)
    pos = torch.where(cols >= 0, positions.gather(1, cols.clamp_min(0).long()), -1)
    dense = ops.indexer_logits(q_idx, w_idx, cache.ik, cache.ik_scale, limits, 64, block_table=cache.block_table,
                               seq_lens=cache.seq_lens, **fast)
    token_pos = ops.topk_indices(dense, 16, limits, check_values=False)
    assert torch.equal(pos.sort(1).values, token_pos.sort(1).values)
    attend = lambda idx: ops.sparse_attention_decode(q, cache.kv, idx, D ** -0.5, DV, cache.block_table,  # noqa: E731
                                                     check_values=False)[0]
    torch.testing.assert_close(attend(pos), attend(token_pos), rtol=1e-3, atol=1e-3)


def test_config_strings():
    args, kwargs = case_swiglu()
    assert config_json(None) is None and json.loads(config_json({"path": "fused"})) == {"path": "fused"}
    with pytest.raises(ValueError, match="config"):
        OPS["select_pages"](*case_select_pages()[0], config="{not json")
    with pytest.raises(dt.ConfigError):
        OPS["select_pages"](*case_select_pages()[0], config=config_json({"TILE": 3, "num_warps": 4}))


def test_checks_on_reject_and_off_trust():
    """The switch reaches the op: an out-of-range length raises with the checks on; off, the call runs."""
    (scores, k), kwargs = case_topk_indices()
    bad = torch.tensor([41, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="lengths"):
        OPS["topk_indices"](scores, k, bad)
    args = case_sparse_attention_decode()[0]
    idx = args[2].clone()
    idx[0, 0] = 64  # past the block table's 4 pages of 16
    with pytest.raises(ValueError, match="indices"):
        OPS["sparse_attention_decode"](args[0], args[1], idx, *args[3:])
    out, _ = OPS["sparse_attention_decode"](args[0], args[1], idx, *args[3:], check_values=False)
    assert torch.isfinite(out).all()  # the bad index is skipped, never read


def test_serving_example_runs_on_the_cpu():
    path = Path(__file__).resolve().parents[1] / "examples" / "serving_backend.py"
    spec = importlib.util.spec_from_file_location("serving_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main("cpu")
