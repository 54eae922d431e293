#!/usr/bin/env bash
# Third call of the 2026-11-25 issue-35 session (nvidia-h100-x1): jax_impl with a device's only
# block kept in the inputs' dtype (no float32 copy of o / dq) — the JAX one-device rows re-verified
# and timed beside the same-run anchors, and the R 8 document row at 128k on its two end devices
# (all eight did not finish compiling within a step). Run from the repository root with $OUT set.
set -u
L=/tmp/rb3; mkdir -p $L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - start))" >> $L/steps.txt
}
BENCH=(python -m benchmarks --gpus 1 --kv-heads 8 --no-kernels --warmup 2 --frameworks jax)
step anchors32k 90 python -m benchmarks.masked --seq 32768 --parts anchors --out $L/anchors32k
step docs32k-jax 120 "${BENCH[@]}" --iters 10 --machine h100-jaxdocs32k-r4 --seq 32768 --documents mix \
  --strategies ring-r1
step window32k-jax 90 "${BENCH[@]}" --iters 10 --machine h100-jaxwindow32k-r4 --seq 32768 --window 4096 \
  --strategies ring-r1
step docs128k-jax 300 "${BENCH[@]}" --iters 5 --machine h100-jaxdocs128k-r4 --seq 131072 --documents mix \
  --strategies zigzag-r8 --replay-devices ends
cp benchmarks/results/2026-11-25-h100-jax*-r4-1gpu.* $L/ 2>/dev/null
tar czf $OUT/rb3.tgz -C $L .
cat $L/steps.txt
grep -hE "_replay .*(fwd|bwd)|anchor \{|verification|Error" $L/*.log | cut -c1-220 | tail -40
