"""The shared FP8 workspace: leases never overlap under threads, views fit, growth, the memory report."""
import threading
import time

import pytest
import torch

import dsa_triton as dt
from dsa_triton.moe.mxfp4_spec import random_mxfp4
from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch
from dsa_triton.moe import workspace
from dsa_triton.moe.workspace import FP8Workspace, shared_workspace


def test_threads_never_share_a_slot():
    ws = FP8Workspace(5, [(8, 64)], "cpu")
    owner = [None] * ws.slots
    guard = threading.Lock()
    errors = []

    def worker(tid):
        for i in range(12):
            count = 1 + (tid + i) % 3
            with ws.acquire(count) as lease:
                with guard:
                    mine = range(lease.first, lease.first + count)
                    if any(owner[j] is not None for j in mine):
                        errors.append(f"thread {tid} got slots {list(mine)} held by {owner}")
                    for j in mine:
                        owner[j] = tid
                w, s = lease.views(8, 64)
                s.fill_(float(tid))
                time.sleep(0.001)
                if not bool((s == tid).all()):  # another holder wrote into these slots meanwhile
                    errors.append(f"thread {tid}: slot contents changed under the lease")
                with guard:
                    for j in mine:
                        owner[j] = None

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert owner == [None] * ws.slots and ws._free_run(ws.slots) == 0


def test_acquire_waits_then_times_out_and_rejects_bad_counts():
    ws = FP8Workspace(2, [(4, 32)], "cpu")
    with ws.acquire(2):
        with pytest.raises(TimeoutError):
            with ws.acquire(1, timeout=0.05):
                pass
    with ws.acquire(1) as a, ws.acquire(1) as b:
        assert {a.first, b.first} == {0, 1}
    with pytest.raises(ValueError, match="count"):
        with ws.acquire(3):
            pass
    released = []

    def late_release():
        with ws.acquire(2):
            time.sleep(0.05)
            released.append(time.perf_counter())

    t = threading.Thread(target=late_release)
    t.start()
    time.sleep(0.01)
    with ws.acquire(1, timeout=5):
        assert released  # we only got in after the other holder left
    t.join()


@pytest.mark.parametrize("count, timeout, match", [
    (1.5, 1.0, "count"), (True, 1.0, "count"), (0, None, "count"), (3, None, "count"), ("1", None, "count"),
    (1, -1.0, "timeout"), (1, "soon", "timeout"),
])
def test_a_bad_acquire_raises_at_once_and_changes_nothing(count, timeout, match):
    """A count that is not a whole number of slots can never be met: it raises instead of waiting (timeout 1 s
    bounds the wait where it would not); the slots stay free."""
    ws = FP8Workspace(2, [(4, 32)], "cpu")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        with ws.acquire(count, timeout=timeout):
            pass
    assert time.perf_counter() - start < 0.5
    assert ws._busy == [False, False] and ws._released == [None, None]
    with ws.acquire(2) as lease:
        assert (lease.first, lease.count) == (0, 2)


@pytest.mark.parametrize("slots, shapes, match", [
    (2.5, [(4, 32)], "slots"), (True, [(4, 32)], "slots"), (0, [(4, 32)], "slots"), ("2", [(4, 32)], "slots"),
    (2, [(4.5, 32)], "shapes"), (2, [(4, 0)], "shapes"), (2, [], "shapes"), (2, [(4, 32, 1)], "shapes"),
    (2, 4, "shapes"),
])
def test_bad_workspace_sizes_raise_naming_the_argument(slots, shapes, match):
    with pytest.raises(ValueError, match=match):
        FP8Workspace(slots, shapes, "cpu")


@pytest.mark.parametrize("slots, shapes, match", [(2**31, [(4, 32)], "slots"), (2, [(2**31, 32)], "shapes"),
                                                  (2, [(4, 2**40)], "shapes")])
def test_sizes_past_int32_raise_before_allocating(slots, shapes, match):
    """A size past 2^31 - 1 raises naming it before the allocation (it was an allocation RuntimeError)."""
    with pytest.raises(ValueError, match=match):
        FP8Workspace(slots, shapes, "cpu")


def test_views_fit_every_sized_shape_and_conversion_writes_into_them():
    ws = FP8Workspace(3, [(12, 96), (20, 32)], "cpu")
    with ws.acquire(2) as lease:
        for n, k in [(12, 96), (20, 32), (5, 64)]:
            w, s = lease.views(n, k)
            assert w.shape == (2, n, k) and s.shape == (2, n, -(-k // 128))
        with pytest.raises(ValueError, match="does not fit"):
            lease.views(14, 96)  # 1344 elements > 1152 rounded up to 1280
        blocks, scales = random_mxfp4((2, 12), 96, "cpu", seed=2)
        w, s, n_unfit = dt.mxfp4_to_fp8(blocks, scales, out=lease.views(12, 96))
        exact = mxfp4_dequantize_torch(blocks, scales, torch.float64)
        assert n_unfit == 0 and torch.equal(w.double() * s.double(), exact)  # one group: K = 96 < 128
        assert w.data_ptr() == ws.weights[lease.first].data_ptr()


def test_shared_workspace_is_reused_and_grows_to_the_peak(monkeypatch):
    monkeypatch.setattr(workspace, "_shared", {})  # start from no workspace, whatever ran before
    a = shared_workspace("cpu", 2, 16, 64)
    assert shared_workspace("cpu", 1, 8, 64) is a
    b = shared_workspace("cpu", 4, 16, 128)
    assert b is not a and b.holds(4, 16, 128) and b.holds(2, 16, 64)
    assert shared_workspace("cpu", 4, 16, 64) is b


def test_released_shared_workspaces_are_allocated_anew(monkeypatch):
    monkeypatch.setattr(workspace, "_shared", {})
    a = shared_workspace("cpu", 2, 16, 64)
    workspace.release_shared_workspaces()
    b = shared_workspace("cpu", 1, 8, 64)
    assert b is not a and b.holds(1, 8, 64) and not b.holds(2, 16, 64)  # sized for the requests since the release


def test_report_compares_with_offline_copies():
    ws = FP8Workspace(4, [(64, 256)], "cpu")
    r = ws.report(experts=8, shapes=[(64, 256), (256, 32)], layers=3)
    assert r["workspace_bytes"] == 4 * (64 * 256 + 4 * 64 * 2)
    assert r["offline_fp8_bytes"] == 3 * 8 * (64 * 256 + 4 * 64 * 2 + 256 * 32 + 4 * 256)
    assert r["bf16_bytes"] == 3 * 8 * 2 * (64 * 256 + 256 * 32)
    assert r["mxfp4_bytes"] == 3 * 8 * (64 * 256 + 256 * 32) * 17 // 32
    assert 0 < r["workspace_fraction_of_offline_fp8"] < 1
