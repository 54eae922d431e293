"""Issue 48: which collective-permutes the JAX twin's zigzag step compiles on two devices, each with
its shape, dtype and the op that issued it, beside the accounting model's per-kind difference —
why the 2-GPU rows' p2p bytes came out at 0.7 of the model (docs/gpu/llamajax-2026-11-29-h200x2.md).

    python docs/gpu/llamajax-2026-11-29-h200x2/permutes.py SEQ DEVICES BACKEND [BACKEND ...]   (PYTHONPATH=$PWD)

(the 4-GPU run list's part ``p2pbytes``; each instruction's whole shape, layouts dropped).
"""

import re
import sys

from parity.capacity import llama_scale, llama_scale_jax
from parity.training.llama_traffic import llama_step_traffic

seq, devices, backends = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
case = llama_scale.model_case(llama_scale.ScaleRun(), "zigzag", seq, 1, devices)
for backend in backends:
    rig = llama_scale_jax.JaxRig(case, "bfloat16", backend)
    print(f"== {backend}, T = {seq}, {devices} devices")
    for line in rig.compiled.as_text().splitlines():
        if re.search(r"= .*collective-permute(-start)?\(", line):
            shape = re.search(r"= (.*?)\s+collective-permute(-start)?\(", line)
            op = re.search(r'op_name="([^"]*)"', line)
            kept = re.sub(r"\{[^{}]*\}", "", shape.group(1)) if shape else "?"  # layouts dropped
            print(" ", kept, (op.group(1) if op else "")[-110:])
    model = llama_step_traffic(case, "jax", "bfloat16").rows()
    print(" differences:", llama_scale.traffic_differences(model, rig.traffic("whole step").rows(), "whole step"))
