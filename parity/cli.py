"""``python -m parity``: the same permuted NumPy inputs through jax_impl and torch_impl, every
tensor compared with the float64 oracle and the two frameworks with each other; a table, then
report.json / report.md; exit status 1 on any failure.

A framework that is not installed is reported as *skipped*, never as passed, and so is a case
that needs more devices than the machine has. An exception inside a case fails that case (with
the traceback's last lines) and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .cases import Case, full_matrix, pairwise_matrix
from .compare import compare, compare_frameworks
from .devices import configure_jax_devices
from .inputs import TENSORS, make_inputs, oracle

FRAMEWORKS = ("jax", "torch")
STATUSES = ("passed", "failed", "skipped")


@dataclass
class Side:
    """One framework's verdict on one case. ``errors``: tensor -> error in the policy's metric."""

    status: str
    errors: dict[str, float] = field(default_factory=dict)
    detail: str = ""
    checks: list = field(default_factory=list, repr=False)
    results: dict = field(default_factory=dict, repr=False)


@dataclass
class CaseResult:
    """Every side of one case plus the JAX-vs-torch check (when both ran)."""

    case: Case
    sides: dict[str, Side]
    cross: Side | None = None

    @property
    def status(self) -> str:
        parts = [*self.sides.values(), *([self.cross] if self.cross else [])]
        if any(p.status == "failed" for p in parts):
            return "failed"
        return "passed" if any(p.status == "passed" for p in parts) else "skipped"

    def to_dict(self) -> dict:
        side = lambda s: {"status": s.status, "errors": s.errors, "detail": s.detail}  # noqa: E731
        return {"case": self.case.to_dict(), "status": self.status,
                "sides": {f: side(s) for f, s in self.sides.items()},
                "jax_vs_torch": side(self.cross) if self.cross else None}


def load_runner(framework: str):
    """The framework's runner module, or (None, reason) when it cannot be imported."""
    try:
        importlib.import_module(framework)
        return importlib.import_module(f"parity.run_{framework}"), ""
    except ImportError as err:
        return None, f"{framework} not available: {err}"


def _tail() -> str:
    return "".join(traceback.format_exc().strip().splitlines(keepends=True)[-3:])


def run_side(case: Case, runner, x, ref, devices: str) -> Side:
    have = runner.device_count(devices)
    if case.devices > have:
        return Side("skipped", detail=f"needs {case.devices} devices, {devices} has {have}")
    try:
        got = runner.run_case(case, x, devices=devices)
        control = None if case.dtype == "float32" else runner.run_control(case, x)
        checks = compare(case, got, ref, control)
    except Exception:  # noqa: BLE001 — a broken case is a failed case; the run continues
        return Side("failed", detail=_tail())
    bad = "; ".join(str(c) for c in checks if not c.ok)
    return Side("failed" if bad else "passed", {c.name: c.error for c in checks}, bad, checks, got)


def run_case_everywhere(case: Case, runners: dict, seed: int, devices: str) -> CaseResult:
    """One case through every framework in ``runners`` (framework -> runner module, or a reason
    string when unavailable), on one set of inputs."""
    x = make_inputs(case, seed)
    ref = oracle(case, x)
    sides = {f: (Side("skipped", detail=r) if isinstance(r, str) else run_side(case, r, x, ref, devices))
             for f, r in runners.items()}
    cross = None
    if all(f in sides and sides[f].checks for f in FRAMEWORKS):
        j, t = sides["jax"], sides["torch"]
        checks = compare_frameworks(case, j.checks, t.checks, j.results, t.results)
        bad = "; ".join(str(c) for c in checks if not c.ok)
        cross = Side("failed" if bad else "passed", {c.name.split()[0]: c.error for c in checks}, bad)
    return CaseResult(case, sides, cross)


def _select(args) -> list[Case]:
    cases = full_matrix() if args.full else pairwise_matrix()
    if args.filter:
        cases = [c for c in cases if all(term in c.name for term in args.filter.split())]
    return cases


def _counts(results: list[CaseResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def _fmt(side: Side | None, tensor: str) -> str:
    return f"{side.errors[tensor]:.1e}" if side and tensor in side.errors else "-"


def _write_reports(out: Path, results: list[CaseResult], seed: int, seconds: float, devices: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = _counts(results)
    (out / "report.json").write_text(json.dumps(
        {"seed": seed, "devices": devices, "seconds": round(seconds, 1), "summary": summary,
         "results": [r.to_dict() for r in results]}, indent=1))
    head = "| case | status | " + " | ".join(f"{t} jax / torch / x" for t in TENSORS) + " |"
    lines = ["# ringbridge parity report", "",
             f"seed {seed}, devices {devices}: {summary['passed']} passed, {summary['failed']} failed, "
             f"{summary['skipped']} skipped in {seconds:.0f} s. Errors: float32 relative, low precision max-abs "
             "(DESIGN.md); x = JAX vs torch.", "", head, "|---" * (2 + len(TENSORS)) + "|"]
    for r in results:
        j, t = r.sides.get("jax"), r.sides.get("torch")
        cells = " | ".join(f"{_fmt(j, n)} / {_fmt(t, n)} / {_fmt(r.cross, n)}" for n in TENSORS)
        lines.append(f"| {r.case.name} | {r.status} | {cells} |")
    problems = [(r.case.name, f, s) for r in results for f, s in [*r.sides.items(), ("jax-vs-torch", r.cross)]
                if s is not None and s.status != "passed"]
    if problems:
        lines += ["", "## Not passed", ""] + [f"- `{n}` {f} **{s.status}**: {s.detail.strip()}" for n, f, s in problems]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _print_table(results: list[CaseResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="max error per tensor vs the float64 oracle — jax / torch (x: jax vs torch)")
    table.add_column("case", no_wrap=True)
    table.add_column("status")
    for t in TENSORS:
        table.add_column(t, no_wrap=True)
    style = {"passed": "green", "failed": "bold red", "skipped": "yellow"}
    for r in results:
        j, t = r.sides.get("jax"), r.sides.get("torch")
        table.add_row(r.case.name, f"[{style[r.status]}]{r.status}[/]",
                      *(f"{_fmt(j, n)} / {_fmt(t, n)}" for n in TENSORS))
    console = Console(width=220)
    console.print(table)
    for r in results:
        for f, s in [*r.sides.items(), ("jax-vs-torch", r.cross)]:
            if s is not None and s.status == "failed":
                console.print(f"[bold red]FAILED[/] {r.case.name} {f}: {s.detail.strip()}", highlight=False)
    reasons = {(f, s.detail) for r in results for f, s in r.sides.items() if s.status == "skipped"}
    for f, why in sorted(reasons):
        console.print(f"[yellow]skipped[/] {f}: {why}", highlight=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="run", choices=("run", "list"))
    parser.add_argument("--full", action="store_true", help="the whole cross product instead of all-pairs")
    parser.add_argument("--filter", default="", help="keep cases whose name contains every word of EXPR")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    parser.add_argument("--devices", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--frameworks", default="jax,torch", help="comma-separated subset of jax,torch")
    parser.add_argument("--out", type=Path, default=Path("parity-report"))
    parser.add_argument("--no-accounting", action="store_true",
                        help="skip the closing communication check (python -m parity accounting)")
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if set(frameworks) - set(FRAMEWORKS) or not frameworks:
        parser.error(f"--frameworks must be a subset of {FRAMEWORKS}, got {args.frameworks!r}")
    cases = _select(args)
    if args.command == "list":
        print("\n".join(c.name for c in cases))
        return 0
    if not cases:
        parser.error(f"no case matches --filter {args.filter!r} (see `python -m parity list`)")
    configure_jax_devices(args.devices)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"ringbridge parity: {len(cases)} cases x {frameworks} on {args.devices}, seed {seed} "
          f"(reproduce with --seed {seed})")
    runners = {}
    for f in frameworks:
        runner, why = load_runner(f)
        runners[f] = runner or why
    from rich.progress import track

    start = time.time()
    mismatches, verdicts = 0, []
    try:
        results = [run_case_everywhere(c, runners, seed, args.devices) for c in track(cases, description="cases")]
        if not args.no_accounting:
            from .accounting_check import run_all

            available = [f for f in frameworks if not isinstance(runners[f], str)]
            limit = min(r.device_count(args.devices) for r in runners.values() if not isinstance(r, str)) if available else 0
            verdicts = run_all(available, args.devices, args.filter, limit) if available else []
    finally:
        if "torch" in frameworks and not isinstance(runners["torch"], str):
            from .torch_world import close_worlds

            close_worlds()
    seconds = time.time() - start
    _print_table(results)
    if verdicts:
        from .accounting_check import print_verdicts

        mismatches = print_verdicts(verdicts)
    _write_reports(args.out, results, seed, seconds, args.devices)
    counts = _counts(results)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"in {seconds:.0f} s; reports in {args.out}/")
    if verdicts:
        print(f"communication: {len(verdicts) - mismatches} of {len(verdicts)} configurations equal the model")
    return 1 if counts["failed"] or not counts["passed"] or mismatches else 0
