"""The FSDP × TP B* sweep on real devices: the calculator's own setting measured.

    python -m parity.capacity.tp_sweep --devices gpu --out DIR [--framework jax]   # 4 GPUs: FSDP 2 × TP 2
    python -m parity.capacity.tp_sweep --devices cpu --small --out DIR             # the same code on the CPU

``python -m parity bstar`` answers "how many tokens per device before an FSDP × TP step stops
waiting for its weights" from a closed form (``bstar.step_coefficients``: per FFN block and device,
T(B) = (m + a·B) against (c + y·B) — compute and memory against the FSDP gathers and the TP
all-reduces — overlapped or in sequence). This command holds that form against the step it
describes: the FFN training step — torch: ``parity.training.torch_step`` (FSDP2 + DTensor TP);
JAX: ``parity.training.jax_step`` (``shard_map`` over an fsdp × tp mesh, one process for every
device, XLA's GEMM autotuning on) — bf16, float32 master weights and Adam, over X·Y devices,
timed at growing tokens per device B, with C, W_hbm and W per collective calibrated on the same
devices first (JAX: ``llama_scale_jax.jax_profile``).

- **Checked before timed**: the same step (same world, mesh and dtype) at ``check`` size against
  the float64 unsharded step, every tensor within the low-precision policy of the same code's
  one-device step (``parity.core.numerics``; updated weights are compared in float32 runs only:
  Adam's first step is ≈ lr·sign(g)). Rows carry ``verified``.
- **Rows**: B, ``measured_s`` (the slowest rank's median step), ``bound_overlap_s`` = L·max(m + a·B,
  c + y·B), ``bound_serial_s`` = L·(m + a·B + c + y·B), ``predicted_s`` = max(the host floor, the
  serial bound) — no profile splits this step's exposed traffic yet (4× H200, 2026-11-27: measured
  0.94–1.13× the serial bound from 4k tokens per device up, both frameworks); the host floor is
  the same step timed twice at ``host_tokens`` (below every row; the faster kept), as ``llama_scale`` takes its own — on
  4× H200 torch's FSDP2 + DTensor step took 26 ms whatever its size up to 2k tokens per device,
  against a 9–18 ms serial bound.
- **The knee**: ``measured_knee`` — the smallest B whose time per token is within 10 % of the
  sweep's best (``llama_scale.knee``) — beside the same rule on ``predicted_s`` (``predicted_knee``)
  and on each bound, the closed form's B* (tokens per device; the "sum" and the "max" forms: where
  compute would cover the traffic), ``bstar_host`` (where the serial bound reaches the host floor)
  and ``predicted_bstar`` = the larger of the "sum" form and ``bstar_host``. On a step that runs
  its traffic in sequence (the serial bound) the time per token keeps falling past the closed
  form's B* — c/B against a — so the 10 % knee sits near 10× it: the two answer different
  questions (docs/bstar.md).

Every row is handed to ``emit`` as it is measured (the CLI appends it to ``-rows.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..core.numerics import check_tensor, step_verdict
from ..runners.torch_runner import world_backend
from ..runners.torch_world import close_world, close_worlds, get_world
from ..training.reference import TrainCase, make_train_inputs, reference_step
from .bstar import Choices, Hardware, critical_batch, step_coefficients
from .calibrate import SMALL, Sizes, hardware_profile, profile_task
from .llama_scale import host_floor_seconds, knee, rows_emitter

CHECKED = ("loss", "dx", "dw1", "dw2")  # new weights: float32 runs only (Adam's first step ≈ lr·sign(g))


@dataclass(frozen=True)
class TPSweep:
    """What one invocation measures: an FFN stack of ``blocks`` blocks (``d_model`` → ``d_ff`` →
    ``d_model``, gelu) over an FSDP ``fsdp`` × TP ``tp`` mesh, in ``dtype``, at ``tokens`` per device
    (B; the global batch is B·fsdp tokens: the TP ranks share theirs); ``check`` the same mesh and
    dtype at a size a float64 reference computes quickly; ``warmup`` / ``iters`` steps untimed /
    timed (median); ``sizes`` the calibration's."""

    d_model: int = 8192
    d_ff: int = 32768
    blocks: int = 2
    fsdp: int = 2
    tp: int = 2
    # around the closed form's B* on 4x H200's calibration (2026-11-27: ≈ 340 tokens per device) and
    # one past 8192, where the knee fell on that day's sweeps (the last row cannot show a knee's end)
    tokens: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    host_tokens: int = 8  # the host floor's step: below every row
    dtype: str = "bfloat16"
    warmup: int = 2
    iters: int = 5
    sizes: Sizes = Sizes()
    check_d_model: int = 256
    check_d_ff: int = 1024
    check_tokens: int = 128

    def case(self, tokens_per_device: int) -> TrainCase:
        return TrainCase("fsdp_tp", fsdp=self.fsdp, tp=self.tp, blocks=self.blocks, d_model=self.d_model,
                         d_ff=self.d_ff, tokens=tokens_per_device * self.fsdp, dtype=self.dtype)

    def check(self) -> TrainCase:
        return TrainCase("fsdp_tp", fsdp=self.fsdp, tp=self.tp, blocks=self.blocks, d_model=self.check_d_model,
                         d_ff=self.check_d_ff, tokens=self.check_tokens * self.fsdp, dtype=self.dtype)


SMALL_SWEEP = TPSweep(d_model=64, d_ff=256, tokens=(8, 16, 32), host_tokens=4, warmup=1, iters=2, sizes=SMALL,
                      check_d_model=32, check_d_ff=128, check_tokens=16)


def verify(check: TrainCase, devices: str, framework: str = "torch") -> dict:
    """``check``'s step on ``devices`` against the float64 unsharded step (module docstring)."""
    if framework == "jax":
        from ..training.jax_step import run_step

        run = run_step
    else:
        from ..training import torch_step

        run = lambda case, inputs: torch_step.run_step(case, inputs, devices=devices)
    inputs = make_train_inputs(check)
    ref = reference_step(check, inputs)
    got = run(check, inputs)
    control = None if check.dtype == "float32" else run(replace(check, fsdp=1, tp=1), inputs)
    if framework == "torch":  # the one-device control's world: not left holding a GPU through the timing
        close_world(1, world_backend(devices)[0])
    keys = CHECKED if control is not None else CHECKED + ("new_w1", "new_w2")
    checks = [check_tensor(k, got[k], ref[k], check.dtype, None if control is None else control[k]) for k in keys]
    return {"case": check.name, "d_model": check.d_model, "d_ff": check.d_ff, "tokens": check.tokens,
            **step_verdict(checks)}


def jax_timed_step(case: TrainCase, warmup: int, iters: int) -> float:
    """Median seconds of ``case``'s whole jitted step, its master weights and Adam state fed back
    as a training loop does (``jax_step.Step.arguments``: put sharded from the host)."""
    from ..training.jax_step import Step, make_mesh
    from ..training.llama_gpu import jax_median_ms

    step = Step(case, make_mesh(case))
    weights, master, opt_state, x, y = step.arguments(make_train_inputs(case))
    program = step.programs(opt_state)[2]
    state = [weights, master, opt_state]

    def one():  # zero1 computes with weights of its own; the others with the master (weights is master)
        _, _, state[0], state[1], state[2] = program(*state, x, y)
        return state[1]

    return jax_median_ms(one, warmup, iters) * 1e-3


def bounds(sweep: TPSweep, hw: Hardware, tokens_per_device: int) -> dict:
    """The closed form's step at B tokens per device (``bstar.step_coefficients``, forward and
    backward, the memory term on): both bounds, the coefficients per block."""
    a, c, y, m = step_coefficients(sweep.d_model, sweep.d_ff, sweep.fsdp, sweep.tp, 1.0, 1.0, hw,
                                   Choices("sum", passes="fwd+bwd", memory=True))
    b, n = tokens_per_device, sweep.blocks
    return {"bound_overlap_s": n * max(m + a * b, c + y * b), "bound_serial_s": n * (m + a * b + c + y * b),
            "coefficients_per_block": {"a_s_per_token": a, "c_s": c, "y_s_per_token": y, "m_s": m}}


def host_bstar(sweep: TPSweep, hw: Hardware, host_s: float) -> float:
    """Tokens per device where the serial bound L·(m + c + (a + y)·B) reaches the host floor
    (0 when it starts above it): below it the step waits for the host, whatever B."""
    k = bounds(sweep, hw, 0)["coefficients_per_block"]
    fixed, slope = sweep.blocks * (k["m_s"] + k["c_s"]), sweep.blocks * (k["a_s_per_token"] + k["y_s_per_token"])
    return max(0.0, (host_s - fixed) / slope)


def measure(sweep: TPSweep, devices: str, emit=None, framework: str = "torch") -> dict:
    """Calibrate, check, then time every B in ``framework``; the result dict (rows also to ``emit``
    as measured)."""
    n = sweep.fsdp * sweep.tp
    if min(sweep.tokens) <= sweep.host_tokens:  # a prediction must come from a step it is not checked against
        raise ValueError(f"the host floor's step ({sweep.host_tokens} tokens per device) must be below every row "
                         f"({min(sweep.tokens)})")
    for b in (sweep.host_tokens, *sweep.tokens):  # a size the mesh cannot shard fails before any device is touched
        sweep.case(b)
    if framework == "jax":
        import jax

        from .llama_scale_jax import jax_profile

        if len(jax.devices()) < n:
            raise ValueError(f"FSDP {sweep.fsdp} × TP {sweep.tp} needs {n} devices, JAX has {len(jax.devices())}")
        profile, device_name = jax_profile(sweep.sizes, jax.devices()[:n]), jax.devices()[0].device_kind
        software = f"jax {jax.__version__}"
        timer = lambda case: jax_timed_step(case, sweep.warmup, sweep.iters)
    else:
        import torch

        from ..training import torch_step

        backend, device_type = world_backend(devices)
        if devices == "gpu" and torch.cuda.device_count() < n:
            raise ValueError(f"FSDP {sweep.fsdp} × TP {sweep.tp} needs {n} GPUs, found {torch.cuda.device_count()}")
        ranks = get_world(n, backend)
        profile = ranks.run(profile_task, sweep.sizes, device_type)[0]
        device_name = torch.cuda.get_device_name(0) if devices == "gpu" else "CPU"
        software = f"torch {torch.__version__}"
        timer = lambda case: max(ranks.run(torch_step.timed_step_task, case, device_type, sweep.warmup,
                                           sweep.iters))
    emit = emit or (lambda row: None)
    hardware = hardware_profile(f"tp-sweep-{framework}-{devices}{n}", "python -m parity.capacity.tp_sweep", profile,
                                device_name, n, sweep.sizes, software)
    emit({"hardware": hardware})
    hw = Hardware(hardware["name"], profile["flops"], profile["bandwidth"], profile["hbm"])
    checked = verify(sweep.check(), devices, framework)
    emit({"verify": sweep.check().name, **checked})
    try:
        floor_case = sweep.case(sweep.host_tokens)
        host_s, timings = host_floor_seconds(lambda: timer(floor_case))
        emit({"host_floor": "fsdp_tp", "tokens_per_device": sweep.host_tokens, "seconds": host_s,
              "timings_s": timings})
    except Exception as err:  # noqa: BLE001 — the rows still come, predicted by the serial bound alone
        host_s = 0.0
        emit({"host_floor": "fsdp_tp", "tokens_per_device": sweep.host_tokens, "seconds": None,
              "error": f"{type(err).__name__}: {err}"[:500]})
    rows = []
    for b in sweep.tokens:
        head = {"tokens_per_device": b, "fsdp": sweep.fsdp, "tp": sweep.tp, "blocks": sweep.blocks,
                "framework": framework, "verified": checked["passed"], "device": device_name}
        try:
            measured, pred = timer(sweep.case(b)), bounds(sweep, hw, b)
            predicted = max(host_s, pred["bound_serial_s"])
            row = {**head, "measured_s": measured, **pred, "host_floor_s": host_s, "predicted_s": predicted,
                   "measured_over_predicted": measured / predicted,
                   "measured_over_serial": measured / pred["bound_serial_s"],
                   "measured_over_overlap": measured / pred["bound_overlap_s"]}
        except Exception as err:  # noqa: BLE001 — one failing row (memory) must not lose the others
            row = {**head, "error": f"{type(err).__name__}: {err}"[:500]}
        emit(row)
        rows.append(row)
    good = [r for r in rows if "error" not in r]
    tokens = [r["tokens_per_device"] for r in good]
    knees = {f"knee_{key}": knee(tokens, [r[key] for r in good]) if good else None
             for key in ("measured_s", "predicted_s", "bound_serial_s", "bound_overlap_s")}
    bstar = {f"predicted_bstar_{form}": critical_batch(sweep.d_model, sweep.d_ff, sweep.fsdp, sweep.tp, 1.0, 1.0, hw,
                                                       Choices(form, passes="fwd+bwd", memory=True)).tokens_per_device
             for form in ("sum", "max")}
    bstar["bstar_host"] = host_bstar(sweep, hw, host_s)
    summary = {"measured_knee": knees["knee_measured_s"], "predicted_knee": knees["knee_predicted_s"], **knees,
               **bstar, "predicted_bstar": max(bstar["predicted_bstar_sum"], bstar["bstar_host"]),
               "host_floor_s": host_s}
    emit({"summary": "fsdp_tp", **summary})
    env = {"devices": f"{n}x {device_name}", "framework": framework, "software": software,
           "date": time.strftime("%Y-%m-%d")}
    return {"env": env, "sweep": {**asdict(sweep), "sizes": repr(sweep.sizes)}, "profile": profile,
            "verified": checked, "rows": rows, "summary": summary}


def markdown(result: dict) -> str:
    s, p, v = result["sweep"], result["profile"], result["verified"]
    lines = [f"# FSDP {s['fsdp']} × TP {s['tp']} B* sweep on {result['env']['devices']} — {result['env']['date']}", "",
             f"{result['env']['software']}; FFN D {s['d_model']}, F {s['d_ff']}, {s['blocks']} blocks, {s['dtype']}; "
             f"C = {p['flops'] / 1e12:.0f} TFLOP/s, W_hbm = {p['hbm'] / 1e9:.0f} GB/s, W (GB/s per device): "
             + ", ".join(f"{k} {w / 1e9:.0f}" for k, w in p["bandwidth"].items()), "",
             f"Checked ({v['case']}, D {v['d_model']}, F {v['d_ff']}, {v['tokens']} tokens, against the float64 step): "
             f"{'passed' if v['passed'] else 'FAILED'} (worst {v['worst']} {v['worst_ratio']:.2f} of its tolerance)", "",
             f"Host floor (the step at {s['host_tokens']} tokens per device): "
             f"{result['summary']['host_floor_s'] * 1e3:.2f} ms; predicted = max(host floor, serial bound)", "",
             "| B (tokens / device) | measured ms | predicted ms | serial bound ms | overlap bound ms "
             "| measured / predicted | measured / serial | ms per 1k tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['tokens_per_device']} | failed: {r['error'][:100]} | | | | | | |")
            continue
        lines.append(f"| {r['tokens_per_device']} | {r['measured_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} "
                     f"| {r['bound_serial_s'] * 1e3:.2f} | {r['bound_overlap_s'] * 1e3:.2f} "
                     f"| {r['measured_over_predicted']:.2f} | {r['measured_over_serial']:.2f} "
                     f"| {r['measured_s'] * 1e6 / r['tokens_per_device']:.3f} |")
    m = result["summary"]
    lines += ["", f"Knee (time per token within 10 % of the best): measured {m['measured_knee']}, predicted "
              f"{m['predicted_knee']} (on the serial bound {m['knee_bound_serial_s']}, on the overlap bound "
              f"{m['knee_bound_overlap_s']}). B* (tokens per device): the closed form's {m['predicted_bstar_sum']:.0f} "
              f"(sum) / {m['predicted_bstar_max']:.0f} (max), the host floor's {m['bstar_host']:.0f}; predicted "
              f"B* {m['predicted_bstar']:.0f}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parity.capacity.tp_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--framework", choices=("torch", "jax"), default="torch")
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU check of the command)")
    ap.add_argument("--tokens", default=None, help="comma-separated tokens per device")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    sweep = SMALL_SWEEP if a.small else TPSweep()
    if a.tokens:
        sweep = replace(sweep, tokens=tuple(int(t) for t in a.tokens.split(",") if t))
    a.out.mkdir(parents=True, exist_ok=True)  # before any work: rows land as they are measured
    stem = f"tp-sweep-{'jax-' if a.framework == 'jax' else ''}{time.strftime('%Y-%m-%d')}"
    emit = rows_emitter(a.out, stem)

    if a.framework == "jax":
        from ..core.devices import configure_jax_devices

        configure_jax_devices(a.devices, autotune=True)  # before JAX starts: XLA's GEMM autotuning on
    try:
        result = measure(sweep, a.devices, emit, a.framework)
    finally:
        close_worlds()
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (a.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["verified"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
