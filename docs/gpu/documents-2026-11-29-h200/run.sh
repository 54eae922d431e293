#!/usr/bin/env bash
# Issue 46, one H200 (nvidia-h200), 2026-11-29: jax_impl's whole-sequence document block against
# flash_mha_varlen on the same ids (benchmarks/one_gpu_documents.py), then where its step goes
# (benchmarks/mesh_profile_jax.py on a one-device mesh). Carry .whl (flash_attn3_jax).
#   STEPS=check,prof TAG=base bash docs/gpu/documents-2026-11-29-h200/run.sh
#   STEPS=var VARIANTS="base ladder cond:ladder,slots48" MIXES=short,few-long bash .../run.sh
# (var: each variant of variants.py in its own process, checked then timed; "cond:" prefix: XLA's
# conditionals inside command buffers, on the device, rather than a predicate copied to the host;
# "nocb:": no command buffers at all — every kernel launched by the host, no CUDA graph to update;
# "nocc:": command buffers without custom calls — the FFI kernels launched by the host, fusions still in graphs)
# Torch (third session; carry .fa4b and .whl after the .fa4a stash, docs/gpu/install-wheels.sh):
#   STEPS=tier,torch,torchprof TAG=torch bash docs/gpu/documents-2026-11-29-h200/run.sh
# (tier: the one-GPU kernel tier's document and FA4 checks; torch: torch_impl on one GPU against the
# faster of FA4's and FA2's varlen kernels, then FA4's compile stream; torchprof: where its step goes;
# trace: torch_trace.py's variants, checked, timed and traced)
# Fourth session (one switch for the backward's slots and bound, measured slower, not kept): this
# tree ("base") against it ("new", "nohoist": pairs.py on .exp/, this tree's packages with
# pairs/one-switch.patch applied, carried), each in its own process, alternated; checked before
# timed in every process (the report's section 6 has the commands as they ran):
#   STEPS=ab VARIANTS="base new base2 new2" MIXES=short,few-long TAG=pairs bash .../run.sh
#   STEPS=abprof VARIANTS="base nohoist new" TAG=pairs-prof bash .../run.sh
set -u
R=/tmp/rb-1; TAG=${TAG:-base}; HERE=docs/gpu/documents-2026-11-29-h200; mkdir -p $R/$TAG  # the call gets one tgz of it ($OUT: a call returns a few dozen files)
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
    ab) for v in $VARIANTS; do  # base*: this tree; new*, nohoist*: pairs.py on .exp/ (this tree + pairs/one-switch.patch)
          pp=$PWD/.exp:$PYTHONPATH; run="$HERE/pairs.py one_gpu_documents"
          case $v in base*) pp=$PYTHONPATH; run="-m benchmarks.one_gpu_documents" ;; esac
          echo "== $v $(date +%T)"
          PYTHONPATH=$pp VARIANT=${v%%[0-9]*} timeout ${AB_S:-110} python3 $run --out $R/ab-$v \
            --mixes ${MIXES:-short,few-long} 2>&1 | grep -v "^I1\|^W1" | tail -n 14
        done ;;
    abprof) for v in $VARIANTS; do  # where each variant's step goes (mesh_profile_jax, one-device mesh)
          pp=$PWD/.exp:$PYTHONPATH; run="$HERE/pairs.py mesh_profile_jax"
          case $v in base*) pp=$PYTHONPATH; run="benchmarks/mesh_profile_jax.py" ;; esac
          echo "== $v $(date +%T)"
          PYTHONPATH=$pp VARIANT=${v%%[0-9]*} MIXES=${PROF_MIXES:-short} PATHS=ring-r1:contiguous SEQ=32768 \
            OUT=$R/prof-$v timeout ${PROF_S:-120} python3 $run 2>&1 | grep -v "^I1\|^W1\|^I0\|^W0" | tail -n 6
        done ;;
    var) for v in $VARIANTS; do
           flags=${XLA_FLAGS:-}; name=$v  # (XLA reads a blank XLA_FLAGS as a file name: set only when non-empty)
           case $v in cond:*) flags="$flags --xla_gpu_enable_command_buffer=+CONDITIONAL"; name=${v#cond:} ;;
             nocb:*) flags="$flags --xla_gpu_enable_command_buffer="; name=${v#nocb:} ;;
             nocc:*) flags="$flags --xla_gpu_enable_command_buffer=-CUSTOM_CALL"; name=${v#nocc:} ;; esac
           ${flags:+env XLA_FLAGS="$flags"} env VARIANT=$name timeout ${VAR_S:-150} python3 \
             docs/gpu/documents-2026-11-29-h200/variants.py --out $R/var-${v//[:,]/-} --mixes ${MIXES:-short,few-long} \
             2>&1 | grep -v "^I1\|^W1" | tail -n 12
         done ;;
  esac
done
[ -n "${OUT:-}" ] && (cd $R && tar czf $OUT/results-$TAG.tgz --exclude=jax-cache .)
