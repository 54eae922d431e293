#!/usr/bin/env bash
# Issue 46, one H200 (nvidia-h200), 2026-11-29: jax_impl's whole-sequence document block against
# flash_mha_varlen on the same ids (benchmarks/one_gpu_documents.py), then where its step goes
# (benchmarks/mesh_profile_jax.py on a one-device mesh). Carry .whl (flash_attn3_jax).
#   STEPS=check,prof TAG=base bash docs/gpu/documents-2026-11-29-h200/run.sh
#   STEPS=var VARIANTS="base ladder cond:ladder,slots48" MIXES=short,few-long bash .../run.sh
# (var: each variant of variants.py in its own process, checked then timed; "cond:" prefix: XLA's
# conditionals inside command buffers, on the device, rather than a predicate copied to the host;
# "nocb:": no command buffers at all — every kernel launched by the host, no CUDA graph to update)
# Torch (third session; carry .fa4b and .whl after the .fa4a stash, docs/gpu/install-wheels.sh):
#   STEPS=tier,torch,torchprof TAG=torch bash docs/gpu/documents-2026-11-29-h200/run.sh
# (tier: the one-GPU kernel tier's document and FA4 checks; torch: torch_impl on one GPU against the
# faster of FA4's and FA2's varlen kernels, then FA4's compile stream; torchprof: where its step goes;
# trace: torch_trace.py's variants, checked, timed and traced)
set -u
R=/tmp/rb-1; TAG=${TAG:-base}; mkdir -p $R/$TAG  # the call gets one tgz of it ($OUT: a call returns a few dozen files)
. docs/gpu/install-wheels.sh $R
export JAX_PLATFORMS=cuda
for step in ${STEPS//,/ }; do
  case $step in
    tier) timeout ${TIER_S:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_one_gpu_kernels.py -rs \
            -k "fa3_varlen or cudnn_varlen or own_document or fa4" 2>&1 | tee $R/$TAG/tier.txt | tail -n 8 ;;
    torch) timeout ${TORCH_S:-330} python3 -m benchmarks.one_gpu_documents --out $R/$TAG --frameworks torch \
             --stream ${STREAM:-50} ${DOCS_ARGS:-} 2>&1 | grep -v "^W1\|Warning" | tail -n 30 ;;
    torchprof) PATHS=ring-r1:contiguous MIXES=${PROF_MIXES:-short,few-long} SEQ=32768 OUT=$R/$TAG \
                 timeout ${PROF_S:-150} torchrun --nproc_per_node 1 benchmarks/mesh_profile_torch.py 2>&1 | \
                 grep '^{' | cut -c1-400 ;;
    trace) timeout ${TRACE_S:-400} python3 docs/gpu/documents-2026-11-29-h200/torch_trace.py --out $R/$TAG \
             --mixes ${TRACE_MIXES:-short,few-long} 2>&1 | grep '^{' | cut -c1-330 ;;
    check) timeout ${CHECK_S:-330} python3 -m benchmarks.one_gpu_documents --out $R/$TAG ${DOCS_ARGS:-} 2>&1 | tail -n 40 ;;
    big) timeout ${BIG_S:-200} python3 -m benchmarks.one_gpu_documents --out $R/$TAG-128k --seq 131072 \
           --mixes ${BIG_MIXES:-short,few-long} --iters 5 --warmup 2 2>&1 | grep "'time'" | tail -n 4 ;;
    prof) MIXES=${PROF_MIXES:-short,few-long} PATHS=ring-r1:contiguous SEQ=32768 OUT=$R/$TAG \
            timeout ${PROF_S:-200} python3 benchmarks/mesh_profile_jax.py 2>&1 | grep -v "^I0\|^W0" | tail -n 30 ;;
    var) for v in $VARIANTS; do
           flags=${XLA_FLAGS:-}; name=$v  # (XLA reads a blank XLA_FLAGS as a file name: set only when non-empty)
           case $v in cond:*) flags="$flags --xla_gpu_enable_command_buffer=+CONDITIONAL"; name=${v#cond:} ;;
             nocb:*) flags="$flags --xla_gpu_enable_command_buffer="; name=${v#nocb:} ;; esac
           ${flags:+env XLA_FLAGS="$flags"} env VARIANT=$name timeout ${VAR_S:-150} python3 \
             docs/gpu/documents-2026-11-29-h200/variants.py --out $R/var-${v//[:,]/-} --mixes ${MIXES:-short,few-long} \
             2>&1 | grep -v "^I1\|^W1" | tail -n 12
         done ;;
  esac
done
[ -n "${OUT:-}" ] && (cd $R && tar czf $OUT/results-$TAG.tgz --exclude=jax-cache .)
