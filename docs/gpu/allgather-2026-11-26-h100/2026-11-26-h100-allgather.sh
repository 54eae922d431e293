#!/usr/bin/env bash
# Issue 36, second round, on nvidia-h100-x1: packed documents at 128k tokens replayed over 8
# devices, every device timed, the three balance mixes; the static zigzag and the per-document
# hybrid, each on the ring and on all-gather-KV (whose devices run ONE varlen call forward and one
# backward: torch_impl/allgather.prefix_plan, jax_impl/allgather.prefix_plan) — every replay verified
# first against the float64 oracle — beside each framework's fused varlen anchor on the whole
# sequence (same call).
#   bash docs/gpu/allgather-2026-11-26-h100/2026-11-26-h100-allgather.sh torch            # anchors + torch rows
#   bash docs/gpu/allgather-2026-11-26-h100/2026-11-26-h100-allgather.sh jax [MIXES]       # JAX rows
# Run from the repository root with $OUT set; SMOKE=1: the CPU at 2048 tokens (the code path).
set -u
PART=${1:-torch}; MIXES=${2:-short,heavy-tail,few-long}
STRATEGIES=${STRATEGIES:-zigzag-r8,allgather-r8}; LAYOUTS=${LAYOUTS:-zigzag,document-hybrid}
L=/tmp/rb-allgather; mkdir -p $L
SEQ=131072; LIMIT=420; STEP_LIMIT=${STEP_LIMIT:-240}; ITERS=${ITERS:-5}
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
       --replay-devices all)
[ "${SMOKE:-0}" = 1 ] && BENCH=(python -m benchmarks --gpus 1 --seq $SEQ --heads 4 --kv-heads 2 --head-dim 16
       --no-kernels --warmup 1 --iters $ITERS --replay-devices all)
if [ "$PART" = torch ] && [ "${SMOKE:-0}" != 1 ] && [ "${ANCHORS:-1}" = 1 ]; then
  step anchors $LIMIT python -m benchmarks.layouts anchors --seq $SEQ --ring 8 --out $L/anchors.json
fi
# JAX: the static zigzag on the ring (the baseline), then all-gather-KV on both layouts — not the
# hybrid on the ring, whose per-device programs (every block's fused forms) compile for minutes at 128k
COMBOS=("$STRATEGIES:$LAYOUTS")
[ "$PART" = jax ] && COMBOS=("zigzag-r8:zigzag" "allgather-r8:$LAYOUTS")
[ -n "${ONLY:-}" ] && COMBOS=($ONLY)  # e.g. ONLY="allgather-r8:zigzag,document-hybrid"
for mix in ${MIXES//,/ }; do
  for combo in "${COMBOS[@]}"; do
    tag=$PART-$mix-${combo%%:*}
    step $tag $STEP_LIMIT "${BENCH[@]}" --strategies ${combo%%:*} --layout ${combo#*:} --documents $mix \
      --frameworks $PART --machine h100-allgather-$tag --partial $L/partial-$tag.json
  done
done
mv benchmarks/results/*h100-allgather-*-1gpu.* $L/ 2>/dev/null
[ -n "${OUT:-}" ] && tar czf $OUT/allgather-$PART.tgz -C $L .
cat $L/steps.txt
grep -hE "verification|anchor|Error|error|_replay .*fwd\+bwd" $L/*.log | cut -c1-200 | tail -80
