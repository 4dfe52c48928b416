#!/usr/bin/env bash
# Build a DeepEP wheel from a DeepEP v1.2.1 source tree with the patches of this folder applied.
#   bash patches/deepep/build.sh SRC OUT
# SRC: a DeepEP source tree (for example `git -C <a DeepEP clone> archive v1.2.1 | tar -x -C SRC`); OUT: the
# folder the wheel is written to. Without NVSHMEM (neither NVSHMEM_DIR nor the nvidia-nvshmem package)
# DeepEP builds its intranode kernels only. Needs torch with CUDA, nvcc and ninja; about a minute on 16 cores.
#
# 0001-rdc-only-with-nvshmem.patch: DeepEP v1.2.1 compiles with -rdc=true but adds the device-link step
# only with NVSHMEM, so an intranode-only build fails to import (an undefined
# __cudaRegisterLinkedBinary... symbol); the patch asks for relocatable device code only with NVSHMEM.
# 0002-cuda13-cccl-include.patch: with CUDA 13, libcu++ (cuda/std/...) lives under include/cccl, which
# NVSHMEM's headers include; the patch adds that folder to the include path when it exists.
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: bash patches/deepep/build.sh SRC OUT" >&2; exit 2; fi
src=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$src/setup.py" ] || { echo "build.sh: $src has no setup.py (not a DeepEP source tree)" >&2; exit 2; }
work=$(mktemp -d)
cp -r "$src"/. "$work"
for p in "$here"/*.patch; do
  (cd "$work" && git apply "$p") || { echo "build.sh: $(basename "$p") does not apply to $src (DeepEP v1.2.1 expected)" >&2; exit 1; }
done
cd "$work"
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  python -m pip wheel --no-build-isolation --no-deps -w "$out" .
echo "build.sh: wheel in $out"
