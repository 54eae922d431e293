#!/usr/bin/env bash
# Issue 36 on nvidia-h100-x1: packed documents at 128k tokens over a replayed ring of 8, every
# device timed, the three balance mixes, three layouts (the static zigzag, the per-document zigzag,
# the per-document hybrid) — each replay verified first against the float64 oracle — beside each
# framework's fused varlen anchor on the whole sequence (same call).
#   bash docs/gpu/layouts-2026-11-26-h100/2026-11-26-h100-layouts.sh torch            # anchors + torch rows
#   bash docs/gpu/layouts-2026-11-26-h100/2026-11-26-h100-layouts.sh jax MIX [LAYOUTS]  # JAX rows of one mix
# Run from the repository root with $OUT set; SMOKE=1: the CPU at 2048 tokens (the code path).
set -u
PART=${1:-torch}; MIX=${2:-heavy-tail}; LAYOUTS=${3:-zigzag,document-zigzag,document-hybrid}
L=/tmp/rb-layouts; mkdir -p $L
SEQ=131072; LIMIT=420; STEP_LIMIT=${STEP_LIMIT:-240}; ITERS=5
if [ "${SMOKE:-0}" = 1 ]; then
  SEQ=2048; LIMIT=900; STEP_LIMIT=900; ITERS=2
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD JAX_PLATFORMS=cuda JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
fi
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - start))" >> $L/steps.txt
}
BENCH=(python -m benchmarks --gpus 1 --seq $SEQ --heads 32 --kv-heads 8 --no-kernels --warmup 2 --iters $ITERS
       --strategies zigzag-r8 --replay-devices all --layout)
[ "${SMOKE:-0}" = 1 ] && BENCH=(python -m benchmarks --gpus 1 --seq $SEQ --heads 4 --kv-heads 2 --head-dim 16
       --no-kernels --warmup 1 --iters $ITERS --strategies zigzag-r8 --replay-devices all --layout)
if [ "$PART" = torch ]; then
  [ "${SMOKE:-0}" = 1 ] || step anchors $LIMIT python -m benchmarks.layouts anchors --seq $SEQ --ring 8 --out $L/anchors.json
  for mix in short heavy-tail few-long; do
    step torch-$mix $STEP_LIMIT "${BENCH[@]}" $LAYOUTS --documents $mix --frameworks torch --machine h100-layouts-torch-$mix \
      --partial $L/partial-torch-$mix.json
  done
else
  step jax-$MIX $STEP_LIMIT "${BENCH[@]}" $LAYOUTS --documents $MIX --frameworks jax --machine h100-layouts-jax-$MIX \
    --partial $L/partial-jax-$MIX.json
fi
cp benchmarks/results/*h100-layouts-*-1gpu.* $L/ 2>/dev/null
[ -n "${OUT:-}" ] && tar czf $OUT/layouts-$PART-$MIX.tgz -C $L .
cat $L/steps.txt
grep -hE "verification|anchor|Error|error|_replay .*fwd\+bwd" $L/*.log | cut -c1-200 | tail -60
