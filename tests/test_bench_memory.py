"""The bench's memory accounting: rows that do not fit the device are skipped with the reason, not failed; the device
memory outside PyTorch's allocator is measured after each row (GPU) and the context's stack released."""
import os

import torch

from dsa_triton import runtime
from dsa_triton.bench import run
from dsa_triton.bench.harness import Measurement, does_not_fit, settle


def test_off_the_gpu_nothing_is_measured_or_released():
    assert runtime.stack_bytes("cpu") is None and runtime.device_memory("cpu") is None
    assert runtime.release_stack("cpu") is False and settle("cpu") == {}


def test_out_of_memory_is_told_apart():
    assert does_not_fit(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB"))
    assert does_not_fit(RuntimeError("CUDA error: out of memory"))
    assert not does_not_fit(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_summary_skips_what_does_not_fit_and_fails_the_rest():
    ok = Measurement("a", "decode", "B=1", "{}", 1.0)
    skipped = Measurement("b", "prefill", "T=4096", "{}", float("nan"),
                          check="skipped: does not fit (2.0 of 79.6 GiB free)")
    line, fine = run.summary([ok, skipped], {"moe_prefill": [{"skipped": "does not fit (1.0 of 79.6 GiB free)"}]})
    assert fine and line.startswith("1/1 checks ok (2 skipped: ") and "b prefill T=4096" in line
    broken = Measurement("c", "decode", "B=2", "{}", 1.0, check="max error 1e-1")
    line, fine = run.summary([ok, broken], {}, {"end_mib": 600.0, "peak_mib": 900.0, "peak_row": "a decode B=1",
                                                "peak_stack_bytes": 2048})
    assert not fine and "1/2 checks ok" in line and "failed:" in line and "600 MiB at the end" in line


def test_a_row_that_runs_out_of_memory_is_skipped(tmp_path, monkeypatch, capsys):
    real = run.bench_kernel

    def bench_kernel(spec, phase, shape, device, ceilings):
        if phase == "prefill":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB")
        return real(spec, phase, shape, device, ceilings)

    monkeypatch.setattr(run, "bench_kernel", bench_kernel)
    assert run.main(["--kernels", "fp8_blockwise_linear", "--no-reports", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("1/1 checks ok (1 skipped: fp8_blockwise_linear prefill") and "does not fit" in last


def test_the_flashmla_report_says_when_flashmla_is_not_here():
    from dsa_triton.bench.reports import REPORTS

    assert REPORTS["sparse_attention_flashmla"]("cpu", None) == [
        {"skipped": "FlashMLA is not built here (scripts/flashmla_build.sh, on a GPU)"}]
    line, fine = run.summary([], {"sparse_attention_flashmla": REPORTS["sparse_attention_flashmla"]("cpu", None)})
    assert fine and "1 skipped" in line


def test_the_flashmla_reports_sets_name_live_rows_and_run_through_our_op():
    """The FlashMLA report's input sets (built on the CPU here): every slot names a written cache row (unused rows
    hold NaN, so one wrong slot makes the output NaN), and our op runs them: V3.2 decode, V4 decode, V3.2 and V4 prefill."""
    from dsa_triton.attention.sparse_attention import sparse_attention_decode, sparse_attention_prefill
    from dsa_triton.bench.reports import sparse_attention_flashmla as fm

    v32, v4, pre = fm._decode_set(1, 2, 2, 4096, 0, "cpu"), fm._v4_decode_set(1, 2, 2, 64, 0, "cpu"), \
        fm._prefill_set(2, 4096, 2, 0, "cpu")
    pre4 = fm._prefill_set(8, 4096, 2, 0, "cpu", fm.V4_D, 64, v4=True)
    assert not pre["kv"][pre["slots"].long()].isnan().any() and not pre4["kv"][pre4["slots"].long()].isnan().any()
    lengths, sink = pre4["extra"]["topk_length"], pre4["extra"]["attn_sink"]
    assert ((lengths >= 32) & (lengths <= 64)).all() and (lengths < 64).any() and sink.shape == (2,)
    outs = [sparse_attention_decode(v32["q"], v32["kv"], v32["slots"], fm.D ** -0.5, fm.DV),
            sparse_attention_decode(v4["q"], v4["kv"], v4["slots"], fm.V4_D ** -0.5, fm.V4_D, attn_sink=v4["sink"],
                                    extra_kv_cache=v4["entries"], extra_indices=v4["entry_slots"]),
            sparse_attention_prefill(pre["q"], pre["kv"], pre["slots"], fm.D ** -0.5, fm.DV),
            sparse_attention_prefill(pre4["q"], pre4["kv"], pre4["slots"], fm.V4_D ** -0.5, fm.DV, **pre4["extra"])]
    assert all(out.isfinite().all() for out, _ in outs)
    assert v4["slots"].shape == (1, 2, fm.V4_WINDOW) and v4["entry_slots"].shape == (1, 2, 64)


def test_the_tuner_prefers_expandable_segments_unless_the_user_chose(monkeypatch):
    """The tuner's process (and the day0 child it starts) gets expandable segments before CUDA starts; a user's own
    PYTORCH_CUDA_ALLOC_CONF stays as it is."""
    from dsa_triton import runtime
    from tuner import cli

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(runtime.torch.cuda, "is_initialized", lambda: False)
    assert cli.main(["show", "--kernels", "no_such_kernel"]) == 2  # (any command: set before its arguments are read)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == runtime.ALLOCATOR_SETTINGS
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert not runtime.prefer_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(runtime.torch.cuda, "is_initialized", lambda: True)  # too late: the allocator has read it
    assert not runtime.prefer_expandable_segments() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
