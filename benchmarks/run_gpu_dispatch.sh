#!/usr/bin/env bash
# The EP layer on 2 GPUs: build the native ops (the layer works without them), run the GPU tests of
# the dispatch's row kernels, the multi-GPU EP tests (NCCL and the symmetric-memory backend) and the
# transformers integration's multi-GPU tests, then the dispatch benchmark for the backends with a
# breakdown of the mxfp4 path. Logs go to $OUT (default /tmp/moe_fp4_dispatch); a summary is printed last.
#   bash benchmarks/run_gpu_dispatch.sh
# Environment: TOKENS (tokens per rank, comma separated), FORMATS, BACKENDS, TIMING (host or device),
# ITERS, HF=0 (skip the transformers tests), PROFILE=1, DEEPEP=1 (DeepEP's own rows and backend="deepep"
# in the same run, and tests/test_deepep_backend.py: a deep_ep wheel built by patches/deepep/build.sh must
# be installed), NUM_SMS (a second benchmark run
# with that SM budget, e.g. 24: Buffer.set_num_sms), and the *_S time limits of each step.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe_fp4_dispatch}"
. benchmarks/gpu_env.sh

timeout "${BUILD_S:-150}" python -m moe_fp4 build > "$OUT/build.log" 2>&1
build_rc=$?
# a failed build is not retried by every test worker: the layer runs on the spec instead
[ "$build_rc" = 0 ] || export MOE_FP4_NATIVE=0
native=$(python -c "from moe_fp4 import ops; print('native_available', ops.native_available())" 2>&1 | tail -1)
echo "build: $build_rc ($((SECONDS - t0)) s); $native"

# the native row kernels of the dispatch (BF16ToFP4Row to one and to several destinations, row push, the
# nvfp4 rows, the receive-side expansion to expert rows)
timeout -s INT -k 10 "${KTESTS_S:-90}" python -m pytest -q -p no:cacheprovider -k "${KTESTS_K:-quantize_mxfp4_rows or rows_multi or scatter or nvfp4 or expand or routing or sync_free or num_sms}" \
  tests/test_kernels_gpu.py tests/test_nvfp4_rows.py tests/test_expand_rows.py tests/test_routing.py \
  tests/test_sync_free_gpu.py > "$OUT/tests_kernels.log" 2>&1
ktests_rc=$?
echo "kernel tests: rc=$ktests_rc ($((SECONDS - t0)) s)"

timeout -s INT -k 10 "${TESTS_S:-150}" python -m pytest -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
  tests/test_ep_gpu.py > "$OUT/tests_gpu.log" 2>&1
tests_rc=$?
echo "tests: rc=$tests_rc ($((SECONDS - t0)) s)"

# backend="deepep" against the nccl backend (DEEPEP=1)
if [ "${DEEPEP:-0}" = 1 ]; then
  timeout -s INT -k 10 "${DEEPEP_S:-200}" python -m pytest -q -p no:cacheprovider tests/test_deepep_backend.py \
    > "$OUT/tests_deepep.log" 2>&1
  echo "deepep tests: rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/tests_deepep.log")"
fi
backends="${BACKENDS:-nccl,symm$([ "${DEEPEP:-0}" = 1 ] && echo ,deepep)}"

# the transformers integration on 2 GPUs (HF=0 skips it)
hf_rc=skipped
if [ "${HF:-1}" = 1 ]; then
  timeout -s INT -k 10 "${HF_S:-90}" python -m pytest -q -p no:cacheprovider -m multigpu tests/test_patches_hf.py \
    > "$OUT/tests_hf.log" 2>&1
  hf_rc=$?
  echo "hf multigpu tests: rc=$hf_rc ($((SECONDS - t0)) s)"
fi

timeout -s INT -k 10 "${BENCH_S:-150}" python -m moe_fp4 bench dispatch --iters "${ITERS:-10}" --warmup 2 \
  ${TOKENS:+--tokens "$TOKENS"} ${TIMING:+--timing "$TIMING"} ${PROFILE:+--profile-layout} $([ "${DEEPEP:-0}" = 1 ] && echo --deepep) --formats "${FORMATS:-bf16,fp8,mxfp4,nvfp4}" --backends "$backends" --breakdown --out "$OUT/dispatch.md" \
  > "$OUT/bench.log" 2>&1
bench_rc=$?
echo "bench: rc=$bench_rc ($((SECONDS - t0)) s)"
if [ -n "${NUM_SMS:-}" ]; then  # the same table under the SM budget (goal: mxfp4 link >= 85% at num_sms 24)
  timeout -s INT -k 10 "${BENCH_S:-150}" python -m moe_fp4 bench dispatch --iters "${ITERS:-10}" --warmup 2 \
    ${TOKENS:+--tokens "$TOKENS"} ${TIMING:+--timing "$TIMING"} --num-sms "$NUM_SMS" --formats "${FORMATS:-bf16,fp8,mxfp4,nvfp4}" \
    --backends "$backends" --out "$OUT/dispatch_num_sms.md" > "$OUT/bench_num_sms.log" 2>&1
  echo "bench num_sms=$NUM_SMS: rc=$? ($((SECONDS - t0)) s)"
fi

echo "================ summary ================"
cat "$OUT/device.txt"
echo "build: $build_rc; $native"
echo "--- kernel tests (rc=$ktests_rc) ---"
grep -E "passed|failed|error|skipped" "$OUT/tests_kernels.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests_kernels.log" | head -10
echo "--- tests (rc=$tests_rc) ---"
grep -E "passed|failed|error|skipped" "$OUT/tests_gpu.log" | tail -5
grep -E "^(FAILED|ERROR)" "$OUT/tests_gpu.log" | head -20
echo "--- hf multigpu tests (rc=$hf_rc) ---"
[ -f "$OUT/tests_hf.log" ] && { grep -E "passed|failed|error|skipped" "$OUT/tests_hf.log" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/tests_hf.log" | head -10; }
echo "--- bench (rc=$bench_rc) ---"
if [ -s "$OUT/dispatch.md" ]; then cat "$OUT/dispatch.md"; else tail -30 "$OUT/bench.log"; fi
if [ -n "${NUM_SMS:-}" ]; then
  echo "--- bench with num_sms=$NUM_SMS ---"
  if [ -s "$OUT/dispatch_num_sms.md" ]; then cat "$OUT/dispatch_num_sms.md"; else tail -30 "$OUT/bench_num_sms.log"; fi
fi
