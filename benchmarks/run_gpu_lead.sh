#!/usr/bin/env bash
# The whole GPU check in one call on a 2-GPU machine: the kernel script (build, kernel GPU tests,
# compute-sanitizer, kernel benchmark), then every other GPU and multi-GPU test of the suite (those of
# the expert-parallel layer only with EP_TESTS=1), the external comparison with torchao (a wheel in
# .whl/; a transformers wheel there is used too) and the activation-cache benchmark. Logs to $OUT (default
# ./.out, at most 8 files). tests/test_recipes_gpu.py needs about 270 s on an H200 (LIMIT_RECIPES, default 360).
#   bash benchmarks/run_gpu_lead.sh
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
git log -1 --format='commit %H %s' >"$OUT/commit.txt" 2>/dev/null

# 1. kernels: build, GPU tests, sanitizer, benchmark (device.txt build.log tests.log sanitizer.log bench.log kernels.md)
OUT=$OUT COMPILE_ARGS="" bash benchmarks/run_gpu_kernels.sh
{ cat "$OUT/commit.txt"; cat "$OUT/device.txt"; echo "== build"; tail -5 "$OUT/build.log"; } >"$OUT/env.log"
rm -f "$OUT/commit.txt" "$OUT/device.txt" "$OUT/build.log"
[ -s "$OUT/kernels.md" ] && rm -f "$OUT/bench.log"

# 2. every other GPU test (the recipes' last: they compile)
files=(tests/test_formats_gpu.py tests/test_moe_cache.py tests/test_patches_hf.py)
[ "${EP_TESTS:-0}" = 1 ] && files+=(tests/test_ep_gpu.py)
{ timeout "${LIMIT_OTHER:-120}" python3 -m pytest -v -p no:cacheprovider -rs -m "gpu or multigpu" "${files[@]}" 2>&1
  echo "rc=$?"
  timeout "${LIMIT_RECIPES:-360}" python3 -m pytest -v -p no:cacheprovider -rs --durations=10 tests/test_recipes_gpu.py 2>&1
  echo "rc=$?"; } | grep -vE "^$|^platform|^rootdir|^configfile|^plugins|^cachedir|^collect" >"$OUT/tests_other.log"
grep -E "passed|failed|rc=" "$OUT/tests_other.log" | tail -6

# 3. torchao on the same GPU, 4. the activation cache (appended to env.log)
timeout "${LIMIT_EXTERNAL:-120}" python3 benchmarks/bench_external.py --tokens 4096 32768 --out "$OUT" \
  >>"$OUT/env.log" 2>&1
echo "external rc=$?"; rm -f "$OUT/external.json"; cat "$OUT/external.md" 2>/dev/null
{ echo "== activation cache"; timeout 90 python3 benchmarks/bench_activation_cache.py --hidden 4096 --tokens 8192 \
  --layers 4 2>&1; echo "cache rc=$?"; } | tee -a "$OUT/env.log" | tail -8
ls "$OUT"
