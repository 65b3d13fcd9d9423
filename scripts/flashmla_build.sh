#!/usr/bin/env bash
# Build FlashMLA (deepseek-ai/FlashMLA, MIT), the sparse attention baseline, on the GPU machine, for sm_90a.
#
#   bash scripts/flashmla_build.sh [SRC] [DEST]
#
# SRC (default .flashmla, a folder git ignores that the device call carries): FlashMLA's tree at 9241ae3 with
# csrc/cutlass/include and csrc/cutlass/tools/util/include of NVIDIA/cutlass at the submodule's commit 147f567.
# Fill it here, where the session's fetch tool has both repositories:
#   git -C <FlashMLA mirror> archive 9241ae3 | tar -x -C .flashmla
#   git -C <cutlass mirror> archive 147f567 include tools/util/include | tar -x -C .flashmla/csrc/cutlass
# DEST (default /tmp/flashmla): where the built package lands; put it on PYTHONPATH (`import flash_mla`).
# The build compiles in a copy under /tmp. The two SM100 dense prefill sources become stubs (they need an sm_100
# toolchain and serve no Hopper path; the module keeps their entry points, which raise), and CUDA 13's libcu++
# (under $CUDA_HOME/include/cccl, which the host compiler does not search) is put on the include path.
set -euo pipefail
src=$(realpath "${1:-.flashmla}")
dest=${2:-/tmp/flashmla}
work=/tmp/flashmla-src
rm -rf "$work" && cp -r "$src" "$work" && cd "$work"
for part in fwd bwd; do
  cat > "csrc/sm100/prefill/dense/fmha_cutlass_${part}_sm100.cu" <<EOF
#include <stdexcept>
#include "interface.h"
// stub: the SM100 dense prefill is not built for Hopper
EOF
done
cat >> csrc/sm100/prefill/dense/fmha_cutlass_fwd_sm100.cu <<'EOF'
void FMHACutlassSM100FwdRun(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, int, float, int, int, bool) {
  throw std::runtime_error("FlashMLA built without the SM100 dense prefill");
}
EOF
cat >> csrc/sm100/prefill/dense/fmha_cutlass_bwd_sm100.cu <<'EOF'
void FMHACutlassSM100BwdRun(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int, float, int, int, bool) {
  throw std::runtime_error("FlashMLA built without the SM100 dense prefill");
}
EOF
cuda_home=$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)")
export CPLUS_INCLUDE_PATH="$cuda_home/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
FLASH_MLA_DISABLE_SM100=1 MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2} \
  python3 setup.py build_ext --inplace > /tmp/flashmla-build.log 2>&1 || { tail -40 /tmp/flashmla-build.log; exit 1; }
rm -rf "$dest" && mkdir -p "$dest" && cp -r flash_mla "$dest/"
python3 -c "import sys; sys.path.insert(0, '$dest'); import flash_mla; print('flash_mla built:', flash_mla.__file__)"
