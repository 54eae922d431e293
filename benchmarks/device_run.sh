#!/usr/bin/env bash
# One benchmark run on a lent GPU machine that may outlast one device call (10 min): started in
# its own process session, it keeps running between calls; `wait` polls for it and copies the
# results to $OUT. Usage (from the repository root, wheels carried in .whl/):
#   bash benchmarks/device_run.sh start ARGS...   # then: bash benchmarks/device_run.sh wait SECONDS
set -u
LOG=/tmp/ringbridge-bench.log
if [ "$1" = start ]; then
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  echo "python -m benchmarks $*" > /tmp/ringbridge-bench.cmd
  PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 setsid nohup python3 -m benchmarks --parts-dir /tmp "$@" > $LOG 2>&1 < /dev/null &
  echo $! > /tmp/ringbridge-bench.pid
  shift $#; set -- wait "${WAIT_S:-560}"
fi
if [ "$1" = wait ]; then
  end=$((SECONDS + $2))
  while kill -0 "$(cat /tmp/ringbridge-bench.pid)" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
  if kill -0 "$(cat /tmp/ringbridge-bench.pid)" 2>/dev/null; then echo "STILL RUNNING"; else echo "FINISHED"; fi
  cp $LOG "$OUT/bench.log"; cp /tmp/*_rows.json "$OUT/" 2>/dev/null; find benchmarks/results -newer /tmp/ringbridge-bench.cmd -type f -exec cp {} "$OUT/" \;
  grep -E "^(jax_impl|torch_impl|torch_cp|yunchang|fa3|jax_cudnn|torch_sdpa)|done|Error|error" $LOG | tail -60
fi
