"""Issue 48: which collective-permutes the JAX twin's zigzag step compiles on DEVICES devices, each
with its whole shape (dtypes), the op that issued it, beside the accounting model's per-kind
difference, compiled and as lowered — why the 2-GPU rows' p2p bytes came out at 0.6-0.7 of the model
(docs/gpu/llamajax-2026-11-29-h200x2.md).

    python docs/gpu/llamajax-2026-11-29-h200x2/permutes.py SEQ DEVICES BACKEND [BACKEND ...]   (PYTHONPATH=$PWD)

Compile only (``JaxRig(..., abstract=True)``: nothing runs). ``MOCK=1``: DEVICES GPUs mocked on the
one GPU there is (``jax_mock_gpu_topology`` "1 x DEVICES x 1": XLA:GPU's own passes, NCCL mocked),
so this needs no multi-GPU machine. ``HLO_DIR=DIR``: each compiled program's text saved there, for
reading offline. ``ROWS=B``: B rows of SEQ tokens (default 1). (The 4-GPU run list's part
``p2pbytes``; layouts dropped from the shapes.)
"""

import os
import re
import sys

import jax

seq, devices, backends = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
if os.environ.get("MOCK") == "1":
    jax.config.update("jax_mock_gpu_topology", f"1x{devices}x1")

from parity.capacity import llama_scale, llama_scale_jax  # noqa: E402  (after the topology is set)
from parity.training.llama_traffic import llama_step_traffic  # noqa: E402

print("devices:", [str(d) for d in jax.devices()][:8], "local:", jax.local_device_count())
rows = int(os.environ.get("ROWS", "1"))
case = llama_scale.model_case(llama_scale.ScaleRun(), "zigzag", seq, rows, devices)
model = llama_step_traffic(case, "jax", "bfloat16").rows()
for backend in backends:
    rig = llama_scale_jax.JaxRig(case, "bfloat16", backend, abstract=True)
    text = rig.compiled.as_text()
    if os.environ.get("HLO_DIR"):
        os.makedirs(os.environ["HLO_DIR"], exist_ok=True)
        with open(os.path.join(os.environ["HLO_DIR"], f"zigzag-{seq}x{rows}-{devices}-{backend}.hlo.txt"), "w") as f:
            f.write(text)
    print(f"== {backend}, T = {seq}, B = {rows}, {devices} devices")
    for line in text.splitlines():
        if re.search(r"= .*collective-permute(-start)?\(", line):
            shape = re.search(r"= (.*?)\s+collective-permute(-start)?\(", line)
            op = re.search(r'op_name="([^"]*)"', line)
            kept = re.sub(r"\{[^{}]*\}", "", shape.group(1)) if shape else "?"  # layouts dropped
            print(" ", kept, (op.group(1) if op else "")[-110:])
    for scope in ("whole step", "lowered", "unquantized"):
        try:
            print(f" {scope} vs the model:", llama_scale.traffic_differences(model, rig.traffic(scope).rows(), "whole step"))
        except ValueError as err:  # the reader refuses what it cannot count (a loop of unknown trip count)
            print(f" {scope}: not counted: {err}")
