#!/usr/bin/env bash
# Recipes on one GPU (H200): the GPU tests of the recipes, QuantLinear throughput per recipe, and
# the small-GPT ablation on the standard library's source bytes. Sized for about 5 minutes on an
# H200. Writes to $OUT (default benchmarks/results/gpu_recipes): run.log (environment and every
# step's output), bench_quantlinear.{md,json}, ablation.{md,json,png}.
#   bash benchmarks/run_gpu_recipes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_recipes}
ABLATION_BUDGET_S=${ABLATION_BUDGET_S:-150}
mkdir -p "$OUT"
LOG="$OUT/run.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

{
  echo "== environment"
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

  echo "== GPU tests (tests/test_recipes_gpu.py)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_recipes_gpu.py 2>&1 | tail -n 30
  echo "rc=${PIPESTATUS[0]}"

  echo "== QuantLinear throughput"
  timeout 100 python3 benchmarks/bench_quantlinear.py --out "$OUT" --reps 3 2>&1
  echo "rc=$?"

  echo "== ablation"
  timeout $((ABLATION_BUDGET_S + 70)) python3 benchmarks/ablation.py --out "$OUT" --time-budget "$ABLATION_BUDGET_S" 2>&1
  echo "rc=$?"
  date -u
} 2>&1 | tee "$LOG"
