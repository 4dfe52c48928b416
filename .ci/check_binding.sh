#!/usr/bin/env bash
# Syntax- and type-check the torch binding (csrc/torch/*.cpp) on the CPU machine: g++ -fsyntax-only
# against this torch's headers, the CUDA toolkit's headers and the kernels' launcher header (nothing
# is linked or run). CPU wheels of torch lack c10/cuda's generated cuda_cmake_macros.h; an empty one
# stands in for it. C++17, the strictest standard the extension may be built with.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v g++ >/dev/null; then echo "check_binding: g++ not found" >&2; exit 1; fi
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
[ -f "$cuda_home/include/cuda_runtime_api.h" ] || cuda_home=/usr/local/cuda
cuda_inc=$cuda_home/include
torch_inc=$(python -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
py_inc=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
stub=$(mktemp -d)
if [ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$stub/c10/cuda/impl" && echo "#pragma once" >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
fi
status=0
for f in csrc/torch/*.cpp; do
  if g++ -std=c++17 -w -fsyntax-only -DTORCH_EXTENSION_NAME=moe_fp4_native -I"$stub" -I"$torch_inc" \
       -I"$torch_inc/torch/csrc/api/include" -I"$py_inc" -I"$cuda_inc" -Icsrc/kernels "$f"; then
    echo "check_binding: $f ok"
  else
    echo "check_binding: $f failed" >&2; status=1
  fi
done
rm -rf "$stub"
exit $status
