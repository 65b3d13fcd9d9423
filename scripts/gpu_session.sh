#!/usr/bin/env bash
# One H200 device call, run in the repository root of the tree sent to the GPU machine:
#   device command: DSA_GIT_COMMIT=$(git rev-parse HEAD)[-dirty] bash scripts/gpu_session.sh PART [PART ...]
# (the .git sent along, if any, is not the commit sent: the caller names it). Parts:
#   check     every kernel at its small and odd shapes, launch/default/random configs (scripts/gpu_check.py;
#             CHECK_KERNELS=a,b in the environment: only those), and with the sparse attention kernels the Gluon
#             seesaw kernel at DSA dims (scripts/gluon_attention.py --checks-only: both caches)
#   sanitize  compute-sanitizer memcheck (every kernel: launch, default and one random config) and racecheck
#             (launch configs)
#   bench     python -m dsa_triton.bench: every kernel and report against its baseline, with the ceilings
#             (BENCH_KERNELS=a,b in the environment: only those kernels and reports)
#   launch    host cost a launch, Triton's launcher vs the lean path, and the ops eager vs from CUDA graphs
#             (scripts/launch_cost.py)
#   step      one decode step of one layer at DeepSeek-V3.2 widths, batch 1 and 64, contexts 4096 and 32768: eager,
#             torch.compile (inductor) and a CUDA graph replayed, checked against eager and timed; and the test
#             module of tests/test_library.py compiled by inductor (scripts/decode_step.py; STEP_ARGS in the environment: more arguments)
#   runner ARGS  python scripts/runner_bench.py ARGS (the model runner end to end at V3.2 layer widths, or with
#             --model CONFIG.json at that model's, e.g. model_runner/configs/deepseek-v4-flash.json)
#   topk-route ARGS  python scripts/topk_route.py --kernel ARGS (top-k candidate counts, routes and times on
#             indexer-like rows, against their emulation; issue 17)
#   quantize  the MoE prefill's activation quantization: bit for bit against its oracle, timed against copy
#             (scripts/quantize_bench.py)
#   gluon ARGS  python scripts/gluon_attention.py ARGS (the seesaw kernel's checks and timings, e.g. --only v4)
#   sweep ARGS  python scripts/config_sweep.py ARGS (given configs against the launch config, checked and timed)
#   profile ARGS  Nsight Compute (full set) of one launch of PROFILE_KERNEL (a regex; default the registers route's
#             _fused_gemm_kernel) in python PROFILE_SCRIPT ARGS (default scripts/moe_gemm_profile.py; the sparse
#             attention kernels: scripts/attention_profile.py): report, details page, SASS source page
#   flashmla-build  start building FlashMLA (scripts/flashmla_build.sh; needs .flashmla carried) in the background:
#             about 7 minutes on 16 cores; the parts between it and `flashmla` share the CPU with the compiler
#   flashmla  wait for that build (or build now), then the FlashMLA report: our sparse attention beside FlashMLA's,
#             V3.2 and V4 (MODEL1) rows (python -m dsa_triton.bench --kernels sparse_attention_flashmla)
#   memtrace  device memory after every graph capture of the MoE reports (scripts/memory_trace.py)
#   tune ARGS dsa-tune tune ARGS (needs .whl with the optuna wheels carried: optuna is not on the GPU image)
#   day0 ARGS dsa-tune day0 --flat ARGS: tune a config's shapes within --budget, then first tokens from its
#             checkpoint or random weights, each stage timed, one results file (--out $OUT; needs .whl as tune)
# runner, topk-route, gluon, sweep, profile, tune and day0 take the rest of the command line. Everything lands in $OUT/session.tgz (the device tool returns at
# most 8 files): logs, results files, and the tuning database after a tune or day0 (merge it back with
# `dsa-tune merge db/*.csv` from the unpacked archive).
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
status=0
wheels() {  # optuna and its needs, from the carried .whl folder
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
}
while [ $# -gt 0 ]; do
  part=$1; shift
  case $part in
    check)
      timeout 300 python scripts/gpu_check.py --out "$OUT" --kernels "${CHECK_KERNELS:-}" 2>&1 | tee "$OUT/gpu-check.log" | tail -40 || status=1
      case ",${CHECK_KERNELS:-sparse_attention}," in  # the Gluon kernels at DSA dims, small and odd shapes
        *,sparse_attention*)
          timeout 240 python scripts/gluon_attention.py --only all --checks-only \
            --out "$OUT/gluon-checks" > "$OUT/gluon-checks.log" 2>&1 || status=1
          grep -c "^PASS" "$OUT/gluon-checks.log"; grep -v "^PASS" "$OUT/gluon-checks.log" | tail -8 ;;
      esac ;;
    sanitize)
      export PYTHONPATH PYTORCH_NO_CUDA_MEMORY_CACHING=1
      timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python scripts/gpu_check.py --configs 1 \
        --seeds 1 --out "$OUT/memcheck" 2>&1 | tee "$OUT/memcheck.log" | tail -12 || status=1
      timeout 200 compute-sanitizer --tool racecheck --print-limit 20 python scripts/gpu_check.py --defaults-only \
        --seeds 1 --out "$OUT/racecheck" 2>&1 | tee "$OUT/racecheck.log" | tail -12 || status=1
      unset PYTORCH_NO_CUDA_MEMORY_CACHING ;;
    bench)
      timeout 560 python -m dsa_triton.bench --out "$OUT" --kernels "${BENCH_KERNELS:-}" 2>&1 | tee "$OUT/bench.log" | grep "^|\|checks ok" \
        | cut -c1-240 | tail -70 || status=1 ;;
    launch)
      timeout 280 python scripts/launch_cost.py --out "$OUT" --flat 2>&1 | tee "$OUT/launch-cost.log" | tail -60 \
        || status=1 ;;
    step)
      timeout 400 python scripts/decode_step.py --out "$OUT" --flat ${STEP_ARGS:-} 2>&1 | tee "$OUT/decode-step.log" | tail -30 \
        || status=1 ;;
    runner)
      timeout 590 python scripts/runner_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/runner-bench.log" | tail -40 \
        || status=1
      shift $# ;;
    quantize)
      timeout 200 python scripts/quantize_bench.py --out "$OUT" 2>&1 | tee "$OUT/quantize-bench.log" | tail -40 \
        || status=1 ;;
    gluon)
      timeout 590 python scripts/gluon_attention.py --out "$OUT/gluon" "$@" > "$OUT/gluon-attention.log" 2>&1 || status=1
      grep -c "^PASS" "$OUT/gluon-attention.log"; grep -v "^PASS" "$OUT/gluon-attention.log" | tail -30
      shift $# ;;
    sweep)
      timeout 590 python scripts/config_sweep.py --out "$OUT" "$@" 2>&1 | tee "$OUT/config-sweep.log" | tail -60 \
        || status=1
      shift $# ;;
    profile)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 500 "$ncu" --clock-control none --kernel-name "regex:${PROFILE_KERNEL:-_fused_gemm_kernel}" \
        --launch-skip 1 --launch-count 1 --set full --import-source yes -o "$OUT/profile" \
        python3 "${PROFILE_SCRIPT:-scripts/moe_gemm_profile.py}" "$@" \
        > "$OUT/profile.log" 2>&1 || status=1
      "$ncu" --import "$OUT/profile.ncu-rep" --page details > "$OUT/profile-details.txt" 2>&1
      "$ncu" --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass > "$OUT/profile-sass.csv" 2>&1
      tail -5 "$OUT/profile.log"
      grep -E "Duration|Throughput|Pipe|Issue|Stall|Registers|Shared Memory Config|Achieved Occ|Executed Ipc" \
        "$OUT/profile-details.txt" | head -60
      shift $# ;;
    topk-route)
      timeout 590 python scripts/topk_route.py --kernel --json "$OUT/topk-route.json" "$@" 2>&1 \
        | tee "$OUT/topk-route.log" | grep summary || status=1
      shift $# ;;
    flashmla-build)
      (MAX_JOBS=12 setsid nohup bash scripts/flashmla_build.sh .flashmla /tmp/flashmla > /tmp/flashmla-build.log 2>&1 \
        < /dev/null &) ;;
    flashmla)
      [ -d /tmp/flashmla/flash_mla ] || pgrep -f flashmla_build.sh > /dev/null \
        || bash scripts/flashmla_build.sh .flashmla /tmp/flashmla > /tmp/flashmla-build.log 2>&1
      while pgrep -f flashmla_build.sh > /dev/null; do sleep 3; done
      tail -1 /tmp/flashmla-build.log; cp /tmp/flashmla-build.log "$OUT/"
      PYTHONPATH=$PYTHONPATH:/tmp/flashmla timeout 300 python -m dsa_triton.bench --out "$OUT" \
        --kernels sparse_attention_flashmla 2>&1 | tee "$OUT/flashmla-bench.log" | grep "^| decode\|^| prefill\|checks ok" \
        | cut -c1-200 || status=1 ;;
    memtrace)
      timeout 200 python scripts/memory_trace.py --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/memory-trace.log" \
        | tail -4 || status=1 ;;
    tune)
      wheels
      timeout 540 python -m tuner.cli tune --no-progress "$@" 2>&1 | tee "$OUT/tune.log" | grep "^\[" | cut -c1-220 \
        | tail -40 || status=1
      mkdir -p "$OUT/db" && cp tuning_db/data/*.csv "$OUT/db/"
      shift $# ;;
    day0)
      wheels
      timeout 570 python -m tuner.cli day0 --no-progress --flat "$@" 2>&1 | tee "$OUT/day0.log" | grep -v "^|" \
        | cut -c1-240 | tail -60 || status=1
      mkdir -p "$OUT/db" && cp tuning_db/data/*.csv "$OUT/db/"
      shift $# ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
# the device tool returns at most 8 files from $OUT: everything goes back as one archive
(cd "$OUT" && tar czf /tmp/session.tgz . && rm -rf ./* && mv /tmp/session.tgz .)
exit $status
