"""A serving engine's DSA attention backend and MXFP4 MoE method on ``torch.ops.dsa`` (see docs/integration.md).

One decode step of one layer, with every buffer preallocated and every op called with ``check_values=False``:

    append the step's tokens -> indexer logits -> top-k physical slots -> sparse attention -> MoE layer

Run it: ``python examples/serving_backend.py``. On the CPU (the Triton interpreter, tiny shapes, fp16) it runs the
step eagerly and checks every stage against plain-PyTorch references written out below. On a GPU (bf16) it does the
same, then captures the step in a CUDA graph, replays it on new inputs and checks the replay against an eager step.
Only the public API is used: ``import dsa_triton as dt`` and ``torch.ops.dsa``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dsa_triton as dt

ops = torch.ops.dsa  # registered by ``import dsa_triton``


class DSAAttentionBackend:
    """The attention backend of one DSA layer: its paged caches and the decode step's static buffers.

    The engine owns the pages: a sequence's pages are reserved on admission (here: all ``max_pages_per_seq`` of
    them) and written into ``block_table`` on the host, outside any graph. A decode step then only reads device
    tensors, so it can be captured once and replayed every step.
    """

    def __init__(self, max_seqs: int, page_size: int, max_pages_per_seq: int, *, heads: int, kv_dim: int, d_v: int,
                 index_heads: int, index_dim: int, top_k: int, dtype: torch.dtype, device: torch.device):
        self.P, self.top_k, self.d_v, self.dtype = page_size, top_k, d_v, dtype
        num_pages = max_seqs * max_pages_per_seq
        # the caches as raw tensors (PagedCache allocates them; its host-side append is the eager prefill route)
        cache = dt.PagedCache(num_pages, page_size, max_seqs, max_pages_per_seq, kv_dim, index_dim, dtype, device)
        self.kv, self.ik, self.ik_scale, self.summaries = cache.kv, cache.ik, cache.ik_scale, cache.summaries
        self.block_table, self.seq_lens = cache.block_table, cache.seq_lens
        self.allocator = dt.PageAllocator(num_pages)
        self.max_len = max_pages_per_seq * page_size  # the logits' width: a fixed bound, never max(seq_lens)
        self.sm_scale = kv_dim ** -0.5
        # one query row per sequence: cu_seqlens_q and max_q are fixed, so no size is read off the device
        self.cu_seqlens_q = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        # static inputs of the decode step: the engine copies each step's values into them before a replay
        B = max_seqs
        self.positions = torch.zeros(B, dtype=torch.int32, device=device)  # the new token's position per sequence
        self.q_index = torch.zeros(B, index_heads, index_dim, dtype=torch.float8_e4m3fn, device=device)
        self.w_index = torch.zeros(B, index_heads, dtype=torch.float32, device=device)
        self.q = torch.zeros(B, heads, kv_dim, dtype=dtype, device=device)
        self.new_kv = torch.zeros(B, kv_dim, dtype=dtype, device=device)
        self.new_index_k = torch.zeros(B, index_dim, dtype=torch.float32, device=device)
        self.rows = torch.arange(B, dtype=torch.int32, device=device)

    def admit(self, seq: int) -> None:
        """Reserve the sequence's pages (host side, outside the graph)."""
        pages = self.allocator.allocate(self.block_table.shape[1])
        self.block_table[seq] = torch.tensor(pages, dtype=torch.int32, device=self.block_table.device)

    def prefill(self, seq: int, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        """Write a prompt's rows at positions ``0 .. n-1``: work items built on the host, one per touched page."""
        n, P = kv.shape[0], self.P
        table = self.block_table[seq].tolist()
        items = [(r, min(P, n - r), table[r // P], 0) for r in range(0, n, P)]
        ops.append_tokens(self.kv, self.ik, self.ik_scale, self.summaries, kv, index_k,
                   torch.tensor(items, dtype=torch.int32, device=kv.device), check_values=True)  # not in a graph
        self.seq_lens[seq] = n

    def new_token_pages(self) -> torch.Tensor:
        """The page holding each sequence's new token (at ``positions``): ``[B]`` int32, from the device's block
        table. Its slot is ``page * P + positions % P``."""
        return self.block_table.gather(1, (self.positions // self.P).long()[:, None])[:, 0]

    def decode_step(self) -> dict[str, torch.Tensor]:
        """Append the step's token of every sequence, then indexer -> top-k -> sparse attention. Device work only."""
        P = self.P
        # one work item per sequence: (source row, 1 token, its page, its slot in the page), built on the device
        items = torch.stack([self.rows, torch.ones_like(self.rows), self.new_token_pages(), self.positions % P], 1)
        ops.append_tokens(self.kv, self.ik, self.ik_scale, self.summaries, self.new_kv, self.new_index_k, items,
                   check_values=False)
        self.seq_lens.copy_(self.positions + 1)
        logits = ops.indexer_logits(self.q_index, self.w_index, self.ik, self.ik_scale, self.seq_lens, self.max_len,
                                    cu_seqlens_q=self.cu_seqlens_q, block_table=self.block_table,
                                    seq_lens=self.seq_lens, max_q=1, check_values=False)
        slots = ops.topk_indices(logits, self.top_k, self.seq_lens, block_table=self.block_table, page_size=P,
                                 check_values=False)  # physical slots of kv viewed as [num_pages * P, kv_dim]
        out, lse = ops.sparse_attention_decode(self.q, self.kv, slots, self.sm_scale, self.d_v, check_values=False)
        return {"logits": logits, "slots": slots, "out": out, "lse": lse}


class MXFP4MoEMethod:
    """The MoE method of one layer: MXFP4 experts (gate_up ``[E, 2I, H/32, 16]``, down ``[E, H, I/32, 16]``), a
    DeepSeek router with its correction bias, and a shared expert."""

    def __init__(self, router_weight, router_bias, gate_up, down, shared_gate_up, shared_down, routing: dt.RoutingConfig):
        self.router_weight, self.router_bias = router_weight, router_bias
        self.gate_up, self.down = gate_up, down  # (blocks, scales) each
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        self.routing = dt.library.routing_kwargs(routing)  # mode, top_k, n_group, ... as op arguments
        self.num_experts = gate_up[0].shape[0]
        # the fused (decode) path, as the op's config string (made here: torch.compile does not trace json.dumps)
        self.config = dt.library.config_json({"path": "fused"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer in one op. ``config`` pins the fused (decode) path, which has no host read after its
        first call per weight; ``None`` would read the tuning database's path for this shape."""
        return ops.moe_forward(x, self.router_weight, *self.gate_up, *self.down, self.router_bias,
                               self.shared_gate_up, self.shared_down, **self.routing, check_values=False,
                               config=self.config)

    def forward_from_logits(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The same layer for an engine that computes the router logits itself: routing -> sort by expert ->
        gate_up -> SwiGLU -> down -> weighted combine plus the shared expert, op by op."""
        weights, ids = ops.route_topk(router_logits, self.router_bias, **self.routing, check_values=False)
        sort = dt.sort_and_align(ids, weights, self.num_experts, check_ids=False)  # one launch, no host read
        by_expert = (sort.expert_offsets, sort.sorted_token, sort.sorted_expert)
        top_k = self.routing["top_k"]
        h = ops.fused_moe_gemm(x, *by_expert, *self.gate_up, top_k, gather_tokens=True, out_dtype=torch.float32,
                               check_values=False)
        a = ops.swiglu(h, x.dtype, class_major=True, check_values=False)  # the layout the down GEMM reads
        y = ops.fused_moe_gemm(a, *by_expert, *self.down, top_k, gather_tokens=False, out_dtype=torch.float32,
                               check_values=False)
        per_slot = y[sort.slot_row.long()].view(x.shape[0], top_k, -1)
        shared = ops.swiglu(x @ self.shared_gate_up.t(), check_values=False) @ self.shared_down.t()
        routed = torch.bmm(sort.slot_weight.view(x.shape[0], 1, top_k), per_slot)[:, 0]
        return (routed + shared.float()).to(x.dtype)


# -- plain-PyTorch references (what the ops compute) ---------------------------------------------------------------

def indexer_logits_reference(attn: DSAAttentionBackend) -> torch.Tensor:
    """``score[b, s] = sum_h w[b, h] * relu(q[b, h] . k[s]) * k_scale[s]`` over positions ``s < seq_lens[b]``."""
    P, L = attn.P, attn.max_len
    pos = torch.arange(L, device=attn.kv.device)
    out = torch.full((attn.q_index.shape[0], L), float("-inf"), device=attn.kv.device)
    for b, n in enumerate(attn.seq_lens.tolist()):
        slot = attn.block_table[b].long()[pos[:n] // P] * P + pos[:n] % P
        k = attn.ik.flatten(0, 1)[slot].float() * attn.ik_scale.flatten()[slot, None]
        out[b, :n] = (attn.w_index[b, :, None] * torch.relu(attn.q_index[b].float() @ k.t())).sum(0)
    return out


def attention_reference(attn: DSAAttentionBackend, slots: torch.Tensor) -> torch.Tensor:
    """Softmax attention of every head over the rows at ``slots`` (-1 skipped), values their first d_v dims."""
    rows = attn.kv.flatten(0, 1).float()
    out = torch.zeros(*attn.q.shape[:2], attn.d_v, device=rows.device)
    for b in range(attn.q.shape[0]):
        kv = rows[slots[b][slots[b] >= 0].long()]
        p = torch.softmax(attn.q[b].float() @ kv.t() * attn.sm_scale, dim=-1)
        out[b] = p @ kv[:, :attn.d_v]
    return out


def moe_reference(moe: MXFP4MoEMethod, x: torch.Tensor) -> torch.Tensor:
    """Route with the torch router (:func:`dt.deepseek_topk`), then every token's experts on dequantized weights."""
    xf = x.float()
    r = moe.routing
    weights, ids = dt.deepseek_topk(xf @ moe.router_weight.float().t(), moe.router_bias, r["top_k"], r["n_group"],
                                    r["topk_group"], r["norm_topk_prob"], r["routed_scaling_factor"])
    w1, w2 = dt.mxfp4_dequantize(*moe.gate_up), dt.mxfp4_dequantize(*moe.down)

    def mlp(v, gate_up, down):
        gate, up = (v @ gate_up.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ down.t()

    out = mlp(xf, moe.shared_gate_up.float(), moe.shared_down.float())
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            out[t] += w * mlp(xf[t], w1[e], w2[e])
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float) -> None:
    """Finite, and within ``rel`` of the largest reference magnitude."""
    got, want = got.float(), want.float()
    assert torch.equal(got.isfinite(), want.isfinite()), f"{what}: -inf / finite entries differ"
    ok = want.isfinite()
    err = (got[ok] - want[ok]).abs().max().item() if ok.any() else 0.0
    assert err <= rel * max(want[ok].abs().max().item(), 1e-6), f"{what}: max error {err:.3g}"


def check_step(attn: DSAAttentionBackend, moe: MXFP4MoEMethod, step: dict, y: torch.Tensor, x: torch.Tensor,
               rel: float) -> None:
    """Every stage of a step against its reference."""
    P = attn.P
    slot_new = attn.new_token_pages() * P + attn.positions % P
    assert torch.equal(attn.kv.flatten(0, 1)[slot_new.long()], attn.new_kv), "append: the new latent rows"
    assert_close(step["logits"], indexer_logits_reference(attn), "indexer logits", rel)
    # top-k: the selected logits are the k largest (ties may pick either position)
    logits = step["logits"]
    positions = torch.arange(attn.max_len, device=logits.device)
    logical = attn.block_table.long()[:, positions // P] * P + positions % P  # [B, L] slot of each position
    for b in range(logits.shape[0]):
        chosen = step["slots"][b][step["slots"][b] >= 0]
        picked = logits[b][torch.isin(logical[b], chosen.long()) & (positions < attn.seq_lens[b])]
        want = logits[b].topk(min(attn.top_k, int(attn.seq_lens[b]))).values
        assert torch.equal(picked.sort().values, want.sort().values), "top-k: not the k largest logits"
    assert_close(step["out"], attention_reference(attn, step["slots"]), "sparse attention", rel)
    assert_close(y, moe_reference(moe, x), "MoE layer", 4 * rel)
    assert_close(moe.forward_from_logits(x, x.float() @ moe.router_weight.float().t()), y, "MoE op by op", 4 * rel)


# -- one layer, end to end -----------------------------------------------------------------------------------------

def build(device: torch.device, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *size, scale=1.0: (torch.randn(*size, generator=g) * scale).to(device)  # noqa: E731
    heads, kv_dim, d_v, hidden, inter, experts = 4, 48, 32, 64, 32, 6
    attn = DSAAttentionBackend(2, 16, 4, heads=heads, kv_dim=kv_dim, d_v=d_v, index_heads=4, index_dim=32, top_k=16,
                               dtype=dtype, device=device)
    for seq, n in enumerate((37, 20)):  # two prompts, prefilled eagerly
        attn.admit(seq)
        attn.prefill(seq, rand(n, kv_dim).to(dtype), rand(n, 32))
    routing = dt.RoutingConfig("deepseek", top_k=2, routed_scaling_factor=2.5)
    moe = MXFP4MoEMethod(rand(experts, hidden, scale=hidden ** -0.5), rand(experts, scale=0.1),
                         dt.mxfp4_quantize(rand(experts, 2 * inter, hidden, scale=hidden ** -0.5)),
                         dt.mxfp4_quantize(rand(experts, hidden, inter, scale=inter ** -0.5)),
                         rand(2 * inter, hidden, scale=hidden ** -0.5).to(dtype),
                         rand(hidden, inter, scale=inter ** -0.5).to(dtype), routing)
    w_o = rand(heads * d_v, hidden, scale=(heads * d_v) ** -0.5).to(dtype)
    return attn, moe, w_o, rand


def new_inputs(attn: DSAAttentionBackend, rand) -> None:
    """The next decode token of every sequence, copied into the static buffers."""
    attn.positions.copy_(attn.seq_lens)
    q8, q_scale = dt.fp8_quantize_rows(rand(*attn.q_index.shape))
    attn.q_index.copy_(q8)
    attn.w_index.copy_(rand(*attn.w_index.shape) * q_scale * (q8.shape[1] * q8.shape[2]) ** -0.5)
    attn.q.copy_(rand(*attn.q.shape).to(attn.dtype))
    attn.new_kv.copy_(rand(*attn.new_kv.shape).to(attn.dtype))
    attn.new_index_k.copy_(rand(*attn.new_index_k.shape))


def capture(fn):
    """``(graph, outputs)``: ``fn()`` run once on a side stream (as ``torch.cuda.graph`` asks), then captured in a CUDA
    graph whose ``replay()`` rewrites ``outputs``. ``fn`` must be warm (called once eagerly) and safe to repeat."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def main(device: str | None = None) -> None:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # interpreter: no bf16 dots
    attn, moe, w_o, rand = build(device, dtype)

    def layer_step():
        step = attn.decode_step()
        x = step["out"].flatten(1) @ w_o  # the output projection, then the MoE layer
        return step, x, moe.forward(x)

    new_inputs(attn, rand)
    step, x, y = layer_step()  # eager; also the warm-up a capture needs (plans, configs, scale ranges)
    rel = 2e-2 if dtype == torch.bfloat16 else 2e-3
    check_step(attn, moe, step, y, x, rel)
    print(f"eager decode step on {device}: every stage matches its reference")
    if device.type != "cuda":
        return
    graph, (g_step, g_x, g_y) = capture(layer_step)  # its side-stream warm-up rewrites the same rows (idempotent)
    for _ in range(3):  # the next tokens: new inputs into the static buffers, replay, compare with an eager step
        new_inputs(attn, rand)
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: v.clone() for k, v in g_step.items()}, g_x.clone(), g_y.clone()
        check_step(attn, moe, replayed[0], replayed[2], replayed[1], rel)
        step, x, y = layer_step()
        assert_close(replayed[2], y, "graph replay vs eager", rel)
    print("CUDA graph of the decode step: replays match eager steps and the references")


if __name__ == "__main__":
    main()
