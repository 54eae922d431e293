"""``python -m parity``: run the case matrix through each installed framework, compare every
tensor with the float64 oracle, print a table, write report.json / report.md, exit non-zero on
any failure. A framework that is not installed is reported as *skipped*, never as passed; an
exception inside a case fails that case (with the traceback's last lines) and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .cases import Case, full_matrix, pairwise_matrix
from .compare import compare
from .inputs import TENSORS, make_inputs, oracle

FRAMEWORKS = ("jax", "torch")


@dataclass
class Outcome:
    """One (case, framework) result: status is passed / failed / skipped."""

    case: Case
    framework: str
    status: str
    errors: dict[str, float] = field(default_factory=dict)  # tensor -> error in the policy's metric
    detail: str = ""


def _setup_devices(devices: str) -> None:
    if devices == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()


def _runner(framework: str):
    """The framework's runner module, or None with the reason it is unavailable."""
    try:
        importlib.import_module(framework)
        return importlib.import_module(f"parity.run_{framework}"), ""
    except ImportError as err:
        return None, f"{framework} not available: {err}"


def run_one(case: Case, framework: str, runner, seed: int, devices: str = "cpu") -> Outcome:
    try:
        x = make_inputs(case, seed)
        got = runner.run_case(case, x, devices=devices)
        control = None if case.dtype == "float32" else runner.run_control(case, x)
        checks = compare(case, got, oracle(case, x), control)
    except Exception:  # noqa: BLE001 — a broken case is a failed case, the run continues
        tail = "".join(traceback.format_exc().strip().splitlines(keepends=True)[-3:])
        return Outcome(case, framework, "failed", detail=tail)
    bad = [str(c) for c in checks if not c.ok]
    return Outcome(case, framework, "failed" if bad else "passed", {c.name: c.error for c in checks}, "; ".join(bad))


def _select(args) -> list[Case]:
    cases = full_matrix() if args.full else pairwise_matrix()
    if args.filter:
        cases = [c for c in cases if all(term in c.name for term in args.filter.split())]
    return cases


def _write_reports(out: Path, outcomes: list[Outcome], seed: int, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"case": o.case.to_dict(), "framework": o.framework, "status": o.status, "errors": o.errors,
             "detail": o.detail} for o in outcomes]
    summary = {s: sum(o.status == s for o in outcomes) for s in ("passed", "failed", "skipped")}
    (out / "report.json").write_text(json.dumps({"seed": seed, "seconds": seconds, "summary": summary,
                                                 "results": rows}, indent=1))
    lines = [f"# ringbridge parity report", "", f"seed {seed}; {summary}; {seconds:.0f} s", "",
             "| case | framework | status | " + " | ".join(TENSORS) + " |", "|---" * (3 + len(TENSORS)) + "|"]
    for o in outcomes:
        errs = " | ".join(f"{o.errors[t]:.1e}" if t in o.errors else "" for t in TENSORS)
        lines.append(f"| {o.case.name} | {o.framework} | {o.status} | {errs} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _print_table(outcomes: list[Outcome]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parity vs float64 oracle (float32: relative error; low precision: max abs error)")
    table.add_column("case", no_wrap=True)
    for col in ("fw", "status", *TENSORS):
        table.add_column(col)
    for o in outcomes:
        style = {"passed": "green", "failed": "bold red", "skipped": "yellow"}[o.status]
        table.add_row(o.case.name, o.framework, f"[{style}]{o.status}[/]",
                      *(f"{o.errors[t]:.1e}" if t in o.errors else "" for t in TENSORS))
    Console(width=200).print(table)
    skipped = {o.framework: o.detail for o in outcomes if o.status == "skipped"}
    for framework, why in skipped.items():
        print(f"SKIPPED {framework}: {why}")
    for o in outcomes:
        if o.status == "failed":
            print(f"FAILED {o.framework} {o.case.name}: {o.detail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="run", choices=("run", "list"))
    parser.add_argument("--full", action="store_true", help="the whole cross product instead of all-pairs")
    parser.add_argument("--filter", default="", help="keep cases whose name contains every word of EXPR")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    parser.add_argument("--devices", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--frameworks", default="jax,torch")
    parser.add_argument("--out", type=Path, default=Path("parity-report"))
    args = parser.parse_args(argv)
    cases = _select(args)
    if args.command == "list":
        print("\n".join(c.name for c in cases))
        return 0
    _setup_devices(args.devices)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"ringbridge parity: {len(cases)} cases, seed {seed} (reproduce with --seed {seed})")
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = set(frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {FRAMEWORKS}")
    from rich.progress import track

    start, outcomes = time.time(), []
    for framework in frameworks:
        runner, why = _runner(framework)
        if runner is None:
            outcomes += [Outcome(c, framework, "skipped", detail=why) for c in cases]
            continue
        for case in track(cases, description=f"{framework:>5}"):
            outcomes.append(run_one(case, framework, runner, seed, args.devices))
    if "torch" in frameworks:
        from .torch_world import close_worlds

        close_worlds()
    seconds = time.time() - start
    _print_table(outcomes)
    _write_reports(args.out, outcomes, seed, seconds)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("passed", "failed", "skipped")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"in {seconds:.0f} s; reports in {args.out}/")
    return 1 if counts["failed"] or not counts["passed"] else 0
