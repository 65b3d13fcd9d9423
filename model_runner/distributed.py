"""More than one process: expert-parallel MoE and data-parallel attention on ``torch.distributed`` (NCCL on GPUs,
gloo on CPUs), launched with torchrun::

    torchrun --nproc-per-node 2 -m model_runner generate --model DIR --prompts IN.jsonl --out OUT.jsonl

- Process group (:func:`setup`): torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR`` /
  ``MASTER_PORT``); a GPU rank runs on ``cuda:LOCAL_RANK``. One process (``WORLD_SIZE`` absent or 1) is the plain
  runner: :func:`setup` returns None and nothing here runs. The group is handed to what needs it: the model build
  (:func:`.build.build_engine`), hence the MoE layers and the engine.
- Expert ownership (:meth:`Parallel.owned`): rank ``r`` of ``W`` holds experts ``[r E // W, (r + 1) E // W)`` of
  every MoE layer, and the loader reads only those; everything else (embeddings, attention, dense MLPs, router,
  shared expert, head) is on every rank.
- Data-parallel attention (:meth:`.engine.Engine.run` of an engine built with the group): prompt ``i`` runs on
  rank ``i % W`` (:func:`share`), each rank with its own paged caches and scheduler; every rank returns all
  sequences in prompt order.
- The MoE layer (:meth:`Parallel.moe`, called by a :class:`.model.MoE` built with the group): each rank routes its
  own tokens; each (token, choice) row goes to its expert's rank. The row counts are exchanged first (one
  ``all_to_all_single`` of ``W`` integers, read on the host to size the buffers), then the rows (activation dtype
  and local expert id packed as bytes: one ``all_to_all_single``); the owner runs its experts on what it received
  (``ops.experts``: fp32, unweighted) and the results return by the same route (fp32); the origin sums each token's
  rows with its routing weights in fp32 (one batched matmul, as :func:`dsa_triton.moe.permute.combine_rows`) and
  rounds once to the activation dtype. Three collectives per MoE layer and step.
- Ranks step together: each step is one forward on every rank. A rank with nothing to run joins each MoE layer's
  collectives with no tokens (:meth:`.model.Model.idle`); one all-reduce per step tells whether any rank has work
  left. An error inside a step on one rank ends that process; torchrun then ends the others.

gloo implements ``all_to_all_single`` with uneven splits (checked with torch 2.13), so one code path serves both
backends.
"""
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import RunnerError

_ACTIVE: "Parallel | None" = None


@dataclass
class Parallel:
    """This process's place in the group. ``timed``: synchronize the device around each collective, so that
    ``stats["seconds"]`` is the time spent in collectives (else it is host time only)."""
    rank: int
    world_size: int
    device: torch.device
    group: object = None  # None: the default group
    timed: bool = False
    stats: dict = field(default_factory=lambda: {"collectives": 0, "bytes": 0, "seconds": 0.0})

    def owned(self, num_experts: int) -> range:
        """The expert ids this rank holds (of each MoE layer)."""
        if num_experts < self.world_size:
            raise RunnerError(f"experts: {num_experts} experts cannot be split over {self.world_size} ranks")
        return range(self.rank * num_experts // self.world_size, (self.rank + 1) * num_experts // self.world_size)

    @contextmanager
    def _collective(self, nbytes: int):
        if self.timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats["seconds"] += time.perf_counter() - start
        self.stats["collectives"] += 1
        self.stats["bytes"] += nbytes

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``send`` (the first ``send_counts[0]`` to rank 0, the next ``send_counts[1]`` to rank 1, ...)
        -> the rows received, ``recv_counts[r]`` from rank ``r``, in rank order."""
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        with self._collective(send.numel() * send.element_size()):
            dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """``send_counts[W]`` (rows for each rank) -> the rows each rank sends here (read on the host)."""
        recv = torch.empty_like(send_counts)
        with self._collective(send_counts.numel() * send_counts.element_size()):
            dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any."""
        t = torch.tensor([int(flag)], device=self.device)
        with self._collective(t.element_size()):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def all_gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (pickled)."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def moe(self, x: torch.Tensor, layer, ops) -> torch.Tensor:
        """The routed experts' output ``[T, H]`` in ``x``'s dtype for this rank's tokens ``x[T, H]`` (``T`` may be
        0); ``layer`` a :class:`.model.MoE` holding this rank's experts, ``ops`` the model's backend."""
        num_experts, top_k = layer.router.shape[0], layer.routing.top_k
        mine = self.owned(num_experts)
        if layer.experts[0].shape[0] != len(mine):
            raise RunnerError(f"experts: rank {self.rank} of {self.world_size} holds {layer.experts[0].shape[0]} "
                              f"experts, expected {len(mine)} (experts {mine.start}..{mine.stop - 1}): load only "
                              f"this rank's experts (build the engine with this group)")
        tokens, hidden = x.shape
        first = torch.tensor([r * num_experts // self.world_size for r in range(self.world_size + 1)],
                             device=x.device)
        if tokens:
            weights, ids = ops.route(F.linear(x.float(), layer.router.float()), layer.routing, layer.bias)
        else:
            weights = torch.empty(0, top_k, device=x.device)
            ids = torch.empty(0, top_k, dtype=torch.int64, device=x.device)
        slot_expert = ids.reshape(-1).long()
        owner = torch.bucketize(slot_expert, first[1:-1], right=True)
        order = torch.argsort(owner, stable=True)  # slots grouped by rank, in slot order within a rank
        send_counts = torch.bincount(owner, minlength=self.world_size)
        recv_counts = self.exchange_counts(send_counts)
        send_list = send_counts.tolist()
        rows = x[order // top_k]
        local = (slot_expert[order] - first[owner[order]]).to(torch.int32)
        packed = torch.cat([_as_bytes(rows), _as_bytes(local.view(-1, 1))], dim=1)
        got = self.all_to_all(packed, send_list, recv_counts)
        row_bytes = hidden * x.element_size()
        got_rows = got[:, :row_bytes].contiguous().view(x.dtype)
        got_ids = got[:, row_bytes:].contiguous().view(torch.int32).view(-1)
        out = (ops.experts(got_rows, got_ids, *layer.experts) if got.shape[0]
               else torch.empty(0, hidden, dtype=torch.float32, device=x.device))
        back = self.all_to_all(out, recv_counts, send_list)  # fp32 rows in ``order``
        per_slot = torch.empty_like(back)
        per_slot[order] = back
        combined = torch.bmm(weights.float().reshape(tokens, 1, top_k), per_slot.view(tokens, top_k, hidden))
        return combined.view(tokens, hidden).to(x.dtype)

    def memory(self, config, tokens_per_step: int, dtype: torch.dtype) -> dict[str, int]:
        """The memory plan's line for the dispatch / combine buffers of one MoE layer at ``tokens_per_step`` tokens
        (at most: every rank sends all its rows here)."""
        sent = tokens_per_step * config.num_experts_per_tok
        received = sent * self.world_size
        row = config.hidden_size * torch.tensor([], dtype=dtype).element_size()
        fp32_row = config.hidden_size * 4
        sender = sent * (2 * row + 4 + 2 * fp32_row)  # gathered rows, packed rows + ids, results back, per slot
        receiver = received * (2 * row + 4 + fp32_row)  # received packed rows, unpacked rows, expert results
        return {"workspace: expert-parallel dispatch / combine (at most)": sender + receiver}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t[N, ...]`` as ``uint8 [N, bytes per row]`` (the same memory)."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], math.prod(t.shape[1:]) * t.element_size())


def setup(backend: str | None = None) -> Parallel | None:
    """Join the process group torchrun describes in the environment (``backend``: default NCCL when CUDA is
    available, else gloo); None when ``WORLD_SIZE`` is absent or 1. The group is kept process-wide until
    :func:`shutdown` (a second call returns it)."""
    global _ACTIVE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or _ACTIVE is not None:
        return _ACTIVE
    if "RANK" not in os.environ:
        raise RunnerError(f"distributed: WORLD_SIZE is {world} but RANK is not set (launch with torchrun)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    _ACTIVE = Parallel(rank, world, device)
    return _ACTIVE


def shutdown() -> None:
    """Leave the process group (after the last collective)."""
    global _ACTIVE
    if _ACTIVE is not None and dist.is_initialized():
        dist.destroy_process_group()
    _ACTIVE = None


class Solo:
    """One process in the place of a group: rank 0 of 1, whose collectives return what this process gives."""
    rank, world_size = 0, 1

    @staticmethod
    def any(flag: bool) -> bool:
        return flag

    @staticmethod
    def all_gather(obj) -> list:
        return [obj]


def share(count: int, group: Parallel | Solo) -> range:
    """The request indices of ``group``'s rank (round robin over ranks)."""
    return range(group.rank, count, group.world_size)
