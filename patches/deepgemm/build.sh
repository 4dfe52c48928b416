#!/usr/bin/env bash
# Build DeepGEMM in place, without network, for `python -m moe_fp4 bench gemm`'s DeepGEMM columns.
#   bash patches/deepgemm/build.sh SRC
# SRC: a DeepGEMM source tree with its submodules' headers (tested: commit 54e2261, version 2.6.1):
#   git -C <DeepGEMM clone> archive 54e2261 | tar -x -C SRC
#   git -C <cutlass clone> archive --prefix=third-party/cutlass/include/ f3fde58:include | tar -x -C SRC
#   git -C <fmt clone> archive --prefix=third-party/fmt/include/ 553ec11:include | tar -x -C SRC
# Then use it with PYTHONPATH=SRC. DeepGEMM compiles its kernels with nvcc at first use (CUDA_HOME, cache
# in DG_JIT_CACHE_DIR) and looks for the cute/cutlass headers inside its package, hence the links below.
# The host compiler must link libstdc++ dynamically: with a copy of libstdc++ linked statically into
# deep_gemm/_C (what the GPU machine's CXX=/opt/gcc/bin/g++ does), its std::regex and iostreams use locale
# facets that the process's shared libstdc++ registered, and the first JIT call ends in a segmentation fault
# (patches/deepgemm/diagnose.py found it). So CXX defaults to the system g++ here; DG_CXX overrides it.
set -euo pipefail
if [ $# -ne 1 ]; then echo "usage: bash patches/deepgemm/build.sh SRC" >&2; exit 2; fi
cd "$1"
[ -f setup.py ] && [ -d deep_gemm ] || { echo "build.sh: $1 is not a DeepGEMM source tree" >&2; exit 2; }
[ -d third-party/cutlass/include/cute ] || { echo "build.sh: $1 lacks third-party/cutlass/include" >&2; exit 2; }
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export CXX=${DG_CXX:-/usr/bin/g++} CC=${DG_CC:-/usr/bin/gcc}
ln -sfn ../../third-party/cutlass/include/cute deep_gemm/include/cute
ln -sfn ../../third-party/cutlass/include/cutlass deep_gemm/include/cutlass
python setup.py build_ext --inplace
if ldd deep_gemm/_C*.so | grep -q "libstdc++"; then :; else
  echo "build.sh: deep_gemm/_C has libstdc++ linked statically (CXX=$CXX); set DG_CXX to a g++ that links it dynamically" >&2
  exit 1
fi
echo "build.sh: built in $PWD (use PYTHONPATH=$PWD)"
