#!/usr/bin/env bash
# The one-GPU session of issues 25 and 26 (nvidia-h100-x1, 2026-11-23): torch's "flex" block
# backend verified on the GPU, then packed-document and sliding-window rows of the one-GPU replay
# benchmark (every row's path verified first on a reduced problem through the parity pipeline).
# Run from the repository root with $OUT set; each step has its own time limit so that a slow
# compilation cuts that step only. Results: $OUT/*.log and $OUT/results/ (benchmarks/results).
set -u
OUT=${OUT:-/tmp/ringbridge-gpu}
mkdir -p "$OUT/results"
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
python -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)" >> "$OUT/gpu.txt"
step() {  # step NAME SECONDS COMMAND...: run with a limit, log, record the exit status
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? seconds=$((SECONDS - start))" | tee -a "$OUT/steps.txt"
}
BENCH=(python -m benchmarks --gpus 1 --iters 3 --warmup 1 --no-kernels)  # timeout runs programs, not shell functions
[ "${SKIP_TIER:-0}" = 1 ] || step flex-gpu-tier 140 python -m pytest tests/gpu/test_one_gpu_kernels.py -k flex -q -rs -p no:cacheprovider
step packed-flex 160 "${BENCH[@]}" --machine h100-packed-flex --frameworks torch --backend flex --documents mix \
    --seq 131072 --strategies zigzag-r8,stripe-r8
step unpacked-auto 50 "${BENCH[@]}" --machine h100-unpacked-auto --frameworks torch --seq 131072 --strategies zigzag-r8
step window-flex 130 "${BENCH[@]}" --machine h100-window4k-flex --frameworks torch --backend flex --window 4096 \
    --seq 131072 --strategies contiguous-r8,contiguous-r2
step packed-jax 60 "${BENCH[@]}" --machine h100-packed-jax16k --frameworks jax --documents mix --seq 16384 \
    --strategies zigzag-r4
cp benchmarks/results/*2026-11-23-h100-* "$OUT/results/" 2>/dev/null
cat "$OUT/steps.txt"
