#!/usr/bin/env bash
# On a GPU machine: the spec's device-independence test, the kernel benchmark (fair unfused column
# baseline), and the activation-cache benchmark. Logs to $OUT (default ./.out), summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 MOE_FP4_NATIVE=1 MOE_FP4_BUILD_DIR=$PWD/build/native
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/device.txt"
timeout 300 python3 -m moe_fp4 build >"$OUT/build.log" 2>&1; echo "build rc=$?"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_formats_gpu.py 2>&1 | tail -3 | tee "$OUT/tests.log"
timeout 120 python3 benchmarks/bench_activation_cache.py --hidden 4096 --tokens 8192 --layers 4 2>&1 \
  | tee "$OUT/cache.log"
timeout 240 python3 -m moe_fp4 bench kernels --tokens 4096 32768 --reps 40 --markdown "$OUT/kernels.md" \
  >"$OUT/bench.log" 2>&1; echo "bench rc=$?"
cat "$OUT/kernels.md" 2>/dev/null || tail -20 "$OUT/bench.log"
