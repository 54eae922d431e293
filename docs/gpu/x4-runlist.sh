#!/usr/bin/env bash
# One 4-GPU hold (nvidia-h100-x4, or the H200s it may come as), issues 46 / 47 / 48 / 51 in priority
# order; each part writes its rows as it goes, a part that fails leaves the next to run:
#   call 1 (carry .fa4a):         mkdir -p /root/keep && cp .fa4a/* /root/keep/
#   call 2 (carry .fa4b):         PARTS=... SIDES=torch WAIT_S=520 bash docs/gpu/x4-runlist.sh start
#   then (carry .whl):            PARTS=... SIDES=jax WAIT_S=550 bash docs/gpu/x4-runlist.sh start
# (.fa4b and .whl together with the project passed 64 MiB on 2026-11-29: call 2 carries .fa4b alone and runs torch's
# parts, which need only FA4; JAX's parts then carry .whl, FA4 staying installed on the held machine.)
#   or, if the machine is held:   bash docs/gpu/x4-runlist.sh wait
# Choose each `start`'s PARTS to finish within its own call: on 11-26 and again on 11-27 the hold
# was given back between two calls issued back to back (the returned files' transfer counts toward
# the 30 s idle limit), and the background job went with it (`wait` on a fresh machine says so
# at once). Measured part times on 4x H200: torchprof 4 min, d128 torch 2.4 min / JAX 5 min (with
# compiles), jaxprof 6 min, mc 1 min; llama: ≈ 3 min a strategy (its check at 1024 tokens against
# float64 on the host's CPU, exposure and host-floor steps, a 32k and a 64k row: 2026-11-27,
# weight units) — the sweep needs a call of its own; llamajax: calibration and the first check
# 4 min, then its exposure step (compile with autotuning + XLA trace) over 5 min — one strategy a
# call; magi4 JAX: 8 verified paths and 3 anchors 6.5 min — two calls (MAGI_MESHES, below).
# 2026-11-27 (second machine): d128 JAX 6 min (the hybrid now compiles 26-30 s a path), jaxprof
# 6.6 min, tp JAX 3.6 min (≈ 22 s a size: compile with autotuning) / torch 0.6 min, weak both
# sides 2.5 min, llama one strategy with its B* sweep 3 min. 2026-11-27 (third machine, 10:06):
# jaxprof 7 min (the zigzag ring with documents compiles 158 s), d128 JAX 5 min, tp both sides
# 4.7 min, win + strong both sides 3 min, m1 JAX 5.5 min (torch's rows then 2 min more; its
# context_parallel row did not finish inside the call: give m1 torch a call of its own).
# 2026-11-27 (fourth machine, 12:43): groups 11 min (both settings with compiles: `start` 560 s,
# then `wait`), u128 both sides 2.1 min, u128mha both sides 2.2 min, winprof 3.6 min, jaxprof47 1.1
# min, prof47 over 6.8 min (four of its five strategies: give it 8 min or split PATHS).
# 2026-11-27 (fifth machine, 15:40): win both sides 2.1 min, winprof 4.6, cond 1.4, gqa 0.3, jaxprof
# with RINGBRIDGE_BACKWARD_GROUPS=2 9.5 min (`start` 570 s, then `wait`), prof47 with
# P47=ring-agkv-r4:zigzag 2.7 min, magi4 JAX with MAGI_MESHES=ring-agkv-r4 4.3 min.
# 2026-11-27 (sixth and seventh machines, 18:17 / 18:26): margin 3.2 min (the part since removed with the knob: no gain), prio 2.2, u128 torch 1.1 (1.7 with FA4), win torch 1.3,
# d128 torch 2 (FA4), magi4 torch four meshes 2.7 (FA4), magi4 JAX usp + ulysses 7.9 (compiles), tp JAX over 4 min
# (8 of its 9 sizes before the hold ran out).
# 2026-11-27 (eighth machine, 20:56): tier 1.8 min (11 checks), u128 torch 1.75 (FA4 blocks), win torch 1.45, d128 torch 1.8,
# u128mha torch 2.0, tp torch 0.6, magi4 JAX ring-r4 9.3 (compiles), torchprof 4, strong torch 1.8, weak torch > 2 (ceilings only).
# 2026-11-28 (2x H200, GPUS=2, 32k tokens a GPU): tier 2.75 min (FA4's first compiles), win both sides 3.1, u128 both
# sides 2.7, winprof 3.4, weak torch 2.7 / JAX 0.7, torchprof 6.6. Second 2x H200 hold (04:01): win torch twice 3.1,
# winprof torch 2; llamajax on both GPUs: check 3.4, exposure 5 (its compile 291 s), floor 1.3, the 32k row over 7.
# 2026-11-28 (2x H200, 11:59): llamajax with --xla-gemm cublas: check 2.7 min, exposure step 4.8 (its compile 277 s:
# cuBLAS GEMMs saved 14 s of it on two GPUs), floor 1.2, the 32k row over 10 min (then its tuned step and two untuned
# compiles for the per-pass bytes, each over 120 s on two GPUs; now one: GPU_TRAFFIC_SCOPE). Run jaxcompile first.
# 2026-11-28 (4x H200, 14:27): wingroups both sides 8.9 min (six driver runs), condwin 1.4, d128 torch 2 / JAX over 8
# (its per-row paths compile; few-long's last three rows lost with the hold). 2x H200: jaxcompile 4.7 min (the 8k step
# compiles in 242 s with ids, 5.5 s without). WAIT_S counts from the script's start (install included): call 2 with
# FA4's install needs WAIT_S <= 520 to return inside the call's 600 s.
# Since then llama / llamajax rows pass no segment ids (one document a row; LLAMA / LLAMAJAX "... --segment-ids" for
# the old program). Since 2026-11-28 evening JAX's backward length bound is a switch around the kernel call
# (docs/decisions.md): its document paths' programs shrink 2-4x on the CPU (benchmarks/results/2026-11-28-cpu-program-
# size.md) — time d128 JAX (D128_MIXES=short,heavy-tail then few-long if a call is short) and jaxcompile against 11-28's.
# 2026-11-28 (4x H200, 20:10): d128 JAX short + heavy-tail 4.8 min, few-long 2.5, jaxcompile on 4 GPUs 3.8 (ids 186 s, no ids 7 s),
# d128host (FA4) 3.6, torchprof 4.5; a jaxprof of the short mix's shared prefix alone 1.1. A hold given back between the
# .fa4a call and the next (30 s idle) loses the stash: issue the second call at once. The parts folders now name the mixes
# (D128_MIXES), so a second d128 share on a held machine no longer finds the first's folder and refuses.
# 2026-11-29 (1x H200 only; docs/gpu/documents-2026-11-29-h200.md): XLA's device-side conditionals did not help JAX's
# whole-sequence document step on one GPU (6.15 against 5.98 ms) — conddoc asks the same on the mesh; a causal block's
# varlen form changed (Ulysses' and USP's diagonal blocks): the u4 / USP document rows are worth a re-time.
# 2026-11-29 (second session, 1x H200): a device's own document block on fa3_varlen now has one run-time switch a pass
# (BlockBackend.one_run_documents): the 32k short mix on one GPU 5.92 -> 5.58 ms (0.879 -> 0.910 of flash_mha_varlen).
# Every strategy's step-0 block changed with it, so the d128 rows (Ulysses and USP above all) need re-timing, and the GPU
# tier (-k "fa3_varlen or cudnn_varlen or own_document", the replay) should run first in the next hold.
# 2026-11-29 (third session, 1x H200): torch_impl on one GPU is host-bound on the short mix (0.80-0.85 of FA4's own
# varlen call; the GPU idles ~2 ms a step waiting for the host: docs/gpu/documents-2026-11-29-h200.md section 5), so
# torchprofhost now records where each rank's GPU waits and on which host call (STACKS=1).
# 2026-11-29 (fourth session, 1x H200, CPU after): JAX unchanged (one slots x bound switch measured slower, not kept).
# torch's host plan for a new batch is 2.5-3x cheaper (seqplan: spans_shards per run, prefix_runs without ranking), and
# the torch documents rows never paid it (ids repeat, plans cached): d128fresh times them with and without it,
# about as long as d128host (3.6 min), not yet run.
# 2026-11-29 (eighth session, 2x H200): llamaprof (B = 1, 4, 16 of 1k) 1.5 min; llamajax zigzag 1k sweep to B = 128
# 3.8 min; zigzag 1k sweep to 64 plus a 32k row 3.2; ulysses + allgather (32k rows, ulysses' sweep) 4.4; torch's llama
# 1k sweep to 128 (NO_FA4=1) 4.1. The twin's prediction now adds its fixed cost (llama_scale.FIXED_COST_ADDS): the next
# 4-GPU llamajax rows test it there (docs/gpu/llamajax-profile-2026-11-29-h200x2.md).
# 2026-11-29 (ninth session, 4x H200, docs/gpu/documents-2026-11-29-evening-h200x4.md): d128 torch 2.9 min (FA4 installed
# in the same call), d128 JAX short + heavy-tail 3.8, torchprofhost 5.2, jaxprof 3.8, u128 both sides 3.6 + win both sides
# 5 (one call, 536 s). After it (CPU): JAX's shared-prefix local part reads its own keys in place (runs.own_key_plans: two
# fewer sorts a step, no packed keys) — first d128 JAX with D128_MIXES=short,heavy-tail then few-long, then mcdoc (one
# process a GPU: is the short mix's idle the one host driving four GPUs?), then jaxprof to see the gaps move.
# 2026-11-29 (tenth session, CPU only: no device time left): torch's shared prefix now issues the prefixes' gather before
# its plans, and a host_ids block keeps its plans (no CRC-32 a call) — after the JAX parts above, d128host (both torch
# rows, host ids off then on) and torchprofhost (do the 1.8-2.2 ms waits before the gather shrink?).
# Parts (PARTS selects, in the order given; d512k ran 2026-11-26):
#   torchprof  issue 46: torch_impl all-gather KV on the hybrid, whole gather and shared prefix,
#              short and heavy-tail, profiled (device kernels by kind, the synchronising calls,
#              a cProfile of the host side)
#   d128host   issue 46: torch's d128 rows twice, RINGBRIDGE_HOST_IDS=0 then 1 (the ids on the host: torch_impl.host_ids)
#   d128fresh  issue 46: this host's plan for a new batch (benchmarks.plan_time, seconds), then torch's d128 rows
#              twice, RINGBRIDGE_FRESH_PLANS=0 then 1 (every step's host plans made anew, as for a new batch: what
#              the repeated ids hide from the default rows)
#   d128       issue 46: 128k tokens, the three balance mixes, both frameworks: all-gather KV and
#              USP-all-gather on the hybrid, whole gather and shared prefix, anchors beside
#   jaxprof    issue 46: jax_impl's kernels / NCCL / idle per GPU on the same mixes, and per GPU what the host did
#              in the idle gaps and XLA's per-execution phases (the rows' "host": benchmarks.host_gaps)
#   torchprofhost issue 46: torch's short-mix shared-prefix step profiled with the ids on the device, then on the host,
#              each with every rank's GPU idle gaps and the host call behind each (STACKS=1: benchmarks/trace_gaps.py)
#   conddoc    issue 46: JAX's short-mix shared-prefix row, XLA's conditionals on the host (default) then on the device
#              — retired 2026-11-29: the flag moves no conditional whose branches hold FFI calls (all of these;
#              docs/gpu/host-gaps-2026-11-29-h200.md §3), so both rows run the same program
#   groups     issue 46: JAX, the shared-prefix paths on the three mixes with the one call's backward
#              as one call (RINGBRIDGE_BACKWARD_GROUPS=1, the default) then in two groups (2), side by side
#   llama      issue 48: the whole model on 4 GPUs (torch; LLAMA overrides the arguments, e.g.
#              "--strategies allgather,usp --seq 32768,65536 --batches 1"): rows at 32k and 64k,
#              predicted vs measured, each row's and the host floor's cProfile, and a B* sweep at
#              16k-token rows (predicted B* between 2 and 8: docs/gpu/llama-scale-2026-11-27-h200x4.md)
#   llamajax   issue 48: the same rows in JAX (llama_jax.Step on the mesh, one process for every GPU;
#              LLAMAJAX overrides the arguments)
#   llamaprof  issue 48: the JAX twin's zigzag step at 1k-token rows traced at B = 1, 4, 16 (LLAMAPROF overrides):
#              per GPU the kernel time by kind (GEMM, attention, NCCL, XLA's other kernels), exposed NCCL, idle
#              time, and the host in the gaps (benchmarks/llama_profile_jax.py); ≈ 2 min on 2 GPUs
#   p2pbytes   issue 48: the JAX twin's zigzag step at 2k tokens compiled (not run) over every GPU, FA3 then the
#              portable kernel: each collective-permute's whole shape, the compiled / lowered / unquantized counts
#              against the model (answered on mocked GPUs: docs/gpu/p2pbytes-2026-11-29-h200.md; on real ones
#              it confirms it); ≈ 1 min
#   jaxcompile issue 48: where the JAX twin's multi-GPU compile goes — its step at 8k tokens over every GPU, compiled
#              untuned, XLA's per-pass timers and the program's size (benchmarks/jax_compile_probe.py --pass-times),
#              with the rows' segment ids and then without (the same mask on the plain kernels); ≈ 5 min on 2 GPUs
#   tp         issue 48: the FSDP 2 x TP 2 B* sweep, each side (parity.capacity.tp_sweep: the FFN step
#              checked, then timed at 64 … 16384 tokens per device beside the closed form's B*)
#   magi4      issue 51: MagiAttention's setting at 8k tokens per GPU on 4 GPUs, JAX then torch
#   mc         issue 47: JAX one process per GPU vs one for all, 128k, ring 4 and Ulysses 4
#   nocub      issue 46: JAX's short-mix shared-prefix row (all-gather R 4) with the default sorts, then with XLA's own
#              sort kernels for every sort (--xla_gpu_enable_cub_radix_sort=false), same call
#   mcdoc      issue 46: JAX's short and heavy-tail shared-prefix rows (all-gather R 4), one process for every GPU
#              then one a GPU, same call (is the short mix's idle the one host driving four GPUs?)
#   prof47     issue 47: torch_impl's five strategies at 128k, no documents, profiled per rank (kernels by
#              kind, NCCL, copies, the host's syncs and cProfile), each checked at 4096 tokens first
#   jaxprof47  issue 47: the same in jax_impl (XLA trace per GPU: attention / NCCL / other, exposed share)
#   cond       issue 47: JAX's zigzag rings at 128k with XLA's conditionals kept on the device
#              (--xla_gpu_enable_command_buffer=+CONDITIONAL) beside the default, same call — meaningful only where
#              the branches' kernels may be recorded into a CUDA graph (XLA's cuDNN calls); a branch holding an FA3
#              FFI call keeps its conditional on the host (docs/gpu/host-gaps-2026-11-29-h200.md §3)
#   prio       issue 47: torch's three rings at 128k, NCCL on a normal then a high-priority stream
#   tier       issues 46 / 47: the one-GPU tier's fa4 and window checks (FA4's dense, window and varlen entries)
#   gqa        issue 47: do aten_cudnn / aten_flash take GQA K/V as they are (checked against float32,
#              then timed at 32k against the expansion); one GPU (benchmarks/gqa_probe.py)
#   u128       issue 47: 128k, the five strategies, GQA 32 / 8, each side, the single-GPU ceiling at 32k beside
#   u128mha    issue 47: the same with MHA (32 / 32), beside torch context_parallel
#   winprof    issue 47: the window (4096, 0) rows (ring 4, USP 2x2, contiguous) profiled, JAX then torch
#   strong     issue 47: strong scaling, 32k tokens over 4 GPUs, four strategies, the ceiling at 8k
#   m1         issue 47: 1M tokens over 4 GPUs, USP 2x2 and ring 4, peak memory, the ceiling at 256k
#   win        issue 47: window (4096, 0) at 128k, ring 4 and USP 2x2, over each framework's window anchor
#   wingroups  issue 47: USP 2x2 under the window with head_groups 1, 2, 4 (RINGBRIDGE_HEAD_GROUPS), each side
#   condwin    issue 47: JAX's window rows with XLA's conditionals on the device beside the default
#   weak       issue 47: weak scaling, 32k tokens per GPU, a ring over 1, 2, 4 GPUs (torch: a
#              torchrun world per ring size), the single-GPU ceiling at 32k in the same run
#   d512k      issue 46: 512k tokens, heavy-tail, both frameworks — the API's default (static
#              zigzag ring) and the chooser's pick (all-gather KV, per-document hybrid)
# KEEP_JAX_CACHE=1 wait: the machine's JAX compilation cache (/tmp/jax-cache: every program compiled so far,
# GEMM tuning included) comes back as $OUT/jaxcache.tgz.00, .01, ... (15 MiB parts; skipped over 28 MiB: with .whl and the project it must fit the 64-MiB tree). Copied into
# .jaxcache/ here and carried, the next `start` on a fresh machine of the same kind unpacks it first, so a hold given
# back between calls (2026-11-28: the JAX twin's 277-s compiles lost with it) does not compile everything again.
# Tried on one H200 (2026-11-29, docs/gpu/determinism-2026-11-29-h200.md): a fresh machine took all 19 entries of
# another's cache (the twin's 2k step: 9.9 s compile -> 1.1 s, nothing new written).
# SMOKE=1 start: every part's CPU path at toy sizes (no wheels, no GPU). Results under $OUT/runlist.tgz.
# GPUS=2 (a two-GPU hold, 2026-11-28): tier, u128, win, winprof, weak and torchprof at 32k tokens per GPU on the
# two-GPU meshes (ring 2, Ulysses 2, all-gather KV 2) — the same per-GPU shapes as the 4-GPU rows; llama and llamajax
# over both GPUs. winprof profiles the sides SIDES names (default both, JAX first).
set -u
. docs/gpu/background.sh
GPUS=${GPUS:-4}
if [ "$GPUS" = 2 ]; then U_MESHES=ring-r2,ulysses-u2,ring-agkv-r2; W_MESHES=ring-r2; PW=ring-r2:contiguous
else U_MESHES=ring-r4,ulysses-u4,usp-r2xu2,double_ring-ro2xri2,ring-agkv-r4; W_MESHES=ring-r4,usp-r2xu2
  PW=ring-r4:contiguous,usp-r2xu2:contiguous; fi
R=/tmp/rb-x4; LOG=$R/run.log; HERE=docs/gpu; DEST=${OUT:-}  # the device call's $OUT (the parts get $R)
PARTS=${PARTS:-llama,llamajax,torchprof,d128,jaxprof,magi4,mc}
if [ "$1" = start ]; then
  if [ "$GPUS" != 4 ]; then  # the other parts name 4-GPU meshes: refused rather than run on a mesh that is not there
    for part in ${PARTS//,/ }; do
      case $part in tier|u128|u128mha|win|winprof|wingroups|condwin|weak|torchprof|llama|llamajax|jaxcompile|p2pbytes|llamaprof) ;;  # llama*: every GPU there is
        *) echo "GPUS=$GPUS: part $part has only its 4-GPU form (tier, u128, u128mha, win, winprof, wingroups, condwin, weak, torchprof, llama, llamajax, llamaprof, jaxcompile, p2pbytes do)"; exit 2 ;;
      esac
    done
  fi
  mkdir -p $R
  # a smoke run's own tables are removed at the end; untracked results that were here before it are kept
  git ls-files --others --exclude-standard -- benchmarks/results | sort > $R/untracked-before
  if [ "${SMOKE:-0}" != 1 ]; then
    . docs/gpu/install-wheels.sh $R
    if ls .jaxcache/jaxcache.tgz.* > /dev/null 2>&1; then  # a carried cache (KEEP_JAX_CACHE, above)
      mkdir -p "$JAX_COMPILATION_CACHE_DIR" && cat .jaxcache/jaxcache.tgz.* | tar xzf - -C "$JAX_COMPILATION_CACHE_DIR" \
        && echo "JAX cache carried in: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries" >> $R/notes.txt
    fi
    # torch's rows and anchors are measured against FA4 (issue 46: the anchor is the faster of FA2 and FA4); a
    # fresh machine (the hold given back between calls) has none, and its torch rows would time FA2 — on
    # 2026-11-28 a d128 call did, 85 device seconds. Refused unless NO_FA4=1 says FA2 is what is wanted.
    case " ${SIDES:-torch jax} " in *" torch "*)
      if [ "${NO_FA4:-0}" != 1 ] && ! PYTHONPATH=$PYTHONPATH python3 -c "import flash_attn.cute.interface" 2>/dev/null; then
        for part in ${PARTS//,/ }; do case $part in groups|jaxprof|jaxprof47|cond|condwin|conddoc|mc|mcdoc|nocub|llamajax|jaxcompile|p2pbytes|gqa) ;;
          *) echo "FA4 is not installed on this machine (a fresh one?): torch's rows would run on FA2. Run the .fa4a stash and a" \
               "call with .fa4b first, or set SIDES=jax, or NO_FA4=1 to time FA2 on purpose."; exit 3 ;; esac; done
      fi ;;
    esac
    SEQ=$((32768 * GPUS)); BIG=524288; HUGE=1048576; DEV=gpu; TORCHRUN="torchrun --nproc_per_node $GPUS"
    LLAMA=${LLAMA:-"--strategies zigzag,ulysses --seq 32768,65536 --bstar-seq 16384 --exposure-seq 8192 --batches 1,2,4,8"}
    # --xla-gemm cublas: Triton GEMMs off, cuBLAS's algorithms still autotuned. The rows pass no segment ids since
    # 2026-11-28, and without them the 2-GPU step compiles in 5.5 s instead of 242 s (docs/gpu/documents-window-
    # 2026-11-28-h200x4.md): the JAX rows are torch's (LLAMA) now, both strategies — a `start` and a `wait` call
    # The B* sweep at 1k-token rows: on 2x H200 (2026-11-29) the twin's host floor was 9-11 ms and a 16k row 47 ms, so
    # at 16k its predicted B* was 0.2 rows; at 1k, T_math ≈ 3 ms + 2.4 ms a row puts the floor near 3 rows (the issue
    # asks for 2-8). The JAX rows took 2.3 min (zigzag) and 3.7 (both strategies, one 32k row each) on two GPUs.
    # At 1k on 2x H200 (2026-11-29 evening: docs/gpu/llamajax-sweep-2026-11-29-h200x2.md) time per row still fell
    # at B = 32 (16.8 GiB a GPU; the sweep's edge was the knee): the sweep goes on to 128 rows.
    # B = 128 ran out of memory on 2x H200 (a 55.9 GiB allocation; B = 64 peaked at 31 GiB a GPU): the sweep stops at 64
    LLAMAJAX=${LLAMAJAX:-"--strategies zigzag,ulysses --seq 32768,65536 --bstar-seq 1024 --exposure-seq 8192 --batches 1,2,4,8,16,32,64 --xla-gemm cublas"}
    DRV="--heads 32 --kv-heads 8 --passes fwd+bwd"; SIDES=${SIDES:-torch jax}; TPSWEEP=""
  else
    export PYTHONPATH=$PWD JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 SMOKE_FLAG=--smoke
    SEQ=4096; BIG=2048; HUGE=4096; DEV=cpu; TORCHRUN="torchrun --nproc_per_node $GPUS"; LLAMA="--small --world 2"; LLAMAJAX=$LLAMA
    DRV="--heads 4 --kv-heads 2 --passes fwd+bwd --no-verify"; SIDES=jax  # torch's driver side needs GPUs
    TPSWEEP=--small
  fi
  export PYTHONUNBUFFERED=1 OUT=$R
  S=${SMOKE_FLAG:-}
  declare -A CMD
  CMD[torchprof]="MIXES=short,heavy-tail LAYOUTS=document-hybrid,document-hybrid-shared SEQ=$SEQ $TORCHRUN benchmarks/mesh_profile_torch.py $S"
  # the API's default (the static zigzag ring), then the chooser's pick: all-gather KV on the hybrid
  # with the shared prefix (docs/decisions.md; 11-26 ran torch's pick with the whole gather)
  D512="python3 -m benchmarks --gpus 4 --seqs $BIG --documents heavy-tail $DRV --iters 3 --warmup 1"
  CMD[d512k]="for side in $SIDES; do
    $D512 --meshes ring-r4 --layout zigzag --machine x${GPUS}-512k-ring-\$side --only \$side --parts-dir $R/d512k-ring-\$side;
    $D512 --meshes ring-agkv-r4 --layout document-hybrid-shared --machine x${GPUS}-512k-pick-\$side --only \$side --parts-dir $R/d512k-pick-\$side; done"
  MIX3=${D128_MIXES:-short,heavy-tail,few-long}; [ "${SMOKE:-0}" = 1 ] && MIX3=short  # D128_MIXES: a call's share
  MIXTAG=${MIX3//,/+}  # the parts folders name their mixes: a second call's share on a held machine gets its own folder
  D128="python3 -m benchmarks --gpus 4 --seqs $SEQ --documents $MIX3 $DRV --iters 5 --warmup 2 \
    --layout document-hybrid,document-hybrid-shared --meshes ring-agkv-r4,usp-agkv-r2xu2"
  CMD[d128]="for side in $SIDES; do $D128 --machine x${GPUS}-documents-\$side --only \$side --parts-dir $R/d128-\$side-$MIXTAG; done"
  # torch's document rows without then with the batch's ids on the host (torch_impl.host_ids: no copy of the gathered
  # ids off the GPU a call; every row and its check in the same block), same call: the short mix waited at that copy
  CMD[d128host]="for h in 0 1; do RINGBRIDGE_HOST_IDS=\$h $D128 --machine x${GPUS}-documents-torch-hostids\$h --only torch \
    --parts-dir $R/d128host\$h-$MIXTAG; done"
  # torch's d128 rows with the host's plans kept (the ids repeat every step: cached by content), then forgotten
  # before every step (a training step with new ids plans on every rank; 2.2 to 4.5 ms a device a step on a 2-core host)
  CMD[d128fresh]="python3 -m benchmarks.plan_time --out $R/plan-time; for f in 0 1; do RINGBRIDGE_FRESH_PLANS=\$f $D128 --machine x${GPUS}-documents-torch-fresh\$f --only torch \
    --parts-dir $R/d128fresh\$f-$MIXTAG; done"
  # torch's short-mix step profiled without then with the ids on the host (run 14: the host ids slower on this mix,
  # 7.41 -> 8.73 ms, not yet profiled), same call
  CMD[torchprofhost]="for h in 0 1; do STACKS=1 RINGBRIDGE_HOST_IDS=\$h MIXES=short LAYOUTS=document-hybrid-shared SEQ=$SEQ \
    $TORCHRUN benchmarks/mesh_profile_torch.py $S; done"
  # JAX's documents rows with XLA's conditionals on the device beside the default, same call: run 14's profile has
  # every GPU idle 0.5-1.3 ms three times a step just after the prefixes' all-gather, where a conditional follows
  CD="python3 -m benchmarks --gpus 4 --only jax --seqs $SEQ --documents short $DRV --iters 5 --warmup 2 \
    --layout document-hybrid-shared --meshes ring-agkv-r4"
  CMD[conddoc]="$CD --machine x${GPUS}-conddoc-host-jax --parts-dir $R/conddoc-host-jax;
    XLA_FLAGS=\"\${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+CONDITIONAL\" $CD --machine x${GPUS}-conddoc-device-jax \
    --parts-dir $R/conddoc-device-jax"
  # JAX's one-call backward as one call, then in two groups of runs (jax_impl/kernels/groups.py), same call
  G46="python3 -m benchmarks --gpus 4 --only jax --seqs $SEQ --documents $MIX3 $DRV --iters 5 --warmup 2 \
    --layout document-hybrid-shared --meshes ring-agkv-r4,usp-agkv-r2xu2"
  CMD[groups]="for g in 1 2; do RINGBRIDGE_BACKWARD_GROUPS=\$g $G46 --machine x${GPUS}-groups\$g-jax --parts-dir $R/groups\$g-jax-$MIXTAG; done"
  MAGI_MESHES=${MAGI_MESHES:-ring-r4,ring-agkv-r4}  # then usp-r2xu2,ulysses-u4 in a second call
  CMD[magi4]="for side in $SIDES; do GPUS=4 ONLY=\$side MESHES=$MAGI_MESHES OUT=$R bash $HERE/magi-setting.sh; done"
  CMD[llama]="python3 -m parity.capacity.llama_scale --devices $DEV --out $R/llama $LLAMA"
  CMD[tp]="for side in $SIDES; do python3 -m parity.capacity.tp_sweep --framework \$side --devices $DEV --out $R/tp $TPSWEEP; done"
  # JAX compiles every step program with GEMM autotuning (seconds per new shape): fewer rows per call
  CMD[llamajax]="python3 -m parity.capacity.llama_scale --framework jax --devices $DEV --out $R/llama-jax $LLAMAJAX"
  # the JAX twin's step traced at several B of the 1k-token sweep: which kernel kind holds the fixed cost
  LP=${LLAMAPROF:-"--seq 1024 --batches 1,4,16"}; [ "${SMOKE:-0}" = 1 ] && LP=""  # --smoke: its own toy sizes
  CMD[llamaprof]="python3 -m benchmarks.llama_profile_jax $LP $S"
  CMD[p2pbytes]="python3 $HERE/llamajax-2026-11-29-h200x2/permutes.py $(( ${SMOKE:-0} == 1 ? 64 : 2048 )) $GPUS auto \
    reference > $R/p2pbytes.txt 2>&1; grep -v '^[IW][0-9]' $R/p2pbytes.txt | cut -c1-400 | tail -n 70"
  # the step's compile alone (nothing run, nothing to check), every GPU of the hold, XLA's pass timers; its log gzipped
  # with the rows' segment ids (the program the twin ran until 2026-11-28), then without them (its rows since: the
  # same causal mask on the plain kernels); the probe's stderr is its pass log, so a failure's traceback is shown from it
  CMD[jaxcompile]="for ids in ids no-ids; do python3 -m benchmarks.jax_compile_probe --compile-only --pass-times \
    --devices $GPUS --seq $(( ${SMOKE:-0} == 1 ? 64 : 8192 )) --variants untuned --out $R/jaxcompile-\$ids $S \
    \$([ \$ids = no-ids ] && echo --no-ids) || grep -v '^I' $R/jaxcompile-\$ids/xla-passes.log | tail -n 30;
    gzip -f $R/jaxcompile-\$ids/xla-passes.log; done"
  P47=${P47:-ring-r4:zigzag,ulysses-u4:contiguous,usp-r2xu2:zigzag,double_ring-ro2xri2:zigzag,ring-agkv-r4:zigzag}
  CMD[prof47]="MIXES=none PATHS=$P47 SEQ=$SEQ $TORCHRUN benchmarks/mesh_profile_torch.py $S"
  CMD[jaxprof47]="MIXES=none PATHS=$P47 SEQ=$SEQ python3 benchmarks/mesh_profile_jax.py $S"
  # the window rows' profiles (issue 47: ring and USP at 0.65-0.79 of the window kernel), both sides
  WIN=4096; [ "${SMOKE:-0}" = 1 ] && WIN=256
  CMD[winprof]="for side in $SIDES; do case \$side in jax) P='python3 benchmarks/mesh_profile_jax.py' ;;
    torch) P='$TORCHRUN benchmarks/mesh_profile_torch.py' ;; esac; MIXES=none PATHS=$PW SEQ=$SEQ WINDOW=$WIN \$P $S; done"
  CMD[jaxprof]="MIXES=short,heavy-tail PATHS=ring-agkv-r4:document-hybrid-shared,ring-r4:zigzag SEQ=$SEQ \
    python3 benchmarks/mesh_profile_jax.py $S"
  # the rings' per-step lax.cond with its predicate on the device (XLA command-buffer conditionals)
  # against the default (the predicate copied to the host, which then waits for the GPU), same call
  C47="python3 -m benchmarks --gpus 4 --only jax --seqs $SEQ --meshes ring-r4,double_ring-ro2xri2,usp-r2xu2 $DRV \
    --ceiling-seq 0 --iters 5 --warmup 2"
  CMD[cond]="$C47 --machine x${GPUS}-cond-host-jax --parts-dir $R/cond-host-jax;
    XLA_FLAGS=\"\${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+CONDITIONAL\" $C47 --machine x${GPUS}-cond-device-jax \
    --parts-dir $R/cond-device-jax"
  MHA_KV=32; [ "${SMOKE:-0}" = 1 ] && MHA_KV=4
  # torch's NCCL kernels on a high-priority stream (TORCH_NCCL_HIGH_PRIORITY; XLA's async collectives have one
  # by default): the three rings at 128k GQA without, then with it, same call — do the hops get SMs sooner?
  P47T="python3 -m benchmarks --gpus 4 --only torch --seqs $SEQ --meshes ring-r4,double_ring-ro2xri2,usp-r2xu2 $DRV \
    --ceiling-seq 0 --iters 5 --warmup 2"
  CMD[prio]="TORCH_NCCL_HIGH_PRIORITY=0 $P47T --machine x${GPUS}-prio0-torch --parts-dir $R/prio0-torch;
    TORCH_NCCL_HIGH_PRIORITY=1 $P47T --machine x${GPUS}-prio1-torch --parts-dir $R/prio1-torch"
  # torch's fa4 on its dense entry (plain blocks, windowed blocks cropped to their band) and varlen entry, against
  # float64 / the portable kernel on one GPU before any row that routes to it is timed (FA4 installed: .fa4b)
  CMD[tier]="python3 -m pytest -q -p no:cacheprovider tests/gpu/test_one_gpu_kernels.py -k '(fa4 or window) and not flex' -rs"
  # whether torch's SDPA ops take GQA K/V unexpanded (the adapters' copies: 10 ms a ring step), checked then timed
  CMD[gqa]="python3 -m benchmarks.gqa_probe $S"
  # 128k, every strategy, GQA 32 / 8 and MHA (torch context_parallel runs MHA only); the ceiling at 32k beside
  U128="python3 -m benchmarks --gpus $GPUS --seqs $SEQ --meshes $U_MESHES \
    $DRV --ceiling-seq $((SEQ / GPUS)) --iters 5 --warmup 2"
  CMD[u128]="for side in $SIDES; do $U128 --machine x${GPUS}-$((SEQ / 1024))k-gqa-\$side --only \$side --parts-dir $R/u128-\$side; done"
  CMD[u128mha]="for side in $SIDES; do $U128 --kv-heads $MHA_KV --machine x${GPUS}-$((SEQ / 1024))k-mha-\$side --only \$side \
    --parts-dir $R/u128mha-\$side; done"
  # weak scaling at 32k tokens per GPU, a ring over 1, 2, 4 GPUs, each side; the ceiling at 32k beside
  CMD[weak]="for side in $SIDES; do python3 -m benchmarks --gpus $GPUS --only \$side --seqs '' --meshes '' \
    --weak $((SEQ / GPUS)) $DRV --ceiling-seq $((SEQ / GPUS)) --iters 5 --warmup 2 --machine x${GPUS}-weak-\$side --parts-dir $R/weak-\$side; done"
  # strong scaling: 32k tokens over 4 GPUs (8k each), four strategies; the single-GPU ceiling at 8k beside
  CMD[strong]="for side in $SIDES; do python3 -m benchmarks --gpus 4 --only \$side --seqs $((SEQ / 4)) \
    --meshes ring-r4,ulysses-u4,usp-r2xu2,ring-agkv-r4 $DRV --ceiling-seq $((SEQ / 16)) --iters 10 --warmup 3 \
    --machine x${GPUS}-strong-\$side --parts-dir $R/strong-\$side; done"
  # 1M tokens over 4 GPUs, USP 2x2 and ring 4 with their peak memory; the ceiling at 256k beside
  CMD[m1]="for side in $SIDES; do python3 -m benchmarks --gpus 4 --only \$side --seqs $HUGE --meshes usp-r2xu2,ring-r4 \
    $DRV --ceiling-seq $((HUGE / 4)) --iters 3 --warmup 1 --machine x${GPUS}-1m-\$side --parts-dir $R/m1-\$side; done"
  # a sliding window (4096, 0), contiguous, ring 4 and USP 2x2, over each framework's window anchor
  # WIN_REPEATS (default 2) runs of each side, one after the other: the window anchor moved 5 % between two
  # calls on 2026-11-28 (12.60 / 13.28 ms) while the ring's row moved 1 % — each run's ratio over its own anchor
  CMD[win]="for side in $SIDES; do for rep in \$(seq ${WIN_REPEATS:-2}); do python3 -m benchmarks --gpus $GPUS \
    --only \$side --seqs $SEQ --window 4096 --layout contiguous --meshes $W_MESHES $DRV --ceiling-seq $((SEQ / GPUS)) \
    --iters 5 --warmup 2 --machine x${GPUS}-window-\$side-run\$rep --parts-dir $R/win-\$side-run\$rep; done; done"
  # USP under the window with the Ulysses all-to-all in head groups (docs/decisions.md, "Ulysses in head
  # groups"): G = 1, 2, 4 one after the other, each side, every row checked under its own G first
  WG_MESHES=usp-r2xu2; [ "$GPUS" = 2 ] && WG_MESHES=ulysses-u2
  CMD[wingroups]="for side in $SIDES; do for g in 1 2 4; do RINGBRIDGE_HEAD_GROUPS=\$g python3 -m benchmarks --gpus $GPUS \
    --only \$side --seqs $SEQ --window $WIN --layout contiguous --meshes $WG_MESHES $DRV --ceiling-seq $((SEQ / GPUS)) \
    --iters 5 --warmup 2 --machine x${GPUS}-wingroups\$g-\$side --parts-dir $R/wingroups\$g-\$side; done; done"
  # JAX's window rows with XLA's conditionals on the device beside the default, same call: the 11-28
  # profile has the host waiting at the ring's per-step conditionals (the call returns after 14.8 of 15.9 ms)
  CW="python3 -m benchmarks --gpus $GPUS --only jax --seqs $SEQ --window $WIN --layout contiguous --meshes $W_MESHES $DRV \
    --ceiling-seq $((SEQ / GPUS)) --iters 5 --warmup 2"
  CMD[condwin]="$CW --machine x${GPUS}-condwin-host-jax --parts-dir $R/condwin-host-jax;
    XLA_FLAGS=\"\${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+CONDITIONAL\" $CW --machine x${GPUS}-condwin-device-jax \
    --parts-dir $R/condwin-device-jax"
  CMD[mc]="python3 -m benchmarks --gpus 4 --only jax --jax-multi-controller --machine x${GPUS}-mc --parts-dir $R/mc \
    --seqs $SEQ --meshes ring-r4,ulysses-u4 $DRV --ceiling-seq 0 --no-peers --iters 10 --warmup 3"
  # JAX's short and heavy-tail shared-prefix rows from one process for every GPU (the default), then one process a
  # GPU, same call: on 2026-11-29 (evening) every GPU of the one-process row idled 1.35 ms a step while the host's
  # four execute threads updated and relaunched command buffers (docs/gpu/documents-2026-11-29-evening-h200x4.md);
  # a process a GPU gives each device a host of its own. One driver run: its one-process rows (with the anchor) first.
  CMD[mcdoc]="python3 -m benchmarks --gpus 4 --only jax --jax-multi-controller --seqs $SEQ --documents short,heavy-tail \
    $DRV --iters 5 --warmup 2 --layout document-hybrid-shared --meshes ring-agkv-r4 --no-peers \
    --machine x${GPUS}-mcdoc-jax --parts-dir $R/mcdoc-jax"
  # JAX's short-mix shared-prefix row with every sort on XLA's own sort kernels (no cub radix sort: no thunk between
  # command buffers) beside the default, same call — the promise check's argsort over R·t ids is the step's one large
  # sort since the local part reads its own keys (docs/decisions.md, "A shared prefix's local part reads its own keys")
  NC="python3 -m benchmarks --gpus 4 --only jax --seqs $SEQ --documents short $DRV --iters 5 --warmup 2 \
    --layout document-hybrid-shared --meshes ring-agkv-r4"
  CMD[nocub]="$NC --machine x${GPUS}-nocub-default-jax --parts-dir $R/nocub-default-jax;
    XLA_FLAGS=\"\${XLA_FLAGS:-} --xla_gpu_enable_cub_radix_sort=false\" $NC --machine x${GPUS}-nocub-xla-jax \
    --parts-dir $R/nocub-xla-jax"
  RUNS=""
  for part in ${PARTS//,/ }; do
    [ "${SMOKE:-0}" = 1 ] && case $part in mc|mcdoc|magi4|prio|tier|conddoc) continue ;; esac  # GPUs only (mc: a process per GPU; prio: torch)
    RUNS="$RUNS echo \"== $part \$(date +%T)\"; ( ${CMD[$part]} ) > $R/$part.log 2>&1; echo \"== $part rc \$? \$(date +%T)\";"
  done
  rb_start $R "$RUNS"
  set -- wait
fi
if [ "$1" = wait ]; then
  [ -e $R/started ] || { echo "nothing started on this machine (a fresh one: the last hold was given back)"; exit 1; }
  rb_wait $R
  cp -r benchmarks/results/$(date +%F)-* $R/ 2>/dev/null
  # a CPU smoke run's tables are not results: the ones it wrote go (they would travel with the tree); untracked tables
  # from before it (a GPU run's, not yet committed) stay — on 2026-11-28 this line removed them
  [ "${SMOKE:-0}" = 1 ] && git ls-files --others --exclude-standard -- benchmarks/results | sort \
    | comm -23 - $R/untracked-before | xargs -r rm -f
  [ -n "$DEST" ] && tar czf $DEST/runlist.tgz -C $R .
  if [ "${KEEP_JAX_CACHE:-0}" = 1 ] && [ -n "$DEST" ] && [ -d "${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}" ]; then
    tar czf /tmp/jaxcache.tgz -C "${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}" .
    if [ $(stat -c %s /tmp/jaxcache.tgz) -le $((28 * 1024 * 1024)) ]; then split -b 15M -d /tmp/jaxcache.tgz $DEST/jaxcache.tgz.
    else echo "JAX cache not kept: $(stat -c %s /tmp/jaxcache.tgz) bytes (over 28 MiB: it would not travel beside .whl and the project)"; fi
  fi
  cat $LOG
  for f in $R/*.log; do echo "--- $f"; grep -E "verify|anchor|_impl |wall|rc |Error|error|predicted|measured" $f | cut -c1-240 | tail -25; done
fi
