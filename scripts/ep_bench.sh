#!/usr/bin/env bash
# Expert parallel at DeepSeek-V3.2 layer shapes, one GPU against two, on nvidia-h200-x2 (two H200s of one host), run
# in the repository root of the tree sent there:
#   device command (kind nvidia-h200-x2): DSA_GIT_COMMIT=$(git rev-parse HEAD) bash scripts/ep_bench.sh [LAYERS] [PART ...]
# LAYERS (default 3): the first dense, the others MoE with all 256 MXFP4 experts (~6 GB a layer; one GPU holds them
# all, two split them 128 + 128). PARTs (default all four, in this order):
#   write    the random checkpoint under /tmp (skipped when there; a warm machine keeps it between calls)
#   one      the runner on one GPU          -> $OUT/ep-one.json, ep-one.log
#   two      the runner on two GPUs (NCCL)  -> $OUT/ep-two.json, ep-two.log
#   compare  -> $OUT/ep-bench.md: tokens equal or where they part, prefill / decode tokens/s per GPU against one
#            GPU, time in collectives, memory plan per rank (needs both JSONs in $OUT; it runs on any machine too:
#            python scripts/ep_bench.py compare ep-one.json ep-two.json)
# scripts/ep_bench.py says what each step does.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# never NVLink multicast: it can take the host's shared GPUs out of service (these stay set for every process)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
layers=${1:-3}
[ $# -gt 0 ] && shift
parts=${*:-write one two compare}
checkpoint=/tmp/ep-v32-$layers
run="scripts/ep_bench.py run $checkpoint --prompts 32 --prompt-len 512 --new-tokens 32 --chunk 4096"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
status=0
for part in $parts; do
  case $part in
    write)
      [ -f "$checkpoint/config.json" ] || timeout 240 python scripts/ep_bench.py write "$checkpoint" --layers "$layers" \
        2>&1 | tee "$OUT/ep-write.log" || exit 1 ;;
    one|two)
      procs=$([ "$part" = one ] && echo 1 || echo 2)
      timeout 280 python -m torch.distributed.run --standalone --nproc-per-node "$procs" $run --out "$OUT/ep-$part.json" \
        2>&1 | tee "$OUT/ep-$part.log" | grep -v "^\[rank" | tail -20 || status=1 ;;
    compare)
      python scripts/ep_bench.py compare "$OUT/ep-one.json" "$OUT/ep-two.json" | tee "$OUT/ep-bench.md" || status=1 ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
exit $status
