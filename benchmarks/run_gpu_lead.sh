#!/usr/bin/env bash
# The whole GPU check on one machine (2 GPUs for the multi-GPU tests): build the native ops, run every
# GPU and multi-GPU test of the suite, then the external comparison (torchao, one GPU) and the
# activation-cache benchmark. torchao comes as a wheel in .whl/ (see benchmarks/RESULTS.md).
# Logs to $OUT (default ./.out): device.txt, tests.log, external.md, cache.log; summary last.
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 bash benchmarks/run_gpu_lead.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 MOE_FP4_NATIVE=1 MOE_FP4_BUILD_DIR=$PWD/build/native
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  git log -1 --format='commit %H %s' 2>/dev/null; } | tee "$OUT/device.txt"
timeout 300 python3 -m moe_fp4 build >"$OUT/build.log" 2>&1; echo "build rc=$?" | tee -a "$OUT/device.txt"
tail -3 "$OUT/build.log" >>"$OUT/device.txt"; rm -f "$OUT/build.log"
timeout ${TESTS_TIMEOUT_S:-300} python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider -rs tests 2>&1 \
  | tail -40 >"$OUT/tests.log"
tail -3 "$OUT/tests.log"
timeout 150 python3 benchmarks/bench_external.py --tokens 4096 32768 --out "$OUT" >"$OUT/external.log" 2>&1
echo "external rc=$?"; rm -f "$OUT/external.json"
tail -3 "$OUT/external.log"; [ -s "$OUT/external.md" ] && rm -f "$OUT/external.log"
timeout 120 python3 benchmarks/bench_activation_cache.py --hidden 4096 --tokens 8192 --layers 4 >"$OUT/cache.log" 2>&1
echo "cache rc=$?"
cat "$OUT/external.md" "$OUT/cache.log" 2>/dev/null | tail -40
