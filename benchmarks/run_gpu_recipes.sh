#!/usr/bin/env bash
# Recipes on one GPU (H200). Writes to $OUT (default benchmarks/results/gpu_recipes); run.log holds the
# environment and every step's output.
#   MODE=check bash benchmarks/run_gpu_recipes.sh      (about 2-3 minutes)
#       step times per configuration, compiled and eager quantizers, and a torch.profiler table
#       (step_times.{md,json}); the GPU tests (tests/test_recipes_gpu.py); the raw torch._scaled_mm
#       layout probe (scaled_mm_layouts.md)
#   MODE=ablation STEPS=600 SEEDS=0,1,2 JOBS=3 bash benchmarks/run_gpu_recipes.sh
#       QuantLinear throughput (bench_quantlinear.{md,json}), then the ablation (ablation.{md,json,png})
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
  else
    echo "== QuantLinear throughput"
    timeout "${BENCH_S:-120}" python3 benchmarks/bench_quantlinear.py --out "$OUT" --reps 5 2>&1 | grep -v "^W1"
    echo "rc=${PIPESTATUS[0]}"; date -u
    echo "== ablation"
    timeout "${ABLATION_S:-400}" python3 benchmarks/ablation.py --out "$OUT" --steps "${STEPS:-600}" \
      --seeds "${SEEDS:-0,1,2}" --jobs "${JOBS:-3}" 2>&1 | grep -v "^W1"
    echo "rc=${PIPESTATUS[0]}"
    # no partial report when the workers were cut short: build it from what they wrote
    [ -f "$OUT/ablation.md" ] || python3 benchmarks/ablation.py --out "$OUT" --report-only --steps "${STEPS:-600}" \
      --seeds "${SEEDS:-0,1,2}" 2>&1 | tail -n 12
  fi
  date -u
  du -sh .out/recipes_inductor
} 2>&1 | tee "$LOG"
if [ "${CACHE_TGZ:-0}" = 1 ]; then
  tar czf "$OUT/inductor_cache.tgz" -C .out recipes_inductor && ls -la "$OUT/inductor_cache.tgz"
fi
