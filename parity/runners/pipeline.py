"""The one parity pipeline — inputs → run → dense control → compare — used by the CLI, the probes,
the notebooks' helpers and the tests alike (``check_case``), and one case through every framework
with the JAX-vs-torch check (``run_case_everywhere``).

A case that needs more devices than the runner has runs through the *replay* of its strategy on
one device when the runner offers one (``runner.replay(devices)``: every virtual device's work in
turn, same schedule and kernels, communication by indexing), else it is *skipped*; the verdict's
``mode`` says which ("mesh" or "replay"). An exception inside a case fails that case with the
traceback's last lines, and the caller goes on.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from ..core.cases import Case
from ..core.compare import compare, compare_frameworks
from ..core.inputs import Inputs, flash_ideal, make_inputs, oracle
from ..core.names import Device
from ..core.numerics import TensorCheck
from .base import FRAMEWORKS, Runner, Unavailable

Status = Literal["passed", "failed", "skipped"]
STATUSES: tuple[str, ...] = get_args(Status)


@dataclass
class Side:
    """One framework's verdict on one case. ``errors``: tensor -> error in the policy's metric;
    ``results`` / ``control``: the runner's tensors and its dense same-dtype control (None for
    float32 cases, which need none); ``mode``: "mesh" (the real collectives) or "replay" (every
    virtual device's work on one device)."""

    status: Status
    errors: dict[str, float] = field(default_factory=dict)
    detail: str = ""
    checks: list[TensorCheck] = field(default_factory=list, repr=False)
    results: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    control: dict[str, np.ndarray] | None = field(default=None, repr=False)
    mode: str = "mesh"


@dataclass
class CaseResult:
    """Every side of one case plus the JAX-vs-torch check (when both ran)."""

    case: Case
    sides: dict[str, Side]
    cross: Side | None = None

    @property
    def status(self) -> Status:
        parts = [*self.sides.values(), *([self.cross] if self.cross else [])]
        if any(p.status == "failed" for p in parts):
            return "failed"
        return "passed" if any(p.status == "passed" for p in parts) else "skipped"

    @property
    def mode(self) -> str:
        """"replay" when any framework replayed the case on one device, else "mesh"."""
        return "replay" if any(s.mode == "replay" for s in self.sides.values()) else "mesh"

    def to_dict(self) -> dict:
        def side(s):
            return {"status": s.status, "mode": s.mode, "errors": s.errors, "detail": s.detail}

        return {"case": self.case.to_dict(), "status": self.status, "mode": self.mode,
                "sides": {f: side(s) for f, s in self.sides.items()},
                "jax_vs_torch": side(self.cross) if self.cross else None}


def _tail() -> str:
    return "".join(traceback.format_exc().strip().splitlines(keepends=True)[-3:])


def check_case(case: Case, runner: Runner | Unavailable, *, seed: int | None = None, x: Inputs | None = None,
               ref: dict | None = None, devices: Device = "cpu", control: dict | None = None,
               started: Callable[[], dict] | None = None, ideal: dict | None = None) -> Side:
    """Run ``case`` with ``runner`` and judge every tensor under the numerics policy.

    Inputs are ``x`` or drawn from ``seed``; ``ref`` is the oracle's answer (computed when not
    given, and then for a low-precision case the flash ideal too: ``ideal``, the policy's second
    control, which a caller giving ``ref`` gives or not). ``control`` replaces the runner's dense
    same-dtype control (a low-precision case needs one; float32 does not). ``started``: the result
    of the runner's ``start_case`` on the same inputs, when the caller started it earlier to
    overlap it with other work."""
    if isinstance(runner, Unavailable):
        return Side("skipped", detail=runner.reason)
    have = runner.device_count(devices)
    if case.devices > have:
        if not hasattr(runner, "replay"):
            return Side("skipped", detail=f"needs {case.devices} devices, {devices} has {have}")
        runner, started = runner.replay(devices), None  # the same backend, every device's work on one
    mode = getattr(runner, "mode", "mesh")
    if x is None:
        if seed is None:
            raise ValueError("check_case needs inputs x or a seed to draw them from")
        x = make_inputs(case, seed)
    try:
        if ref is None:
            ref, ideal = oracle(case, x), flash_ideal(case, x) if ideal is None and case.dtype != "float32" else ideal
        got = started() if started is not None else runner.run_case(case, x, devices=devices)
        if control is None and case.dtype != "float32":
            control = runner.run_control(case, x)
        checks = compare(case, got, ref, control, ideal)
    except Exception:  # noqa: BLE001 — a broken case is a failed case; the caller continues
        return Side("failed", detail=_tail(), mode=mode)
    bad = "; ".join(str(c) for c in checks if not c.ok)
    return Side("failed" if bad else "passed", {c.name: c.error for c in checks}, bad, checks, got, control, mode)


def cross_check(case: Case, jax_side: Side, torch_side: Side) -> Side:
    """JAX vs torch on identical inputs (both sides must have run)."""
    checks = compare_frameworks(case, jax_side.checks, torch_side.checks, jax_side.results, torch_side.results)
    bad = "; ".join(str(c) for c in checks if not c.ok)
    mode = "replay" if "replay" in (jax_side.mode, torch_side.mode) else "mesh"
    return Side("failed" if bad else "passed", {c.name.split()[0]: c.error for c in checks}, bad, checks, mode=mode)


def _start(case: Case, runner, x: Inputs, devices: Device):
    """The runner's case started in the background (torch's ranks are other processes), or None
    when it cannot be (no ``start_case``, too few devices, or it failed to start: ``check_case``
    then runs it the ordinary way and reports what happens)."""
    start = getattr(runner, "start_case", None)
    if start is None or isinstance(runner, Unavailable) or case.devices > runner.device_count(devices):
        return None
    try:
        return start(case, x, devices=devices)
    except Exception:  # noqa: BLE001 — check_case runs it again and reports the failure
        return None


def run_case_everywhere(case: Case, runners: dict[str, Runner | Unavailable], seed: int,
                        devices: Device = "cpu") -> CaseResult:
    """One case through every framework in ``runners`` on one set of inputs, then JAX vs torch.
    A runner that can start a case in the background (torch) starts first, so its ranks compute
    while this process runs the others (JAX compiles): measured on 2 cores, 12 matrix cases took
    12-14 s this way against 15-16 s one framework after the other."""
    x = make_inputs(case, seed)
    ref = oracle(case, x)
    ideal = flash_ideal(case, x) if case.dtype != "float32" else None
    started = {f: _start(case, r, x, devices) for f, r in runners.items()}
    sides = {f: check_case(case, r, x=x, ref=ref, devices=devices, started=started[f], ideal=ideal)
             for f, r in runners.items()}
    cross = None
    if all(f in sides and sides[f].checks for f in FRAMEWORKS):
        cross = cross_check(case, sides["jax"], sides["torch"])
    return CaseResult(case, sides, cross)
