#!/usr/bin/env bash
# On a GPU machine: build the native ops, run the GPU tests, compute-sanitizer (memcheck, racecheck,
# initcheck) over a small driver, and the kernel benchmark (all shapes without torch.compile, then
# the smallest shape again with --compile for the torch.compile-of-the-spec column). Logs and
# results go to $OUT (default ./.out, at most 8 files); a short summary is printed last.
#   STEPS=build,test,sanitize,bench (default: all)
#   BENCH_ARGS="--tokens 4096 32768 --reps 40" (default)   COMPILE_ARGS="--tokens 4096 --reps 20" ("" skips it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} MOE_FP4_NATIVE=1
export MOE_FP4_BUILD_DIR=${MOE_FP4_BUILD_DIR:-$PWD/build/native}
STEPS=${STEPS:-build,test,sanitize,bench}
BENCH_ARGS=${BENCH_ARGS:---tokens 4096 32768 --reps 40}
COMPILE_ARGS=${COMPILE_ARGS---tokens 4096 --reps 20}
summary=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss' "$name" "$rc" "$(($(date +%s) - t0))")")
  tail -n 4 "$OUT/$name.log"
}

want() { [[ ",$STEPS," == *",$1,"* ]]; }

{ date -u; nvidia-smi; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; } \
  >"$OUT/device.txt" 2>&1

if want build; then
  step build "${LIMIT_BUILD:-300}" python3 -m moe_fp4 build
fi
if want test; then
  step tests "${LIMIT_TEST:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_ops.py
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 3
fi
if want sanitize; then
  san=(compute-sanitizer --error-exitcode 99 --print-limit 20)
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  step memcheck "${LIMIT_SAN:-200}" "${san[@]}" --tool memcheck --kernel-name kns=sm90 python3 -m moe_fp4.ops.selfcheck
  step racecheck "${LIMIT_SAN:-200}" "${san[@]}" --tool racecheck --kernel-name kns=sm90 python3 -m moe_fp4.ops.selfcheck
  # initcheck does not see the tensor-copy engine's writes (the column op's tile stores) and reports
  # every such byte as uninitialized when it is read: it runs with the threads storing every tile
  # (test_kernels_gpu checks both store forms bit for bit over garbage-filled memory).
  export MOE_FP4_COLUMN_BOX_STORE=0
  step initcheck "${LIMIT_SAN:-200}" "${san[@]}" --tool initcheck python3 -m moe_fp4.ops.selfcheck
  unset MOE_FP4_COLUMN_BOX_STORE
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
  # one file for the three tools (at most 8 files come back from the device machine)
  for t in memcheck racecheck initcheck; do echo "== $t"; cat "$OUT/$t.log"; rm -f "$OUT/$t.log"; done >"$OUT/sanitizer.log"
  grep -hE "^== |ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/sanitizer.log"
fi
if want bench; then
  # shellcheck disable=SC2086
  step bench "${LIMIT_BENCH:-240}" python3 -m moe_fp4 bench kernels --markdown "$OUT/kernels.md" $BENCH_ARGS
  cat "$OUT/kernels.md" 2>/dev/null
  if [ -n "$COMPILE_ARGS" ]; then
    # shellcheck disable=SC2086
    step bench_compile "${LIMIT_COMPILE:-240}" python3 -m moe_fp4 bench kernels --compile \
      --markdown "$OUT/kernels_compile.md" $COMPILE_ARGS
    cat "$OUT/kernels_compile.md" 2>/dev/null
  fi
fi

echo "== summary =="
printf '%s\n' "${summary[@]}"
