#!/usr/bin/env bash
# The one-GPU session of issue 35, second round (nvidia-h100-x1, 2026-11-25): block checks of the
# new paths (JAX fa3 on a window band, fa3_varlen's boundary form and length ladder, torch
# aten_varlen's in-place runs, aten_window's static offset), the same-run anchors at 32k and 128k,
# then the default path's replay rows — one device at 32k, every device of R 8 at 128k — for
# packed documents (zigzag) and window (4096, 0) (contiguous). Each step has its own limit, so a
# slow compilation cuts that step only. Started in the background by benchmarks/device_run.sh's
# pattern: `bash docs/gpu/masked-2026-11-25-h100/2026-11-25-h100-masked.sh start`, then `... wait SECONDS`.
set -u
LOG=/tmp/ringbridge-session
if [ "${1:-}" = start ]; then
  mkdir -p $LOG
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  date +%s > $LOG/started
  PYTHONPATH=/tmp/site:$PWD setsid nohup bash "$0" run > $LOG/session.log 2>&1 < /dev/null &
  echo $! > $LOG/pid
  set -- wait "${WAIT_S:-540}"
fi
if [ "${1:-}" = wait ]; then
  end=$((SECONDS + $2))
  while kill -0 "$(cat $LOG/pid)" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
  if kill -0 "$(cat $LOG/pid)" 2>/dev/null; then echo "STILL RUNNING"; else echo "FINISHED"; fi
  cp -r $LOG/. "$OUT/" 2>/dev/null
  cat $LOG/steps.txt 2>/dev/null
  grep -hE "verified=|anchor|_replay .*(fwd|bwd)|Error|error" $LOG/*.log 2>/dev/null | cut -c1-260 | tail -70
  exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 start|wait SECONDS"; exit 2; }
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > $LOG/gpu.txt
python -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)" >> $LOG/gpu.txt
step() {  # step NAME SECONDS COMMAND...: run with a limit, log, record the exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - start))" >> $LOG/steps.txt
  cp benchmarks/results/*2026-11-2*-h100-*1gpu* $LOG/ 2>/dev/null
}
BENCH=(python -m benchmarks --gpus 1 --kv-heads 8 --no-kernels --iters 5 --warmup 2)
step checks32k 300 python -m benchmarks.masked --seq 32768 --parts torch,jax,window,jaxwindow --out $LOG/masked32k
step docs32k 240 "${BENCH[@]}" --machine h100-docs32k-r2 --seq 32768 --documents mix --strategies ring-r1 \
  --frameworks jax,torch
step window32k 240 "${BENCH[@]}" --machine h100-window32k-r2 --seq 32768 --window 4096 --strategies ring-r1 \
  --frameworks jax,torch
step anchors128k 200 python -m benchmarks.masked --seq 131072 --parts anchors --out $LOG/anchors128k
step docs128k-torch 240 "${BENCH[@]}" --machine h100-docs128k-torch-r2 --seq 131072 --documents mix \
  --strategies zigzag-r8 --frameworks torch --replay-devices all
step window128k 360 "${BENCH[@]}" --machine h100-window128k-r2 --seq 131072 --window 4096 \
  --strategies contiguous-r8 --frameworks torch,jax --replay-devices all
step docs128k-jax 420 "${BENCH[@]}" --machine h100-docs128k-jax-r2 --seq 131072 --documents mix \
  --strategies zigzag-r8 --frameworks jax --replay-devices all
echo done >> $LOG/steps.txt
