#!/usr/bin/env bash
# Issue 51: ringbridge in MagiAttention's published 8×H100 varlen setting — 8k tokens per GPU,
# GQA 64 : 8, head_dim 128, bf16, causal packed documents capped at a quarter of the tokens (the
# driver's `quarter-capped` mix: lognormal(log 1024, 1.5) lengths, seed 51), forward alone and
# forward + backward (the slowest rank's), every strategy family and the chooser's pick (all-gather
# KV on the per-document hybrid with the shared prefix), each path verified on the mesh first,
# each framework's varlen anchor on one GPU of the same machine in the same run; then the table of
# forward / backward / both beside MagiAttention's figures (python -m benchmarks.magi).
#   GPUS=8 (nvidia-h100-x8: the comparison)   GPUS=4 (nvidia-h100-x4: the same 8k per GPU)
#   ONLY=jax | torch   one framework per device call (each ≤ 10 min); carry .whl (flash_attn3_jax);
#   MESHES=a,b         a part of the meshes per call: on 4x H200 (2026-11-27) JAX's 8 verified paths
#                      and 3 anchors alone took 6.5 minutes, so the four meshes need two calls
#                      (MESHES=ring-r4,ring-agkv-r4 then MESHES=usp-r2xu2,ulysses-u4 with GPUS=4);
#   for torch's FA4 blocks and anchor first stash .fa4a (/root/keep, as docs/gpu/x4-runlist.sh
#   says) and carry .fa4b in the torch call.
set -eu
GPUS=${GPUS:-8}; ONLY=${ONLY:-jax}; SEQ=$((8192 * GPUS))
# the results' name says which card ran them (nvidia-h100-x4 may come as H200s; the published
# figures are H100's, so an H200 row is no like-for-like comparison)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]\{3\}' || true)
CARD=$(echo "${CARD:-gpu}" | tr 'A-Z' 'a-z'); MACHINE=${CARD}x$GPUS-magi-$ONLY
case $GPUS in
  8) ALL=ring-r8,ring-agkv-r8,usp-r2xu4,ulysses-u8 ;;
  4) ALL=ring-r4,ring-agkv-r4,usp-r2xu2,ulysses-u4 ;;
  *) echo "GPUS must be 8 or 4" >&2; exit 2 ;;
esac
MESHES=${MESHES:-$ALL}
# a part of the meshes has names of its own: two calls' results never overwrite each other
[ "$MESHES" = "$ALL" ] || MACHINE=$MACHINE-${MESHES//,/_}
. docs/gpu/install-wheels.sh ${OUT:-/tmp}
python3 -m benchmarks --gpus $GPUS --seqs $SEQ --documents quarter-capped --heads 64 --kv-heads 8 --passes both \
  --layout zigzag,document-hybrid,document-hybrid-shared --meshes $MESHES --iters 10 --warmup 3 \
  --machine $MACHINE --only $ONLY --parts-dir ${OUT:-/tmp}/$MACHINE
python3 -m benchmarks.magi benchmarks/results/$(date +%F)-$MACHINE.json | tee ${OUT:-/tmp}/$MACHINE-table.md
cp benchmarks/results/$(date +%F)-$MACHINE.* ${OUT:-/tmp}/ 2>/dev/null || true
