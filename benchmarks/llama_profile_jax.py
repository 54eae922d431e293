"""Issue 48: where the JAX twin's whole-model step goes at each B of its B* sweep — the fixed cost
that adds to the math.

The 1k-token sweep on 2x H200 (docs/gpu/llamajax-sweep-2026-11-29-h200x2.md) measured the step as
T_math plus a constant ≈ 5.7 ms at every B from 1 to 32, where the model reads a floor the math
hides under. This traces the same step (``llama_scale``'s rig: ``GPU_MODEL``, FSDP over every GPU,
the strategy's attention mesh, rows of one document) at several B and splits each GPU's time per
step into kernel kinds — GEMMs, attention, NCCL per collective, memory copies, XLA's other kernels
(fusions: the optimizer, norms, casts) — with the exposed part of each collective kind and the idle
time inside the step (``mesh_profile_jax.summarize``, as the attention profiles read theirs), the
wall time waited, dispatched and queued (``mesh_profile_jax.step_times``), and what the host did in
the idle gaps (``benchmarks.host_gaps``). A kind
whose time per step is flat in B is fixed cost; the rows side by side say which kind holds the
constant. Before the first row is timed, the same step at one row of the same T is checked against
the float64 step (``llama_scale.verdict``); rows go to ``$OUT/llama-profile/B{B}.json``
as they finish, then a table of every B to ``summary.md``.

    python -m benchmarks.llama_profile_jax --seq 1024 --batches 1,4,16 --xla-gemm cublas
    python -m benchmarks.llama_profile_jax --smoke   # CPU, 2 simulated devices: the path only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

STEPS_TRACED = 3
STEP_SLEEP_S = 0.03  # between traced steps: mesh_profile_jax.STEP_BREAK_MS (10 ms) splits the trace there
KINDS_SHOWN = ("gemm", "attention", "nccl", "other", "copy")  # mesh_profile_jax.kind_of's kinds


def profile_row(run, strategy: str, seq: int, batch: int, world: int, check: bool) -> dict:
    import jax

    from benchmarks.host_gaps import read_trace, summary
    from benchmarks.mesh_profile_jax import device_kernels, op_names, step_times, summarize
    from parity.capacity.exposure import send_recv_kinds
    from parity.capacity.llama_scale import model_case, verdict
    from parity.capacity.llama_scale_jax import JaxRig
    from parity.training.llama_traffic import llama_step_traffic

    case = model_case(run, strategy, seq, batch, world)
    rig = JaxRig(case, run.dtype, run.block_backend)
    row: dict = {"strategy": strategy, "seq": seq, "batch": batch, "devices": world}
    if check:  # the step's gradients against the float64 step, before any time is read: at one row of
        # the same T (the float64 step on the host's CPU at 64 rows ran past a 170 s call on 2x H200)
        checked = rig if batch == 1 else JaxRig(model_case(run, strategy, seq, 1, world), run.dtype, run.block_backend)
        row["verified"] = verdict(checked.case, run.dtype, *checked.loss_and_grads())
        if not row["verified"].get("passed"):
            return row
    began = time.perf_counter()
    rig.compiled  # noqa: B018 — its compile timed apart from the steps
    row["compile_s"] = round(time.perf_counter() - began, 1)
    row |= step_times(rig.run, (), warmup=run.warmup, steps=run.iters)  # waited, dispatch, queued
    if jax.devices()[0].platform == "cpu":
        return row | {"profile": "not traced on the CPU (no device kernels)"}
    trace_dir = f"/tmp/llama-profile/{strategy}-T{seq}-B{batch}"
    with jax.profiler.trace(trace_dir):
        for _ in range(STEPS_TRACED):
            jax.block_until_ready(rig.run())
            time.sleep(STEP_SLEEP_S)
    kinds = sorted({kind for _, kind in llama_step_traffic(case, "jax", run.dtype).rows()})
    try:
        row |= summarize(device_kernels(trace_dir), STEPS_TRACED, send_recv_kinds(kinds), op_names(rig.compiled.as_text()))
    except ValueError as err:  # a trace that does not split into its steps: the row keeps its times, not a split
        row["profile_error"] = str(err)
    try:
        trace = read_trace(trace_dir)
        row["host_gpu0"] = {k: v for k, v in summary(trace, 0, detail=8).items() if k != "trace"}
    except Exception as err:  # noqa: BLE001 — the device half of the row stands without it
        row["host_error"] = f"{type(err).__name__}: {err}"[:300]
    return row


def table(rows: list[dict]) -> str:
    """GPU 0's split of every B, ms per step, side by side."""
    kinds = KINDS_SHOWN
    head = ("| B | waited ms | queued ms | dispatch ms | span | busy | idle inside | "
            + " | ".join(kinds) + " | NCCL exposed | launches |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        gpu = next(iter(r.get("per_gpu", {}).values()), None)
        if gpu is None:
            lines.append(f"| {r['batch']} | {r.get('wall_ms_median', 0):.2f} | {r.get('queued_ms_per_step', 0):.2f} | "
                         f"{r.get('dispatch_ms_median', 0):.2f} |" + " — |" * (len(kinds) + 5))
            continue
        k = gpu["kernel_ms_per_step"]
        lines.append(f"| {r['batch']} | {r['wall_ms_median']:.2f} | {r['queued_ms_per_step']:.2f} | "
                     f"{r['dispatch_ms_median']:.2f} | "
                     f"{statistics.median(gpu['span_ms']):.2f} | {gpu['busy_ms_per_step']:.2f} | "
                     f"{gpu['idle_inside_ms_per_step']:.2f} | " + " | ".join(f"{k.get(x, 0):.2f}" for x in kinds)
                     + f" | {sum(x['exposed'] for x in gpu['exposed_ms_per_step'].values()):.2f} | "
                     f"{sum(gpu['launches_per_step'].values()):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--seq", type=int, default=None, help="tokens a row (default 1024; --smoke: 32)")
    ap.add_argument("--batches", default=None, help="comma-separated rows a step (default 1,4,16; --smoke: 1,2)")
    ap.add_argument("--world", type=int, default=None, help="GPUs (default: every one)")
    ap.add_argument("--xla-gemm", choices=("autotune", "cublas"), default="cublas")
    ap.add_argument("--smoke", action="store_true", help="CPU, the small model, 2 simulated devices")
    a = ap.parse_args(argv)
    from dataclasses import replace

    from parity.capacity.llama_scale import SMALL_RUN, XLA_GEMM, ScaleRun
    from parity.core.devices import configure_jax_devices

    if a.xla_gemm == "cublas":  # before JAX starts, as llama_scale sets it (XLA:CPU ignores the flag)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_GEMM['cublas']}".strip()
    configure_jax_devices("cpu" if a.smoke else "gpu", autotune=True)
    import jax

    run = SMALL_RUN if a.smoke else ScaleRun()
    seq = a.seq or (32 if a.smoke else 1024)
    world = a.world or (2 if a.smoke else len(jax.devices()))
    batches = [int(b) for b in (a.batches or ("1,2" if a.smoke else "1,4,16")).split(",")]
    out = Path(os.environ.get("OUT", "/tmp")) / "llama-profile"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, batch in enumerate(batches):
        row = profile_row(replace(run, iters=max(run.iters, 10)), a.strategy, seq, batch, world, check=i == 0)
        row["xla_gemm"] = a.xla_gemm
        (out / f"B{batch}.json").write_text(json.dumps(row, indent=1, default=str))
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        if row.get("verified", {}).get("passed") is False:
            print("check failed: nothing timed", row["verified"], file=sys.stderr)
            break
    (out / "summary.md").write_text(f"{a.strategy}, {seq} tokens a row, {world} devices, XLA GEMMs {a.xla_gemm}; "
                                    f"GPU 0, ms per step\n\n" + table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
