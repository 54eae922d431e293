#!/usr/bin/env bash
# Issue 27 on one GPU of nvidia-h200-x2 (2026-11-23; GPU 0, the other idle): the tiny Llama's bf16
# training step with every strategy's attention replayed, against the float64 step (packed
# documents, then one document per row so every block runs a fused kernel), and one step of a
# 4-layer d_model-2048 model at 32k tokens timed next to its compute prediction.
# Then issue 29's benchmark driver is started in the background on both GPUs (benchmarks/device_run.sh).
set -u
OUT=${OUT:-/tmp/ringbridge-gpu}
mkdir -p "$OUT/model"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? seconds=$((SECONDS - start))" | tee -a "$OUT/steps.txt"
}
export PYTHONUNBUFFERED=1
step llama-check-packed ${CHECK_S:-120} env CUDA_VISIBLE_DEVICES=0 python -m parity.training.llama_gpu check --out "$OUT/model"
step llama-check-one-document ${CHECK_S:-120} env CUDA_VISIBLE_DEVICES=0 python -m parity.training.llama_gpu check --one-document --out "$OUT/model"
step llama-time ${TIME_S:-120} env CUDA_VISIBLE_DEVICES=0 python -m parity.training.llama_gpu time --out "$OUT/model"
cat "$OUT/steps.txt"
