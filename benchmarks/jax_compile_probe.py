"""Where the JAX whole-model step's compile time goes: the same ``llama_jax.Step`` (the B*
command's JAX twin, ``parity.capacity.llama_scale_jax``) compiled under XLA's GEMM choices side
by side, each row's compile seconds and median step.

    python -m benchmarks.jax_compile_probe --out DIR [--seq 2048] [--devices 1] [--smoke]

Why: on 2x H200 (2026-11-28) the twin's exposure step at 8k tokens a row spent 291 s compiling
with XLA's autotuning on (its default level: cuBLAS and Triton GEMM configurations tried per
fusion), so one strategy's calibration and rows did not fit a 10-minute call. Variants, in order
(the first is the reference the others are checked against):

- ``autotune``: XLA's default autotuning (what the twin runs today);
- ``cublas``: Triton GEMM off (``xla_gpu_enable_triton_gemm=false``), cuBLAS's algorithms
  autotuned;
- ``untuned``: autotuning off (``xla_gpu_autotune_level=0``; 12x slower steps on 2026-11-27).

Check: the reference's loss and gradients (the step's loss-and-grads program, compiled with the
same options) against the float64 non-parallel step on the host, under the numerics policy
(``llama_scale.verdict``, the twin's own check, at the probe's T); every other variant's against the
reference's, within a bf16 tolerance. A row says ``checked`` only when its check passed (and, for a
variant, the reference's too). (The first version compared the parameters after one
Adam step: Adam's first update is ±lr wherever a gradient is nonzero, so a gradient near zero
that changes sign with the GEMM's rounding moves its parameter by 2·lr — 0.25 of the largest
parameter on an H200, 2026-11-28, with the loss equal bit for bit: a check that fails on correct
kernels.) Rows land in ``DIR/compile-probe.jsonl`` as each finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

VARIANTS = {"autotune": {}, "cublas": {"xla_gpu_enable_triton_gemm": False},
            "untuned": {"xla_gpu_autotune_level": 0}}
TOLERANCE = 2e-2  # bf16: relative to the reference's largest magnitude, per tensor
# --pass-times: XLA's own per-pass timers (VLOG 1 in these files), read back from the process's stderr.
# On 2x H200 (2026-11-28) the twin's 2-GPU step at 8k tokens compiled for over 120 s untuned (over 150 s
# with cuBLAS GEMMs and no latency-hiding scheduler) against 36-40 s for the 1-GPU step: which passes?
PASS_LOG_MODULES = "hlo_pass_pipeline=1,gpu_compiler=1,nvptx_compiler=1"
_PASS_LINE = re.compile(r"HLO pass: (\S+) time: ([0-9.]+) (us|ms|s|min|h)\b")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def program_size(text: str) -> dict[str, int]:
    """The compiled program's size from its optimized HLO text: lines, fusions, while loops,
    conditionals, custom calls (FA3's kernels are custom calls) and sorts (a GPU runs a large one as
    cub's radix sort, between command buffers) — what a compile has to emit."""
    count = lambda op: len(re.findall(rf"\s{op}\(", text))
    return {"hlo_lines": text.count("\n"), "fusions": count("fusion"), "while_loops": count("while"),
            "conditionals": count("conditional"), "custom_calls": count("custom-call"), "sorts": count("sort")}


def pass_times(log: str, top: int = 15) -> dict[str, float]:
    """Seconds per HLO pass name, summed over every run of it in ``log`` (XLA's lines ``HLO pass:
    NAME time: 1.5 ms (...)``), the ``top`` longest, longest first."""
    totals: dict[str, float] = {}
    for name, value, unit in _PASS_LINE.findall(log):
        totals[name] = totals.get(name, 0.0) + float(value) * _UNIT_S[unit]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def relative_error(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def loss_and_grads(program, params, batch, options: dict) -> tuple[float, dict]:
    """(loss, gradients on the host) of the loss-and-grads ``program`` compiled with ``options``."""
    import jax

    loss, grads = program.lower(params, *batch).compile(compiler_options=options or None)(params, *batch)
    return float(jax.device_get(loss).sum()), jax.device_get(grads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.jax_compile_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per row (one row)")
    ap.add_argument("--devices", type=int, default=1, help="a zigzag ring with FSDP over this many devices")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU")
    ap.add_argument("--compile-only", action="store_true",
                    help="each variant's compile seconds alone: no step is run, so no check and no step time")
    ap.add_argument("--cpu", action="store_true",
                    help="the GPU-size model on XLA:CPU's simulated devices (with --compile-only: how the program "
                         "grows with --devices, where a compile costs seconds)")
    ap.add_argument("--no-ids", action="store_true",
                    help="the rows (one document each) without segment ids, as the twin's rows run by default: the "
                         "same causal mask, its blocks on the plain kernels instead of the document path (the varlen "
                         "call and the portable kernel behind its lax.cond) — does that path make the multi-GPU "
                         "compile slow?")
    ap.add_argument("--pass-times", action="store_true",
                    help="each row with XLA's 15 longest HLO passes (seconds, summed over their runs; a pass "
                         "pipeline's own line includes the passes inside it, so the entries overlap and are not "
                         "summed); the process's stderr goes to DIR/xla-passes.log to be read")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    pass_log = a.out / "xla-passes.log"
    if a.pass_times:  # before XLA loads: its VLOG settings are read once, and it writes to fd 2
        os.environ.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=PASS_LOG_MODULES)
        sys.stderr.flush()
        os.dup2(os.open(pass_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    from parity.core.devices import configure_jax_devices

    configure_jax_devices("cpu" if a.smoke or a.cpu else "gpu", autotune=True)  # as the twin: before JAX starts
    import jax

    from parity.capacity.llama_scale import SMALL_RUN, ScaleRun, model_case, rows_of_one_document, verdict
    from parity.training.llama_gpu import jax_median_ms
    from parity.training.llama_jax import Step, from_params, make_mesh

    # the twin's rows pass no ids by default (ScaleRun.segment_ids); the probe passes them unless --no-ids
    run = replace(SMALL_RUN if a.smoke else ScaleRun(), segment_ids=not a.no_ids)
    case = model_case(run, "zigzag", a.seq, 1, a.devices)
    step = Step(case, make_mesh(case), dtype=getattr(jax.numpy, run.dtype), block_backend=run.block_backend)
    params, opt_state, *batch = step.arguments(rows_of_one_document(case))  # ids None without case.segment_ids
    _, grads_program, program = step.programs(params, opt_state, donate=True)
    rows_file = a.out / "compile-probe.jsonl"
    # the log from here on: the compiles before (the arguments' placement, Adam's init) are not a variant's
    reference, logged = None, len(pass_log.read_text(errors="replace")) if a.pass_times else 0

    def write(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")

    for name in a.variants.split(","):
        start = time.perf_counter()
        compiled = program.lower(params, opt_state, *batch).compile(compiler_options=VARIANTS[name] or None)
        compile_s = time.perf_counter() - start
        passes = {}
        if a.pass_times:  # this variant's compile: the log's lines since the last variant's
            log = pass_log.read_text(errors="replace")
            times = pass_times(log[logged:], top=10**6)
            logged = len(log)
            passes = {"passes_s": {k: round(v, 2) for k, v in list(times.items())[:15]}}
        if a.compile_only:  # a compile's seconds need no check: nothing it computes is reported
            write({"variant": name, "compiler_options": VARIANTS[name], "seq": a.seq, "devices": a.devices,
                   "ids": case.segment_ids, "compile_s": round(compile_s, 2), **passes, **program_size(compiled.as_text()),
                   "device": jax.devices()[0].device_kind,
                   "jax": jax.__version__})
            continue
        loss, grads = loss_and_grads(grads_program, params, batch, VARIANTS[name])
        if reference is None:  # the first variant: against the float64 step
            truth = verdict(case, run.dtype, loss, from_params(grads, case.model))
            reference, reference_name = (loss, grads, truth["passed"]), name
            errors = {"float64_worst_ratio": truth["worst_ratio"]}
            checked = truth["passed"]
        else:
            errors = {"loss": abs(loss - reference[0]) / abs(reference[0]),
                      "grads": max(jax.tree.leaves(jax.tree.map(relative_error, grads, reference[1])), default=0.0)}
            checked = reference[2] and all(e <= TOLERANCE for e in errors.values())
        state = list(jax.tree.map(jax.numpy.copy, (params, opt_state)))

        def once(state=state, compiled=compiled):
            _, _, state[0], state[1] = compiled(*state, *batch)
            return state[0]

        step_ms = jax_median_ms(once, run.warmup, run.iters)
        row = {"variant": name, "compiler_options": VARIANTS[name], "seq": a.seq, "devices": a.devices, "ids": case.segment_ids,
               "compile_s": round(compile_s, 2), **passes, "step_ms": round(step_ms, 3), "errors": errors,
               "checked": checked, "reference": reference_name,
               "device": jax.devices()[0].device_kind, "jax": jax.__version__}
        write(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
