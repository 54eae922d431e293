#!/usr/bin/env bash
# Issue 39, after review: the bf16 checks of the step model's timed path, on the path it times.
# The timed rows pass no segment ids (one document per row); the checks of the first runs passed
# ids of one document (torch: the ids' host copy around the same fused kernel; JAX: its document
# dispatch). Now both checks pass none; this reruns them alone on the GPU, JAX with GEMM
# autotuning as `time` runs it. Results: $OUT/checks.json. SMOKE=1: on the CPU.
set -u
OUT=${OUT:-/tmp/ringbridge-out}; mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ "${SMOKE:-0}" = 1 ]; then DEV=cpu; SEQ=256; else DEV=gpu; SEQ=2048; fi
python3 - "$OUT/checks.json" "$DEV" "$SEQ" <<'PY'
import json, sys
from parity.core.devices import configure_jax_devices
out, dev, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
configure_jax_devices(dev, autotune=True)
from parity.training.llama_gpu import CHECK_MODEL, check, check_jax
torch_row = check(["ring-r1"], seq, CHECK_MODEL, "auto", packed=False, device="cuda" if dev == "gpu" else "cpu")[0]
jax_row = check_jax(seq, CHECK_MODEL, "auto")
json.dump({"torch": torch_row, "jax": jax_row}, open(out, "w"), indent=1, default=str)
print("torch", torch_row["passed"], round(torch_row["worst_ratio"], 3), "jax", jax_row["passed"], round(jax_row["worst_ratio"], 3))
PY
