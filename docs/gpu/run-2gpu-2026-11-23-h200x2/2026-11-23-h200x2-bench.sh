#!/usr/bin/env bash
# Issue 29, part 2 (nvidia-h200-x2, 2026-11-23): the multi-GPU benchmark driver on 2 H200s, verified
# rows only — both frameworks, torch context_parallel, yunchang and flash_attn3_jax's ring side by
# side; ring (zigzag, stripe, contiguous), Ulysses 2 and all-gather KV; forward and forward+backward;
# peak memory; strong scaling (16k tokens: the one-GPU ceilings vs 2 GPUs) and weak scaling (32k and
# 64k tokens per GPU, 1 -> 2 GPUs); then the packed-document and window rows.
# Run from the repository root with $OUT set and flash_attn3_jax + yunchang on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/ringbridge-gpu}
mkdir -p "$OUT/results"
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: run with a limit, log, record the exit status
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? seconds=$((SECONDS - start))" | tee -a "$OUT/steps.txt"
}
DRIVER=(python -m benchmarks --gpus 2 --iters ${ITERS:-3} --warmup 1 --jax-backends auto --torch-backends auto)
step main ${MAIN_S:-330} "${DRIVER[@]}" --machine h200x2 --seqs ${SEQS:-16384,131072} --ceiling-seq 16384 \
    --meshes ring-r2,ulysses-u2,ring-agkv-r2 --layout ${LAYOUTS:-zigzag,stripe,contiguous} --weak ${WEAK:-32768,65536}
MASKED=("${DRIVER[@]}" --seqs 131072 --meshes ring-r2,ulysses-u2 --peers cp)
step documents ${DOCS_S:-100} "${MASKED[@]}" --machine h200x2-packed --layout zigzag --documents mix
step window4k ${WIN_S:-80} "${MASKED[@]}" --machine h200x2-window4k --layout contiguous,zigzag --window 4096
step window16k ${WIN_S:-80} "${MASKED[@]}" --machine h200x2-window16k --layout contiguous,zigzag --window 16384
cp benchmarks/results/*h200x2* "$OUT/results/" 2>/dev/null
cat "$OUT/steps.txt"
