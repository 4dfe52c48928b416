# Sourced, from the repository root and with $OUT set, by run_gpu_dispatch.sh and run_gpu_moe.sh: the
# environment of every step (NVLS and multicast off, the repository on PYTHONPATH, the native build
# directory), $OUT made, t0 for the step times, and the device and versions in $OUT/device.txt.
#   OUT="${OUT:-/tmp/moe_fp4_x}"; . benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MOE_FP4_BUILD_DIR="${MOE_FP4_BUILD_DIR:-$PWD/build/native}"
mkdir -p "$OUT"
t0=$SECONDS
{ date -u; nvidia-smi -L; python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } \
  > "$OUT/device.txt" 2>&1
