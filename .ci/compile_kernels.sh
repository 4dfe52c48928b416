#!/usr/bin/env bash
# Compile every csrc/kernels/*.cu for sm_90a with ptxas's resource report; fail on an error or on any
# register spill or stack frame (local memory) in a kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
files=(csrc/kernels/*.cu)
if [ ${#files[@]} -eq 0 ]; then echo "compile_kernels: no kernels yet"; exit 0; fi
if ! command -v nvcc >/dev/null; then echo "compile_kernels: nvcc not found" >&2; exit 1; fi
out=$(mktemp -d)
status=0
for f in "${files[@]}"; do
  log="$out/$(basename "$f").log"
  if ! nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels -Xptxas -v \
       -c "$f" -o "$out/$(basename "$f").o" >"$log" 2>&1; then
    cat "$log"; echo "compile_kernels: $f failed to compile" >&2; status=1; continue
  fi
  if grep -E "[1-9][0-9]* bytes spill (stores|loads)|[1-9][0-9]* bytes stack frame" "$log"; then
    echo "compile_kernels: $f spills registers or uses a stack frame" >&2; status=1
  fi
  echo "compile_kernels: $f ok ($(grep -c 'Compiling entry' "$log") kernels)"
done
exit $status
