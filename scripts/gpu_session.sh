#!/usr/bin/env bash
# One H200 device call of the plan in results/NOTES.md ("Next GPU session"), run from a snapshot of HEAD:
#   rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap      (here; carry [".snap", ".whl"])
#   device command: bash .snap/results/h200/scripts/gpu_session.sh check|prefill|tune|retune|bench
# .whl holds the optuna, colorlog, alembic, sqlalchemy, mako and greenlet cp312 wheels (not on the GPU image);
# every log, results file and the tuning database land in $OUT. One process at a time: two on one host
# disturbed each other's timings (NOTES, "Session 2"). Each call starts from the snapshot's database: copy
# $OUT/db/nvidia-h200.csv back and `dsa-tune merge` it (or re-snapshot) before the next call.
set -u
part=${1:?check, codes, occupancy, gap, gemm, overlap, tiles, routes, convert, prefill, tune, retune or bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
cd .snap
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DSA_TUNING_DB=$PWD/tuning_db/data
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
grid=(--model deepseek-v3.2 --batches 1,8,64,128 --contexts 4096,32768,131072 --chunks 1024,4096,16384 --trials 16)
case $part in
  check)  # fused T=1 tiles with X_COPY (new knob, 150 s); bench rows with graph columns (new); topk_routes after the window fix
    timeout 200 python results/h200/scripts/fused_t1_probe.py 150 2>&1 | tee "$OUT/fused_t1_probe.log" | tail -16
    timeout 330 python -m dsa_triton.bench --out "$OUT" \
      --kernels moe_fused_gemm,moe_route,moe_permute,topk_indices,page_select,topk_routes,moe_decode,moe_layer_decode 2>&1 \
      | tee "$OUT/check.log" | grep "^|" | cut -c1-240 | tail -40 ;;
  codes)  # registers route: the cost of the scattered code reads (a thread-major read, wrong values, valid timing)
    timeout 300 python results/h200/scripts/codes_order_probe.py 2>&1 | tee "$OUT/codes_order_probe.log" | grep "^|" ;;
  occupancy)  # registers route: maxnreg 128 (4 programs an SM instead of 3) x the thread-major code read
    timeout 400 python results/h200/scripts/occupancy_probe.py ${2:-} 2>&1 | tee "$OUT/occupancy_probe.log" | grep "^|" ;;
  prefill)  # registers route: W_SMEM 0/1 x num_stages 3/1 (1 = wgmmas back to back, new) vs torch._scaled_grouped_mm
    timeout 560 python results/h200/scripts/w_smem_probe.py 2>&1 | tee "$OUT/prefill_probe.log" | grep "^|" | cut -c1-200 ;;
  tune)   # re-tune in CUDA graphs (records get timing=graph): the small host-bound kernels first
    timeout 540 python -m tuner.cli tune "${grid[@]}" --budget 500 --no-progress --retune \
      --kernels moe_route,moe_permute,page_select,topk_indices,moe_fused_gemm,indexer_block_path,paged_append \
      2>&1 | tee "$OUT/tune.log" | grep "^\[" | cut -c1-220 | tail -60
    cp -r tuning_db/data "$OUT/db" ;;
  retune)  # the rest in graphs (mxfp4 ops, indexer, sparse attention, moe_workspace_gemm, moe_path)
    timeout 540 python -m tuner.cli tune "${grid[@]}" --budget 500 --no-progress --retune \
      --kernels mxfp4_quantize,mxfp4_dequantize,mxfp4_to_fp8,indexer_logits,sparse_attention_decode,moe_workspace_gemm \
      2>&1 | tee "$OUT/retune.log" | grep "^\[" | cut -c1-220 | tail -60
    cp -r tuning_db/data "$OUT/db" ;;
  gap)  # prefill op at T=4096: eager (host sync and planning each call) vs its launches in a CUDA graph
    timeout 300 python results/h200/scripts/host_gap_probe.py 2>&1 | tee "$OUT/host_gap_probe.log" | grep "^|" ;;
  gemm)  # re-tune the prefill grouped GEMM and the layer path choice (no host sync on the registers route now)
    timeout 400 python -m tuner.cli tune "${grid[@]}" --budget 360 --no-progress --retune --kernels moe_workspace_gemm,moe_path \
      2>&1 | tee "$OUT/tune-gemm.log" | grep "^\[" | cut -c1-220 | tail -20
    cp -r tuning_db/data "$OUT/db" ;;
  overlap|tiles|routes)  # T=16384 workspace route: OVERLAP 0/1 x stage sizes; T=4096 registers-route tiles; or
    # T=16384 both routes (each stored as a tuner record), then the prefill report
    timeout 420 python results/h200/scripts/prefill_variants_probe.py $part 2>&1 | tee "$OUT/${part}_probe.log" \
      | grep "^|\|^record"
    timeout 150 python -m dsa_triton.bench --out "$OUT" --kernels moe_prefill 2>&1 | tee "$OUT/prefill.log" \
      | grep "^|" | cut -c1-240 | tail -12
    cp -r tuning_db/data "$OUT/db" ;;
  convert)  # the conversion at gate_up's T=16384 stage size (16 experts; only G=8 was stored), then the prefill report
    timeout 150 python -m tuner.cli tune --kernels mxfp4_to_fp8 --shapes "G=16,N=4096,K=7168" --trials 16 --budget 120 \
      --no-progress 2>&1 | tee "$OUT/tune-convert.log" | grep "^\[" | cut -c1-220
    timeout 150 python -m dsa_triton.bench --out "$OUT" --kernels moe_prefill 2>&1 | tee "$OUT/prefill.log" \
      | grep "^|" | cut -c1-240 | tail -6
    cp -r tuning_db/data "$OUT/db" ;;
  bench)  # every kernel and report with the database as committed
    timeout 560 python -m dsa_triton.bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep "^|" | cut -c1-240 | tail -80 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
