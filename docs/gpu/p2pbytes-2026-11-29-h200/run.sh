#!/bin/bash
# Issue 48: why the JAX twin's zigzag step sent 0.6-0.7 of the model's p2p bytes on 2x H200
# (docs/gpu/llamajax-2026-11-29-h200x2.md), on ONE GPU: the step at 2k tokens compiled (never run) for
# 2 and 4 GPUs mocked on it (MOCK=1: jax_mock_gpu_topology), each permute's whole shape and the
# compiled / lowered byte differences (permutes.py); with DUMP=1 first, every XLA pass of the FA3 step
# dumped and read in order (passes.py) to name the pass that changes the sends. Results in $OUT/p2p.
# GEMM autotuning off (it picks kernels, not collectives; under a mocked topology it shares its
# results between the mocked processes and waited past 240 s in the first call).
#   bash docs/gpu/p2pbytes-2026-11-29-h200/run.sh            # on the GPU (.whl carried)
#   SMOKE=1 bash docs/gpu/p2pbytes-2026-11-29-h200/run.sh    # here: CPU, simulated devices, 64 tokens
HERE=docs/gpu/p2pbytes-2026-11-29-h200; PROBE=docs/gpu/llamajax-2026-11-29-h200x2/permutes.py
R=${R:-${OUT:-/tmp}/p2p}; mkdir -p $R; S=${S:-100}
if [ "${SMOKE:-0}" = 1 ]; then
  export XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=$PWD; T=64; MOCK=0; FAST=reference
else
  . docs/gpu/install-wheels.sh $R; T=2048; MOCK=1; FAST=auto
  export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_shard_autotuning=false"
fi
probe() {  # NAME ROWS DEVICES BACKEND [extra env]
  local name=$1 rows=$2 dev=$3 backend=$4; shift 4
  env "$@" MOCK=$MOCK ROWS=$rows HLO_DIR=$R/hlo timeout $S python3 $PROBE $T $dev $backend > $R/$name.txt 2>&1
  echo "$name rc=$?" >> $R/rc.txt
}
if [ "${DUMP:-1}" = 1 ]; then
  rm -rf /tmp/xla-dump
  probe dumped 1 2 $FAST -u JAX_COMPILATION_CACHE_DIR XLA_FLAGS="$XLA_FLAGS --xla_dump_to=/tmp/xla-dump --xla_dump_hlo_pass_re=.*"
  python3 $HERE/passes.py /tmp/xla-dump > $R/passes.txt 2>&1
  mkdir -p $R/hlo; for f in $(ls /tmp/xla-dump | grep jit_step | grep -E "before_optimizations.txt|after_collective-quantizer|_after_optimizations.txt"); do
    gzip -c /tmp/xla-dump/$f > $R/hlo/$f.gz; done  # the step as lowered, after the pass, as it runs
fi
probe reference 1 2 reference
probe rows4 4 2 $FAST
probe devices4 1 4 $FAST
gzip -f $R/hlo/*.txt 2>/dev/null
cat $R/rc.txt; for f in dumped reference rows4 devices4; do grep -E "^(==| whole| lowered)" $R/$f.txt | cut -c1-500; done
cut -c1-400 $R/passes.txt | tail -n 25
