#!/usr/bin/env bash
# Issue 29, part 1 (nvidia-h200-x2, 2026-11-23): the GPU tier's multi-GPU part (torch_impl over a
# 2-rank NCCL world, every block backend) and the parity report with the real collectives of 2 GPUs
# (JAX: one process on both GPUs; torch: a 2-rank NCCL world; meshes of more devices replayed).
# Run from the repository root with $OUT set and flash_attn3_jax on PYTHONPATH; NVLink multicast
# stays off as the machine sets it (NCCL_NVLS_ENABLE=0 etc. are left alone).
set -u
OUT=${OUT:-/tmp/ringbridge-gpu}
mkdir -p "$OUT"
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m;
  env | grep -E "NCCL_NVLS|MULTICAST|NVSHMEM_DISABLE" ; } > "$OUT/machine.txt" 2>&1
python -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, torch.cuda.device_count())" >> "$OUT/machine.txt" 2>&1
step() {  # step NAME SECONDS COMMAND...: run with a limit, log, record the exit status
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? seconds=$((SECONDS - start))" | tee -a "$OUT/steps.txt"
}
step nccl-2gpu ${NCCL_S:-120} python -m pytest tests/gpu/test_nccl_multi_gpu.py -q -rs -s -p no:cacheprovider --seed 7
step parity-gpu ${PARITY_S:-420} python -m parity --devices gpu --no-accounting --seed 7 --out "$OUT/parity-gpu"
cat "$OUT/steps.txt"
