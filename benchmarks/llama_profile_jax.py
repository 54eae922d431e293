"""Issue 48: where the JAX twin's whole-model step goes at each B of its B* sweep — the fixed cost
that adds to the math.

The 1k-token sweep on 2x H200 (docs/gpu/llamajax-sweep-2026-11-29-h200x2.md) measured the step as
T_math plus a constant ≈ 5.7 ms at every B from 1 to 32, where the model reads a floor the math
hides under. This traces the same step (``llama_scale``'s rig: ``GPU_MODEL``, FSDP over every GPU,
the strategy's attention mesh, rows of one document) at several B and splits each GPU's time per
step into kernel kinds — GEMMs, attention, NCCL per collective, memory copies, XLA's other kernels
(fusions: the optimizer, norms, casts) — with the exposed part of each collective kind
(``parity.capacity.exposure.exposed_times``), the idle time inside the step and the wall time
outside the GPU's span, and what the host did in the idle gaps (``benchmarks.host_gaps``). A kind
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
from collections import defaultdict
from pathlib import Path

STEPS_TRACED = 3
STEP_SLEEP_S = 0.03  # between traced steps: mesh_profile_jax.STEP_BREAK_MS (10 ms) splits the trace there
# Which kind a kernel's name says it is, first match wins: FA3's kernels are CUTLASS templates named
# for flash attention, cuBLAS's Hopper GEMMs are "nvjet_*" or "sm90_xmma_gemm_*" (both before "other").
KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "sdpa", "attention")),
         ("gemm", ("gemm", "nvjet", "xmma", "cublas", "cutlass", "triton_gemm")), ("copy", ("memcpy", "memset")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lowered for m in marks)), "other")


def split(kernels: dict[str, list[tuple[str, float, float]]], steps: int, send_recv, names: dict[str, str]) -> dict:
    """Per GPU, from its kernels as (name, start ms, end ms) (``mesh_profile_jax.device_kernels``;
    ms per step): kernel time by :func:`kernel_kind`, the exposed NCCL time per
    collective kind, busy (any kernel), the span and idle inside it, the "other" kernels by op
    scope, and the ten costliest kernels of GPU 0 by name."""
    from benchmarks.mesh_profile_jax import idle_inside_steps, other_by_scope, union_ms
    from parity.capacity.exposure import exposed_times

    per_gpu = {}
    for process, rows in sorted(kernels.items()):
        found = idle_inside_steps(rows, steps, top=8)
        if found["steps_found"] != steps:  # kernels in the wrong unit, or a step with a 10 ms gap inside
            raise ValueError(f"{process}: the trace splits into {found['steps_found']} steps, not {steps} "
                             f"(kernels in ms, steps {STEP_SLEEP_S * 1e3:.0f} ms apart expected)")
        by_kind: dict[str, float] = defaultdict(float)
        launches: dict[str, int] = defaultdict(int)
        for name, lo, hi in rows:
            by_kind[kernel_kind(name)] += (hi - lo) / steps
            launches[kernel_kind(name)] += 1
        exposed = exposed_times(rows, send_recv)
        per_gpu[process] = {"kernel_ms_per_step": dict(by_kind),
                            "launches_per_step": {k: v / steps for k, v in launches.items()},
                            "busy_ms_per_step": union_ms(rows) / steps,
                            "nccl_exposed_ms_per_step": {k: x["exposed_s"] / steps for k, x in exposed.items()},
                            **found,
                            "other_by_scope_ms_per_step": other_by_scope(
                                [(n, lo, hi) for n, lo, hi in rows if kernel_kind(n) == "other"], names, steps, top=12)}
    top: dict[str, float] = defaultdict(float)
    for name, lo, hi in kernels.get(min(kernels), []) if kernels else []:
        top[name[:100]] += (hi - lo) / steps
    return {"per_gpu": per_gpu, "top_kernels_gpu0_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:10])}


def wall_times(rig, warmup: int, iters: int) -> dict:
    """The step waited for (median of ``iters``), how long its call takes to return (the host's
    dispatch), and the step with ``iters`` queued before one wait."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(rig.run())
    waited, dispatch = [], []
    for _ in range(iters):
        began = time.perf_counter()
        out = rig.run()
        dispatch.append(time.perf_counter() - began)
        jax.block_until_ready(out)
        waited.append(time.perf_counter() - began)
    began = time.perf_counter()
    jax.block_until_ready([rig.run() for _ in range(iters)][-1])
    queued = (time.perf_counter() - began) / iters
    return {"waited_ms": 1e3 * statistics.median(waited), "dispatch_ms": 1e3 * statistics.median(dispatch),
            "queued_ms": 1e3 * queued}


def profile_row(run, strategy: str, seq: int, batch: int, world: int, check: bool) -> dict:
    import jax

    from benchmarks.host_gaps import read_trace, summary
    from benchmarks.mesh_profile_jax import device_kernels, op_names
    from parity.capacity.exposure import send_recv_kinds
    from parity.capacity.llama_scale import model_case, verdict
    from parity.capacity.llama_scale_jax import JaxRig
    from parity.training.llama_traffic import llama_step_traffic

    case = model_case(run, strategy, seq, batch, world)
    rig = JaxRig(case, run.dtype, run.block_backend)
    row: dict = {"strategy": strategy, "seq": seq, "batch": batch, "devices": world}
    if check:  # the step's gradients against the float64 step, before any time is read: at one row of
        # the same T (the float64 step on the host's CPU at 64 rows ran past a 170 s call on 2x H200)
        one = case if batch == 1 else model_case(run, strategy, seq, 1, world)
        row["verified"] = verdict(one, run.dtype, *(rig if one is case else JaxRig(one, run.dtype,
                                                                                     run.block_backend)).loss_and_grads())
        if not row["verified"].get("passed"):
            return row
    began = time.perf_counter()
    rig.compiled  # noqa: B018 — its compile timed apart from the steps
    row["compile_s"] = round(time.perf_counter() - began, 1)
    row |= wall_times(rig, run.warmup, run.iters)
    if jax.devices()[0].platform == "cpu":
        return row | {"profile": "not traced on the CPU (no device kernels)"}
    trace_dir = f"/tmp/llama-profile/{strategy}-T{seq}-B{batch}"
    with jax.profiler.trace(trace_dir):
        for _ in range(STEPS_TRACED):
            jax.block_until_ready(rig.run())
            time.sleep(STEP_SLEEP_S)
    kinds = sorted({kind for _, kind in llama_step_traffic(case, "jax", run.dtype).rows()})
    try:
        row |= split(device_kernels(trace_dir), STEPS_TRACED, send_recv_kinds(kinds), op_names(rig.compiled.as_text()))
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
    kinds = ("gemm", "attention", "nccl", "other", "copy")
    head = ("| B | waited ms | queued ms | dispatch ms | span | busy | idle inside | "
            + " | ".join(kinds) + " | NCCL exposed | launches |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        gpu = next(iter(r.get("per_gpu", {}).values()), None)
        if gpu is None:
            lines.append(f"| {r['batch']} | {r.get('waited_ms', 0):.2f} | {r.get('queued_ms', 0):.2f} | "
                         f"{r.get('dispatch_ms', 0):.2f} |" + " — |" * (len(kinds) + 5))
            continue
        k = gpu["kernel_ms_per_step"]
        lines.append(f"| {r['batch']} | {r['waited_ms']:.2f} | {r['queued_ms']:.2f} | {r['dispatch_ms']:.2f} | "
                     f"{statistics.median(gpu['span_ms']):.2f} | {gpu['busy_ms_per_step']:.2f} | "
                     f"{gpu['idle_inside_ms_per_step']:.2f} | " + " | ".join(f"{k.get(x, 0):.2f}" for x in kinds)
                     + f" | {sum(gpu['nccl_exposed_ms_per_step'].values()):.2f} | "
                     f"{sum(gpu['launches_per_step'].values()):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--world", type=int, default=None, help="GPUs (default: every one)")
    ap.add_argument("--xla-gemm", choices=("autotune", "cublas"), default="cublas")
    ap.add_argument("--smoke", action="store_true", help="CPU, the small model, 2 simulated devices")
    a = ap.parse_args(argv)
    from dataclasses import replace

    from parity.capacity.llama_scale import SMALL_RUN, XLA_GEMM, ScaleRun
    from parity.core.devices import configure_jax_devices

    if a.xla_gemm == "cublas" and not a.smoke:  # before JAX starts, as llama_scale sets it
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_GEMM['cublas']}".strip()
    configure_jax_devices("cpu" if a.smoke else "gpu", autotune=True)
    import jax

    run = SMALL_RUN if a.smoke else ScaleRun()
    seq = 32 if a.smoke else a.seq
    world = a.world or (2 if a.smoke else len(jax.devices()))
    batches = [int(b) for b in a.batches.split(",")] if not a.smoke else [1, 2]
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
