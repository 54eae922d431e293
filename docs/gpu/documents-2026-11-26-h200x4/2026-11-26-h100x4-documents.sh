#!/usr/bin/env bash
# Issue 46 on 4 GPUs (nvidia-h100-x4, or the H200s it may come as): packed documents at 128k tokens
# on the mesh, both frameworks, the three balance mixes, the static zigzag and the per-document
# hybrid on ring / all-gather KV / USP 2×2 (+ Ulysses 4), every path verified on the mesh first
# (benchmarks.verify), each framework's varlen anchor on one GPU of the same machine on the same
# ids (torch: the faster of FA2 and FlashAttention-4). One background run spans several device
# calls (each ≤ 10 min; the machine must not idle 30 s between them):
#   call 1 (carry .fa4a):         mkdir -p /root/keep && cp .fa4a/* /root/keep/
#   call 2 (carry .fa4b, .whl):   bash docs/gpu/documents-2026-11-26-h200x4/2026-11-26-h100x4-documents.sh start
#   call 3, 4 (no carry):         bash docs/gpu/documents-2026-11-26-h200x4/2026-11-26-h100x4-documents.sh wait
# SMOKE=1 start: the CPU path (JAX side only, 1024 tokens). Results and logs under $OUT each call.
set -u
. docs/gpu/background.sh
R=/tmp/rb-documents; LOG=$R/run.log
SEQ=${SEQ:-131072}; MIXES=${MIXES:-short,heavy-tail,few-long}; LAYOUTS=${LAYOUTS:-zigzag,document-hybrid}
MESHES=${MESHES:-ring-r4,ring-agkv-r4,usp-r2xu2,ulysses-u4}; ITERS=${ITERS:-5}
TORCH_BACKENDS=${TORCH_BACKENDS:-auto}; ONLY=${ONLY:-torch,jax}  # e.g. TORCH_BACKENDS=auto,fa4 ONLY=torch
JAX_MESHES=${JAX_MESHES:-$MESHES}; JAX_MIXES=${JAX_MIXES:-$MIXES}  # the JAX side's own subset (a re-run)
COMMON=(--gpus 4 --seqs $SEQ --documents $MIXES --layout $LAYOUTS --meshes $MESHES --heads 32 --kv-heads 8
        --passes fwd+bwd --iters $ITERS --warmup 2 --machine h100x4-documents --torch-backends $TORCH_BACKENDS)
if [ "$1" = start ]; then
  mkdir -p $R
  if [ "${SMOKE:-0}" != 1 ]; then
    . docs/gpu/install-wheels.sh $R
  else
    COMMON=(--gpus 4 --seqs 1024 --documents short --layout $LAYOUTS --meshes ring-r4,ring-agkv-r4 --heads 4
            --kv-heads 2 --passes fwd+bwd --iters 1 --warmup 0 --machine cpu-smoke --only jax)
    export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4
  fi
  export PYTHONUNBUFFERED=1
  # torch first (its anchors decide FA2 vs FA4), then JAX: two driver runs, each verifying its own paths
  if [ "${SMOKE:-0}" = 1 ]; then
    RUNS="python3 -m benchmarks ${COMMON[*]} --parts-dir $R/jax --no-verify;"
  else
    RUNS=""
    # the fa4 block backend's GPU tier first when it is asked for: no timing of an unchecked kernel
    [[ $TORCH_BACKENDS == *fa4* ]] && RUNS="python3 -m pytest -q -p no:cacheprovider tests/gpu/test_one_gpu_kernels.py -k 'fa4' > $R/fa4-tier.log 2>&1; "
    for side in ${ONLY//,/ }; do
      extra=""; [ $side = jax ] && extra="--meshes $JAX_MESHES --documents $JAX_MIXES"  # later flags win
      RUNS="$RUNS python3 -m benchmarks ${COMMON[*]} $extra --only $side --parts-dir $R/$side;"
    done
  fi
  rb_start $R "$RUNS"
  set -- wait
fi
if [ "$1" = wait ]; then
  rb_wait $R
  cp -r benchmarks/results/*documents* $R/ 2>/dev/null
  [ -n "${OUT:-}" ] && tar czf $OUT/documents.tgz -C $R .
  grep -E "verify |anchor|_impl |seq .* done|Error|error|exited|parts in" $LOG | cut -c1-220 | tail -60
fi
