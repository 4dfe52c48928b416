#!/usr/bin/env bash
# The EP layer on 2 GPUs over NCCL: build the native ops if the build command exists (the layer
# works without them), run the multi-GPU EP tests, run the dispatch benchmark. Logs go to $OUT
# (default /tmp/moe_fp4_dispatch); a summary is printed last.
#   bash benchmarks/run_gpu_dispatch.sh
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/moe_fp4_dispatch}"
mkdir -p "$OUT"
t0=$SECONDS
{ date -u; nvidia-smi -L; python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
  > "$OUT/device.txt" 2>&1

build_rc=skipped
if python -c "import moe_fp4.ops.build" > /dev/null 2>&1; then
  timeout "${BUILD_S:-150}" python -m moe_fp4 build > "$OUT/build.log" 2>&1
  build_rc=$?
  # a failed build is not retried by every test worker: the layer runs on the spec instead
  [ "$build_rc" = 0 ] || export MOE_FP4_NATIVE=0
fi
native=$(python -c "
from moe_fp4 import ops
f = getattr(ops, 'native_available', None)
print('native_available', f() if f else 'n/a',
      [n for n in ('quantize_mxfp4_rows', 'mxfp4_rows_to_fp8_blockwise', 'quantize_fp8_blockwise') if hasattr(ops, n)])
" 2>&1 | tail -1)
echo "build: $build_rc ($((SECONDS - t0)) s); $native"

timeout -s INT -k 10 "${TESTS_S:-100}" python -m pytest -q -p no:cacheprovider tests/test_ep_gpu.py > "$OUT/tests_gpu.log" 2>&1
tests_rc=$?
echo "tests: rc=$tests_rc ($((SECONDS - t0)) s)"

timeout -s INT -k 10 "${BENCH_S:-140}" python -m moe_fp4 bench dispatch --iters "${ITERS:-10}" --warmup 2 --out "$OUT/dispatch.md" \
  > "$OUT/bench.log" 2>&1
bench_rc=$?
echo "bench: rc=$bench_rc ($((SECONDS - t0)) s)"

echo "================ summary ================"
cat "$OUT/device.txt"
echo "build: $build_rc; $native"
echo "--- tests (rc=$tests_rc) ---"
grep -E "passed|failed|error|skipped" "$OUT/tests_gpu.log" | tail -5
grep -E "^(FAILED|ERROR)" "$OUT/tests_gpu.log" | head -20
echo "--- bench (rc=$bench_rc) ---"
if [ -s "$OUT/dispatch.md" ]; then cat "$OUT/dispatch.md"; else tail -30 "$OUT/bench.log"; fi
