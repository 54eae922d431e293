"""Error against device count: the same bf16 (or fp16) attention on 1, 2, 4, 8 devices, each
tensor's max error against the float64 oracle divided by the error of dense attention run in
the same dtype (the numerics policy's control). The policy allows a ratio of 2 (plus a small
floor); on top, the error may grow at most ``GROWTH_LIMIT`` from 1 device to N: a ring that
accumulated or sent dK/dV in bf16 shows an error growing with the ring.

    python -m parity scaling                          # CPU: 8 simulated JAX devices, gloo worlds
    python -m parity scaling --devices gpu --plot error-vs-devices.png

The docs' figure (docs/numerics-at-scale.md) comes from this command.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np

from ..core.cases import Case
from ..core.inputs import TENSORS
from ..core.names import Device
from ..runners.base import Runner
from ..runners.pipeline import check_case

# How much more error than on one device a sharded run may show (max error, per tensor). The
# policy's 2× of the dense control is too loose to see R-dependent loss: measured, a ring that
# sent dK/dV in bf16 grows the dk error 3.2× from 1 to 8 devices and still passes the policy.
GROWTH_LIMIT = 1.25

# One case per strategy family; ``ring`` (or ``ulysses``) is set per device count.
BASE = Case(seq=512, heads=8, kv_heads=2, head_dim=32, layout="zigzag", causal=True, dtype="bfloat16")
STRATEGIES = ("ring", "ulysses", "allgather")
ScalingStrategy = Literal["ring", "ulysses", "allgather"]


@dataclass(frozen=True)
class Point:
    """One framework on one device count: per tensor, max error / the control's max error."""

    framework: str
    strategy: str
    devices: int
    ratio: dict[str, float]
    error: dict[str, float]
    ok: bool
    floor: dict[str, float]  # the policy's absolute floor for each tensor (LOWP_ABS_FLOOR × max |ref|)


def case_for(strategy: ScalingStrategy, devices: int, base: Case = BASE) -> Case:
    if strategy == "ulysses":
        return replace(base, ulysses=devices)
    return replace(base, ring=devices, kv_exchange="allgather" if strategy == "allgather" and devices > 1 else "ring")


def measure(runner: Runner, framework: str, strategies=STRATEGIES, device_counts=(1, 2, 4, 8), base: Case = BASE,
            seed: int = 0, devices: Device = "cpu") -> list[Point]:
    """Run ``runner`` on every (strategy, device count) through ``check_case``; a case that
    raises or does not fit the machine is an error here (the probe needs every point)."""
    if base.dtype == "float32":
        raise ValueError("the scaling probe compares with the dense same-dtype control: use bfloat16 or float16")
    points = []
    for strategy in strategies:
        for n in device_counts:
            case = case_for(strategy, n, base)
            side = check_case(case, runner, seed=seed, devices=devices)
            if not side.checks:
                raise RuntimeError(f"{framework} {case.name} {side.status}: {side.detail}")
            ref = {c.name: c for c in side.checks}
            control_err = {c.name: c.control_error for c in side.checks}
            points.append(Point(framework, strategy, n, {t: ref[t].max_abs_error / max(control_err[t], 1e-30)
                                                         for t in TENSORS},
                                {t: ref[t].max_abs_error for t in TENSORS}, side.status == "passed",
                                {t: ref[t].floor for t in TENSORS}))
    return points


def growth(points: list[Point]) -> dict[tuple[str, str, int], dict[str, float]]:
    """(framework, strategy, devices) -> per tensor, max error / the same strategy's on one device,
    each error raised to at least the policy's absolute floor (lse is float32 in every dtype: its
    1e-7-level errors are noise, not growth)."""
    one = {(p.framework, p.strategy): p for p in points if p.devices == 1}

    def floored(p, t):
        return max(p.error[t], p.floor[t])

    return {(p.framework, p.strategy, p.devices): {t: floored(p, t) / floored(one[(p.framework, p.strategy)], t)
                                                   for t in TENSORS}
            for p in points if (p.framework, p.strategy) in one}


def excessive_growth(points: list[Point]) -> dict:
    """The growth entries over ``GROWTH_LIMIT``."""
    return {key: g for key, g in growth(points).items() if max(g.values()) > GROWTH_LIMIT}


def plot(points: list[Point], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STRATEGIES), figsize=(4.2 * len(STRATEGIES), 3.6), sharey=True)
    for ax, strategy in zip(np.atleast_1d(axes), STRATEGIES):
        for framework, marker in (("jax", "o"), ("torch", "s")):
            rows = [p for p in points if p.strategy == strategy and p.framework == framework]
            for tensor, color in zip(TENSORS, ("C0", "C1", "C2", "C3", "C4")):
                if rows:
                    ax.plot([p.devices for p in rows], [p.ratio[tensor] for p in rows], marker=marker, color=color,
                            linestyle="-" if framework == "jax" else "--", label=f"{framework} {tensor}")
        ax.axhline(2.0, color="k", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_title(strategy)
        ax.set_xlabel("devices")
    np.atleast_1d(axes)[0].set_ylabel("max error / dense same-dtype control")
    np.atleast_1d(axes)[-1].legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_scaling(devices: Device = "cpu", counts=(1, 2, 4, 8), dtype: str = "bfloat16", seq: int = BASE.seq,
                frameworks=("jax", "torch"), seed: int = 0, plot_path: str | None = None,
                json_path: str | None = None) -> int:
    """``python -m parity scaling``: measure, print the table, optionally write points / figure."""
    from ..runners.base import Unavailable, load_runner
    from ..runners.torch_world import close_worlds

    base = replace(BASE, dtype=dtype, seq=seq)
    points = []
    try:
        for framework in frameworks:
            runner = load_runner(framework)
            if isinstance(runner, Unavailable):
                print(f"{framework}: skipped ({runner.reason})")
                continue
            fits = [n for n in counts if n <= runner.device_count(devices)]
            points += measure(runner, framework, device_counts=fits, base=base, seed=seed, devices=devices)
    finally:
        close_worlds()
    print(f"{'framework':9} {'strategy':9} {'dev':>3}  " + "  ".join(f"{t:>6}" for t in TENSORS) + "   (max error / control's)")
    grown, too_much = growth(points), excessive_growth(points)
    for p in points:
        g = grown.get((p.framework, p.strategy, p.devices), {})
        grew = (p.framework, p.strategy, p.devices) in too_much
        print(f"{p.framework:9} {p.strategy:9} {p.devices:>3}  " + "  ".join(f"{p.ratio[t]:6.2f}" for t in TENSORS)
              + ("" if p.ok else "   FAIL (policy)") + (f"   FAIL (grew {max(g.values()):.2f}x)" if grew else ""))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(p) for p in points], f, indent=1)
    if plot_path:
        plot(points, plot_path, f"{base.dtype}, seq {base.seq}, h{base.heads}/kv{base.kv_heads}, d{base.head_dim}, "
             f"{base.layout} causal, {devices}")
    return 0 if points and all(p.ok for p in points) and not too_much else 1
