#!/usr/bin/env bash
# Issue 39 on one GPU (nvidia-h100-x1): the step-time model against the measured whole-model
# step, both frameworks — `python -m parity.training.llama_gpu time` per framework (one process
# each: the bf16 check of the timed path, C / W_hbm / the copy ladder / C_attn measured by that
# framework's own kernels, then d_model 2048 / 1024 / 4096 × 8k / 32k tokens, one document per
# row: measured, predicted with its terms, torch's profile by class and aten-op bytes, JAX's
# compiled-program FLOPs and bytes and its optimized HLO), then `report` (stepmodel-DATE.json /
# .md). FRAMEWORKS=torch or FRAMEWORKS=jax runs one of them (one device call each: the first
# run, both in one call, cut both short at 150 s / 290 s); each step has its own limit and every
# row is written as it finishes, so a cut-short step keeps its rows. Run from the repository
# root with $OUT set:
#     FRAMEWORKS=torch bash docs/gpu/stepmodel-2026-11-25-h100/2026-11-25-h100-stepmodel.sh
# Everything lands in $OUT/stepmodel-<frameworks>.tgz; the table is printed last. SMOKE=1 runs
# the same script on the CPU with the tiny models (--smoke), to check it before GPU time is spent.
set -u
OUT=${OUT:-/tmp/ringbridge-out}
L=/tmp/stepmodel; rm -rf $L; mkdir -p $L/stepmodel "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then  # flash_attn3_jax (JAX's fa3 route), when carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ "${SMOKE:-0}" = 1 ]; then
  export JAX_PLATFORMS=cpu; EXTRA=(--smoke); SIZES=64,96
else
  export JAX_PLATFORMS=cuda; EXTRA=(); SIZES=${GPU_SIZES:-2048,1024,4096}  # GPU_SIZES: a subset, for a rerun
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $L/gpu.txt 2>&1
fi
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)" >> $L/gpu.txt 2>&1
git log -1 --format='code: %H %s' >> $L/gpu.txt 2>/dev/null
step() {  # step NAME SECONDS COMMAND...: run with a limit, log, record the exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - start))" >> $L/steps.txt
}
TIME=(python3 -m parity.training.llama_gpu time --out $L/stepmodel --sizes $SIZES "${EXTRA[@]}")
FRAMEWORKS=${FRAMEWORKS:-torch,jax}
case ",$FRAMEWORKS," in *,torch,*) step torch "${TORCH_S:-300}" "${TIME[@]}" --frameworks torch;; esac
case ",$FRAMEWORKS," in *,jax,*) step jax "${JAX_S:-520}" "${TIME[@]}" --frameworks jax;; esac
step report 30 python3 -m parity.training.llama_gpu report --out $L/stepmodel
tar czf "$OUT/stepmodel-${FRAMEWORKS/,/-}.tgz" -C $L .
cat $L/gpu.txt $L/steps.txt
grep -hE "check|passed|FAILED|Error|error|ladder" $L/*.log | grep -v "^\s*$" | cut -c1-200 | tail -12
python3 - "$L/stepmodel" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("stepmodel-*-*-*.json")) or sorted(Path(sys.argv[1]).glob("stepmodel-*.json")):
    data = json.loads(path.read_text())
    parts = data["frameworks"].values() if "frameworks" in data else [data]
    print(f"{'fw':5s} {'model':9s} {'T':>6s} {'measured':>9s} {'predicted':>9s} {'mm':>6s} {'attn':>6s} {'mem':>6s} {'ratio':>6s} prog/model")
    for part in parts:
        for r in part["rows"]:
            if "error" in r:
                print(f"{r['framework']:5s} {r['model']:9s} {r['seq']:6d} ERROR {r['error'][:80]}")
                continue
            t = r["terms"]
            prog = r.get("traced_over_model", r.get("hlo_over_model", float("nan")))
            print(f"{r['framework']:5s} {r['model']:9s} {r['seq']:6d} {r['measured_s'] * 1e3:9.1f} {r['predicted_s'] * 1e3:9.1f} "
                  f"{t['matmul_s'] * 1e3:6.1f} {t['attention_s'] * 1e3:6.1f} {t['memory_s'] * 1e3:6.1f} "
                  f"{r['measured_over_predicted']:6.3f} {prog:.3f}")
    break
PY
