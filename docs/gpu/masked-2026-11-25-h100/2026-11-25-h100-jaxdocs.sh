#!/usr/bin/env bash
# Second call of the 2026-11-25 issue-35 session (nvidia-h100-x1): the JAX packed-document rows
# again, now with the segment ids a jitted argument (the first call compiled them in as constants:
# XLA constant-folded the run lists and the portable kernel's masks — R 8 at 128k never finished
# compiling), beside the same-run anchors; and the JAX window rows at 128k with more iterations.
# Run from the repository root with $OUT set (one device call: the steps fit 10 minutes).
set -u
L=/tmp/rb2; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - start))" >> $L/steps.txt
}
BENCH=(python -m benchmarks --gpus 1 --kv-heads 8 --no-kernels --warmup 2)
step anchors32k 90 python -m benchmarks.masked --seq 32768 --parts anchors --out $L/anchors32k
step docs32k-jax 120 "${BENCH[@]}" --iters 10 --machine h100-jaxdocs32k-r3 --seq 32768 --documents mix \
  --strategies ring-r1 --frameworks jax
step docs128k-jax 300 "${BENCH[@]}" --iters 5 --machine h100-jaxdocs128k-r3 --seq 131072 --documents mix \
  --strategies zigzag-r8 --frameworks jax --replay-devices all
step window128k-jax 120 "${BENCH[@]}" --iters 10 --machine h100-jaxwindow128k-r3 --seq 131072 --window 4096 \
  --strategies contiguous-r8 --frameworks jax --replay-devices all
cp benchmarks/results/2026-11-25-h100-jax*-r3-1gpu.* $L/ 2>/dev/null
tar czf $OUT/rb2.tgz -C $L .
cat $L/steps.txt
grep -hE "_replay .*(fwd|bwd)|anchor \{|Error" $L/*.log | cut -c1-220 | tail -50
