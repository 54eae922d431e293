#!/usr/bin/env bash
# Issue 46, one H200 (nvidia-h200), 2026-11-29 (fifth session): where the host is while the GPU
# idles inside and around jax_impl's 32k short-mix step (benchmarks/host_gaps.py on the host half of
# mesh_profile_jax.py's trace), with XLA's conditionals on the host (base) and inside command
# buffers (cond); and the switch microbenchmark again, now checked. Carry .whl (flash_attn3_jax).
#   STEPS=sc,hostprof VARIANTS="base cond:base" bash docs/gpu/host-gaps-2026-11-29-h200/run.sh     (call 1)
#   STEPS=hostprof VARIANTS="anchor base coarse4" bash docs/gpu/host-gaps-2026-11-29-h200/run.sh  (call 2)
#   STEPS=hostprof,docs VARIANTS="noprune base noprune base" DOCS_ARGS="--mixes short,few-long" bash .../run.sh (call 3:
#   bounds a slot count cannot reach no longer compiled; one_gpu_documents with its queued columns)
#   STEPS=abdocs VARIANTS="noprune base noprune base" DOCS_ARGS="--mixes short" bash .../run.sh   (call 4)
# Each variant's folder gets the raw trace, the optimized HLO of the step (gzip) and host-gaps.json.
set -u
R=/tmp/rb-hg; TAG=${TAG:-hg}; HERE=docs/gpu/host-gaps-2026-11-29-h200; mkdir -p $R
. docs/gpu/install-wheels.sh $R
export JAX_PLATFORMS=cuda
LHS=--xla_gpu_enable_latency_hiding_scheduler=true
for step in ${STEPS//,/ }; do
  case $step in
    docs) timeout ${DOCS_S:-300} python3 -m benchmarks.one_gpu_documents --out $R/docs ${DOCS_ARGS:-} 2>&1 | \
            grep -v "^I1\|^W1" | grep "'time'\|passed" | cut -c1-420 ;;
    abdocs) for v in $VARIANTS; do  # one_gpu_documents on each variant of hostvar.py, each its own process
        echo "== $v $(date +%T)"; d=$R/ab-$v-$(date +%H%M%S)
        VARIANT=$v TARGET=docs timeout ${AB_S:-150} python3 $HERE/hostvar.py --out $d ${DOCS_ARGS:-} > $d.log 2>&1
        python3 -c "import json; [print(r['mix'], *(f'{k} {r[k]:.3f}' for k in ('impl_ms', 'anchor_ms', 'ratio', \
          'impl_queued_ms', 'anchor_queued_ms', 'queued_ratio'))) for r in json.load(open('$d/one-gpu-documents.json')) \
          if r['kind'] == 'time' and 'ratio' in r]" || tail -n 5 $d.log
      done ;;
    sc) timeout ${SC_S:-120} python3 docs/gpu/documents-2026-11-29-h200/switch_cost.py --out $R/sc 2>&1 | tail -n 9 ;;
    hostprof) for v in $VARIANTS; do  # [cond:|nocc:]VARIANT of hostvar.py (base, coarse4, anchor)
        flags=$LHS; name=${v#*:}
        case $v in cond:*) flags="$flags --xla_gpu_enable_command_buffer=+CONDITIONAL" ;;
          nocc:*) flags="$flags --xla_gpu_enable_command_buffer=-CUSTOM_CALL" ;; esac
        d=$R/hp-${v//:/-}; rm -rf /tmp/jaxprof-4gpu /tmp/jaxprof-hlo; mkdir -p $d
        echo "== $v $(date +%T) $flags"
        XLA_FLAGS="$flags" VARIANT=$name MIXES=${MIXES:-short} PATHS=ring-r1:contiguous SEQ=32768 OUT=$d \
          timeout ${PROF_S:-150} python3 $HERE/hostvar.py 2>&1 | grep -v "^I1\|^W1\|^I0\|^W0" | tail -n 4
        for mix in ${MIXES:-short}; do
          for t in /tmp/jaxprof-4gpu/$mix-ring-r1-contiguous /tmp/jaxprof-4gpu/$mix-anchor; do
            [ -d $t ] || continue
            python3 -m benchmarks.host_gaps $t --out $d/$mix-host-gaps.json | head -c 1800; echo
            cp "$(ls -t $(find $t -name '*.trace.json.gz') | head -n 1)" $d/$mix.trace.json.gz
          done
        done
        h=$(ls -S /tmp/jaxprof-hlo/*jit_both*after_optimizations.txt 2>/dev/null | head -n 1)
        [ -n "$h" ] && gzip -c "$h" > $d/both-after-optimizations.txt.gz
        t=$(ls -S /tmp/jaxprof-hlo/*jit_both*thunk_sequence* 2>/dev/null | head -n 1); [ -n "$t" ] && gzip -c "$t" > $d/thunks.txt.gz
      done ;;
  esac
done
[ -n "${OUT:-}" ] && (cd $R && tar czf $OUT/results-$TAG.tgz --exclude=jax-cache .) && ls -la $OUT
