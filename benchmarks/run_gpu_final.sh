#!/usr/bin/env bash
# One H200 call: the lead script (spec on CUDA, activation cache, kernel benchmark) then the recipes
# script (GPU tests, QuantLinear throughput, ablation). Everything under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT/recipes"
bash benchmarks/run_gpu_lead.sh 2>&1 | tee "$OUT/lead.log" | tail -40
OUT="$OUT/recipes" ABLATION_BUDGET_S=${ABLATION_BUDGET_S:-200} bash benchmarks/run_gpu_recipes.sh >/dev/null 2>&1
grep -E "passed|failed|rc=|vs BF16|final|steps" "$OUT/recipes/run.log" | tail -30
ls "$OUT/recipes"
# at most 8 files come back: keep the logs that carry everything
tail -5 "$OUT/build.log" >>"$OUT/lead.log"
rm -f "$OUT"/{device.txt,build.log,tests.log,cache.log,bench.log} "$OUT/recipes/bench_quantlinear.json"
find "$OUT" -type f | sort
