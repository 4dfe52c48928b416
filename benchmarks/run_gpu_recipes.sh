#!/usr/bin/env bash
# Recipes on one GPU (H200). Writes to $OUT (default benchmarks/results/gpu_recipes); run.log holds the
# environment and every step's output.
#   MODE=check bash benchmarks/run_gpu_recipes.sh      (about 2-3 minutes)
#       step times per configuration, compiled and eager quantizers, and a torch.profiler table
#       (step_times.{md,json}); the GPU tests (tests/test_recipes_gpu.py); the raw torch._scaled_mm
#       layout probe (scaled_mm_layouts.md)
#   MODE=ablation STEPS=400 SEEDS=0,1,2 DEADLINE=230 JOBS=7 bash benchmarks/run_gpu_recipes.sh
#       (about 6 minutes) the ablation (ablation.{md,json,png}; one process per configuration, JOBS at
#       once, quantizer "auto") in the background while the GPU tests run (the blockwise FP8 GEMM ones,
#       then compiled == eager for the ablation's operand kinds); afterwards, with the compiler caches
#       warm, the step times (step_times.{md,json}). Seven processes time-slicing one H200 slowed each
#       run 2-5x (2026-11-22): for a long run prefer JOBS=2 and a longer DEADLINE.
#   MODE=bench bash benchmarks/run_gpu_recipes.sh   QuantLinear throughput (bench_quantlinear.{md,json})
# The compiler caches live in .out/recipes_inductor (TORCHINDUCTOR_CACHE_DIR); with CACHE_TGZ=1 they
# are packed into $OUT/inductor_cache.tgz, so that a later call can carry them and skip compiling.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_recipes}
MODE=${MODE:-check}
mkdir -p "$OUT" .out/recipes_inductor
LOG="$OUT/run.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.out/recipes_inductor

{
  echo "== environment ($MODE)"
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  du -sh .out/recipes_inductor

  if [ "$MODE" = check ]; then
    echo "== step times and profile"
    timeout "${STEP_TIMES_S:-150}" python3 benchmarks/ablation.py --out "$OUT" --step-times --time-steps 5 2>&1 | grep -v "^W1"
    echo "rc=${PIPESTATUS[0]}"; date -u
    echo "== GPU tests (tests/test_recipes_gpu.py)"
    timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_recipes_gpu.py 2>&1 | tail -n 60
    echo "rc=${PIPESTATUS[0]}"; date -u
    echo "== raw torch._scaled_mm layouts"
    timeout 60 python3 benchmarks/bench_quantlinear.py --out "$OUT" --probe-layouts 2>&1
    echo "rc=$?"
  elif [ "$MODE" = ablation ]; then
    export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
    echo "== ablation (background: $OUT/ablation.log)"
    python3 benchmarks/ablation.py --out "$OUT/abl" --steps "${STEPS:-400}" --seeds "${SEEDS:-0,1,2}" --jobs "${JOBS:-7}" \
      --deadline "${DEADLINE:-230}" >"$OUT/ablation.log" 2>&1 &
    ABL=$!
    echo "== GPU tests: blockwise FP8 GEMM"
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_recipes_gpu.py -k "scaled_mm or autocast" 2>&1 | tail -n 30
    echo "rc=${PIPESTATUS[0]}"; date -u
    echo "== GPU tests: compiled == eager spec, the ablation's operand kinds"
    timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_recipes_gpu.py \
      -k "test_compiled_quantizers_match_eager_spec and bfloat16 or test_compiled_fp8_quantizer or nvfp4_on_large" 2>&1 | tail -n 40
    echo "rc=${PIPESTATUS[0]}"; date -u
    wait $ABL
    echo "ablation rc=$?"; date -u
    grep -v "^W1" "$OUT/ablation.log" | grep -E "seed|stopped|\\|" | tail -n 40
    mv "$OUT/abl/ablation."* "$OUT/" 2>/dev/null; rm -rf "$OUT/abl"
    echo "== step times (compiler caches warm)"
    timeout "${STEP_TIMES_S:-70}" python3 benchmarks/ablation.py --out "$OUT" --step-times --time-steps 5 2>&1 | grep -v "^W1" | head -n 40
    echo "rc=${PIPESTATUS[0]}"
  else
    echo "== QuantLinear throughput"
    timeout "${BENCH_S:-300}" python3 benchmarks/bench_quantlinear.py --out "$OUT" --reps 5 2>&1 | grep -v "^W1"
    echo "rc=${PIPESTATUS[0]}"
  fi
  date -u
  du -sh .out/recipes_inductor
} 2>&1 | tee "$LOG"
if [ "${CACHE_TGZ:-0}" = 1 ]; then
  tar czf "$OUT/inductor_cache.tgz" -C .out recipes_inductor && ls -la "$OUT/inductor_cache.tgz"
fi
