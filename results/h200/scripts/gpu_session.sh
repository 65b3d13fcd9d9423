#!/usr/bin/env bash
# One H200 device call of the plan in results/NOTES.md ("Next GPU session"), run from a snapshot of HEAD:
#   rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap      (here; carry [".snap", ".whl"])
#   device command: bash .snap/results/h200/scripts/gpu_session.sh check|tune|retune|bench
# .whl holds the optuna, colorlog, alembic, sqlalchemy, mako and greenlet cp312 wheels (not on the GPU image);
# every log, results file and the tuning database land in $OUT. One process at a time: two on one host
# disturbed each other's timings (NOTES, "Session 2").
set -u
part=${1:?check, tune, retune or bench}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
cd .snap
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DSA_TUNING_DB=$PWD/tuning_db/data
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
grid=(--model deepseek-v3.2 --batches 1,8,64,128 --contexts 4096,32768,131072 --chunks 1024,4096,16384 --trials 16)
case $part in
  check)  # the kernels never run on a GPU first, then the reports that test this session's predictions
    timeout 420 python -m dsa_triton.bench --out "$OUT" \
      --kernels moe_route,moe_permute,moe_layer_decode,topk_routes,topk_speed,topk_indices 2>&1 | tee "$OUT/check.log" | tail -60 ;;
  tune)   # stale or missing records; moe_workspace_gemm re-timed alone
    timeout 520 python -m tuner.cli tune "${grid[@]}" --budget 480 --no-progress \
      --kernels moe_route,moe_permute,page_select,indexer_block_path,topk_indices,moe_path 2>&1 | tee "$OUT/tune.log" | tail -40
    cp -r tuning_db/data "$OUT/db" ;;
  retune)  # records timed beside another tuner on the x2 host
    timeout 520 python -m tuner.cli tune "${grid[@]}" --budget 480 --no-progress --retune \
      --kernels moe_workspace_gemm 2>&1 | tee "$OUT/retune.log" | tail -20
    cp -r tuning_db/data "$OUT/db" ;;
  bench)  # every kernel and report with the database as committed
    timeout 560 python -m dsa_triton.bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep "^|" | cut -c1-200 | tail -80 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
