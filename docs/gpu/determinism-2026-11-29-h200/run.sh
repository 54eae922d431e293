#!/usr/bin/env bash
# Issue 46 (item 3: fa4 under deterministic=True) and the run list's JAX cache, one H200
# (nvidia-h200), 2026-11-29 (sixth session). Steps, in calls:
#   call 1 (carry .fa4a):          STEPS=stash,cachew bash docs/gpu/determinism-2026-11-29-h200/run.sh
#   call 2 (carry .fa4b, .whl; at once): STEPS=fa4,cost,probe bash docs/gpu/determinism-2026-11-29-h200/run.sh
#   call 3 (a fresh machine; carry .fa4a, .jaxcache): STEPS=stash,cacher bash .../run.sh
#   call 4 (carry .fa4b, .whl; at once): STEPS=fa4,cost,probe — after the strict switch (the code of this commit)
#   calls 5, 6 (a fresh machine: .fa4a, then .fa4b and .whl): STEPS=stash, then STEPS=fa4,tier
# stash   FA4's first part into /root/keep (../shared/tools/fa4-wheels.sh)
# cachew  the JAX twin's step (2,048 tokens, no ids) compiled with the persistent cache on; the cache comes back
#         as $OUT/jaxcache.tgz (is an entry written on one H200 machine taken on another? the 4-GPU run list's
#         KEEP_JAX_CACHE relies on it, untried)
# cacher  the same compile on a fresh machine with that cache unpacked first: its compile seconds and whether the
#         cache grew
# fa4     install FA4 (.fa4b) and flash_attn3_jax (.whl)
# cost    benchmarks.determinism_cost: each torch backend checked, repeated and timed in default and deterministic mode
# tier    the GPU tier's torch kernels after the change: every deterministic route, fa4's, FA2's varlen and window
# probe   python -m parity determinism on one GPU through the API, torch's three modes: without documents, then
#         with the short mix
set -u
R=/tmp/rb-det; TAG=${TAG:-det}; mkdir -p $R
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8
COMPILE="python3 -m benchmarks.jax_compile_probe --compile-only --no-ids --seq 2048 --variants autotune"
for step in ${STEPS//,/ }; do
  echo "== $step $(date +%T)"
  case $step in
    stash) mkdir -p /root/keep && cp .fa4a/* /root/keep/ && ls /root/keep | wc -l ;;
    cachew) rm -rf $JAX_COMPILATION_CACHE_DIR; timeout ${CACHE_S:-150} $COMPILE --out $R/cachew 2>&1 | tail -n 3
      echo "cache entries written: $(ls $JAX_COMPILATION_CACHE_DIR | wc -l)"
      [ -n "${OUT:-}" ] && tar czf $OUT/jaxcache.tgz -C $JAX_COMPILATION_CACHE_DIR . && ls -la $OUT/jaxcache.tgz ;;
    cacher) hostname; nvidia-smi --query-gpu=uuid --format=csv,noheader
      rm -rf $JAX_COMPILATION_CACHE_DIR && mkdir -p $JAX_COMPILATION_CACHE_DIR
      tar xzf .jaxcache/jaxcache.tgz -C $JAX_COMPILATION_CACHE_DIR; before=$(ls $JAX_COMPILATION_CACHE_DIR | wc -l)
      timeout ${CACHE_S:-150} $COMPILE --out $R/cacher 2>&1 | tail -n 3
      echo "cache entries: $before carried in, $(ls $JAX_COMPILATION_CACHE_DIR | wc -l) after" ;;
    fa4) . docs/gpu/install-wheels.sh $R; cat $R/gpus.txt; cat $R/notes.txt 2>/dev/null ;;
    cost) timeout ${COST_S:-300} python3 -m benchmarks.determinism_cost --out $R/cost \
            ${COST_ARGS:-} 2>&1 | grep "^|\|Error\|error" | cut -c1-300 ;;
    tier) JAX_PLATFORMS=cuda timeout ${TIER_S:-420} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_one_gpu_kernels.py \
            -k "${TIER_K:-deterministic or fa4 or torch_varlen or torch_window}" 2>&1 | tail -n 15 ;;
    probe) for docs in "" "--documents short"; do  # plain blocks (FA2's, cuDNN's, FA4's dense), then documents
        timeout ${PROBE_S:-120} python3 -m parity determinism --devices gpu --ring 1 --seq 16384 --heads 8 --kv-heads 2 \
          $docs --frameworks torch --json $R/probe${docs:+-documents}.json \
          --torch-backends reference,aten_flash,aten_cudnn,aten_varlen,aten_window,fa4 2>&1 | grep -v Warning | grep "^torch"
      done ;;
  esac
done
[ -n "${OUT:-}" ] && (cd $R && tar czf $OUT/results-$TAG.tgz .) && ls -la $OUT
