#!/usr/bin/env bash
# The MoE layer side on the GPUs of one host: build the native ops, run the GPU tests of the grouped
# GEMMs, the expert MLP, the MoE layer and (with megatron-core installed, 2 GPUs) the Megatron
# dispatcher, then the GEMM benchmark, the MoE-stack benchmark with a memory cap and a short
# convergence run. Logs go to $OUT (default /tmp/moe_fp4_moe); a summary is printed last.
#   bash benchmarks/run_gpu_moe.sh
# Environment: TOKENS (bench moe, tokens per rank), LAYERS, EXPERTS (over all GPUs; default 256, or 32 on
# one GPU: one rank's expert work of DeepSeek-V3 at expert parallelism 8), CAP_GB (memory cap; empty: none), STEPS
# and SEEDS (convergence; STEPS=0 skips it), GEMM=0 / MOE=0 (skip those benchmarks), DEEPGEMM=SRC (build
# DeepGEMM from the source tree SRC with patches/deepgemm/build.sh first: grouped_gemm_fp8 then runs on it),
# and the *_S time limits of each step.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe_fp4_moe}"
. benchmarks/gpu_env.sh
gpus=$(python -c "import torch; print(torch.cuda.device_count())")

timeout "${BUILD_S:-150}" python -m moe_fp4 build > "$OUT/build.log" 2>&1
echo "build: rc=$? ($((SECONDS - t0)) s)"
if [ -n "${DEEPGEMM:-}" ]; then
  timeout "${DEEPGEMM_S:-240}" bash patches/deepgemm/build.sh "$DEEPGEMM" > "$OUT/build_deepgemm.log" 2>&1
  echo "DeepGEMM build: rc=$? ($((SECONDS - t0)) s)"
  export PYTHONPATH="$(cd "$DEEPGEMM" && pwd):$PYTHONPATH"
fi

timeout -s INT -k 10 "${TESTS_S:-200}" python -m pytest -q -p no:cacheprovider tests/test_grouped_gemm_gpu.py \
  tests/test_moe_layer_gpu.py tests/test_experts.py tests/test_moe_layer.py > "$OUT/tests.log" 2>&1
echo "tests: rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/tests.log")"
if [ "$gpus" -ge 2 ] && python -c "import megatron.core" 2>/dev/null; then
  timeout -s INT -k 10 "${MEGATRON_S:-200}" python -m pytest -q -s -p no:cacheprovider tests/test_megatron_core.py \
    > "$OUT/tests_megatron.log" 2>&1
  echo "megatron tests: rc=$? ($((SECONDS - t0)) s): $(tail -1 "$OUT/tests_megatron.log")"
fi
if [ "${GEMM:-1}" = 1 ]; then
  timeout "${GEMM_S:-300}" python -m moe_fp4 bench gemm > "$OUT/bench_gemm.md" 2>&1
  echo "bench gemm: rc=$? ($((SECONDS - t0)) s)"
fi
if [ "${MOE:-1}" = 1 ]; then
  experts="${EXPERTS:-$([ "$gpus" -ge 2 ] && echo 256 || echo 32)}"
  timeout "${MOE_S:-400}" python -m moe_fp4 bench moe --tokens "${TOKENS:-4096,8192,16384}" --layers "${LAYERS:-2}" \
    --experts "$experts" \
    ${CAP_GB:+--memory-cap "$CAP_GB"} > "$OUT/bench_moe.md" 2>&1
  echo "bench moe: rc=$? ($((SECONDS - t0)) s)"
fi
if [ "${STEPS:-300}" != 0 ]; then
  timeout "${CONV_S:-500}" python benchmarks/moe_convergence.py --out "$OUT/convergence" --steps "${STEPS:-300}" \
    --seeds "${SEEDS:-0}" > "$OUT/convergence.log" 2>&1
  echo "convergence: rc=$? ($((SECONDS - t0)) s)"
fi
echo "== summary ($((SECONDS - t0)) s) =="
for f in bench_gemm.md bench_moe.md convergence/convergence.md; do [ -f "$OUT/$f" ] && { echo "-- $f"; cat "$OUT/$f"; }; done
