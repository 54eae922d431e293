"""``python -m parity <command>``: argument parsing, tables and reports only; the work is done by
the subpackages. Commands (``python -m parity <command> -h`` for their options):

    (none) / run   the parity report: the same permuted NumPy inputs through jax_impl and
                   torch_impl, every tensor compared with the float64 oracle and the frameworks
                   with each other; a table, report.json / report.md, then the communication
                   check; exit status 1 on any failure
    list           the names of the cases a run would check
    accounting     the communication model against XLA's HLO and torch's trace (parity.checks.traffic)
    bstar          the critical batch of FSDP+TP training (parity.capacity.bstar)
    calibrate      measure this machine's hardware profile (parity.capacity.calibrate)
    scaling        error against device count (parity.probes.scaling)
    determinism    run-to-run determinism per block kernel (parity.probes.determinism)
    peers          ringbridge's block backends and the single-GPU kernels a user could pick
                   instead, verified against a float64 truth, then timed (parity.probes.kernels)
    balance        computed work per device over packed documents, per layout and ring size,
                   from the schedule alone (parity.probes.balance)

Every command that runs code takes ``--devices cpu|gpu`` with the one default ``cpu`` (8 simulated
JAX devices, gloo worlds). A framework that is not installed is reported as *skipped*, never as
passed, and so is a case that needs more devices than the machine has. An exception inside a
case fails that case (with the traceback's last lines) and the run goes on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .core.cases import Case, full_matrix, pairwise_matrix
from .core.devices import configure_jax_devices
from .core.inputs import ALL_TENSORS
from .core.names import DEFAULT_DEVICES, DEVICES
from .matrix_run import SweepOptions, run_matrix
from .runners.base import FRAMEWORKS, load_runner
from .runners.pipeline import STATUSES, CaseResult, Side

COMMANDS = ("run", "list", "accounting", "bstar", "calibrate", "scaling", "determinism", "peers", "balance")


def _masked(case: Case) -> bool:
    return (case.documents != "none" or case.window is not None or case.sinks or case.softcap is not None
            or case.token_index)


def _sample_key(case: Case) -> tuple:
    """What the default report samples once: each strategy with packed documents, and each with
    a window or sinks (no documents); of the soft-capped cases and of the token-index cases, the
    first without Ulysses and the first with it (``parity.core.cases.softcap_cases``,
    ``token_index_cases``)."""
    if case.token_index:
        return "token index", case.ulysses > 1
    if case.softcap is not None:
        return "softcap", case.ulysses > 1
    return case.strategy, case.documents != "none"


def select_cases(full: bool, name_filter: str = "", masks: str = "sample") -> list[Case]:
    """The all-pairs matrix (or the full cross product), keeping names that contain every word
    of ``name_filter``. ``masks="sample"`` (the default report, held to its time budget on two
    cores) keeps, of the all-pairs matrix's packed-document, window and sink cases, the first of
    each ``_sample_key``; ``"all"`` keeps every one of them (the test suite runs them all)."""
    cases = full_matrix() if full else pairwise_matrix()
    if not full and masks == "sample":
        seen: set[tuple] = set()
        cases = [c for c in cases if not _masked(c) or (_sample_key(c) not in seen and not seen.add(_sample_key(c)))]
    return [c for c in cases if all(term in c.name for term in name_filter.split())]


def _counts(results: list[CaseResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def _fmt(side: Side | None, tensor: str) -> str:
    return f"{side.errors[tensor]:.1e}" if side and tensor in side.errors else "-"


def _write_reports(out: Path, results: list[CaseResult], seed: int, seconds: float, devices: str,
                   sweep: tuple | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = _counts(results)
    payload = {"seed": seed, "devices": devices, "seconds": round(seconds, 1), "summary": summary,
               "results": [r.to_dict() for r in results]}
    if sweep is not None:
        rows, crosses = sweep
        payload["backend_sweep"] = {"rows": [r.to_dict() for r in rows],
                                    "jax_vs_torch": [{"case": c.name, "backend": b, "status": s.status,
                                                      "errors": s.errors, "detail": s.detail} for c, b, s in crosses]}
    (out / "report.json").write_text(json.dumps(payload, indent=1))
    head = "| case | mode | status | " + " | ".join(f"{t} jax / torch / x" for t in ALL_TENSORS) + " |"
    lines = ["# ringbridge parity report", "",
             (f"seed {seed}, devices {devices}: {summary['passed']} passed, {summary['failed']} failed, "
             f"{summary['skipped']} skipped in {seconds:.0f} s. Errors: float32 relative, low precision max-abs "
             "(docs/contract.md); x = JAX vs torch; mode: mesh = the real collectives, replay = every virtual device's "
             "work run in turn on one device (too few devices for the mesh); dsinks only for cases with attention sinks."),
             "", head, "|---" * (3 + len(ALL_TENSORS)) + "|"]
    for r in results:
        j, t = r.sides.get("jax"), r.sides.get("torch")
        cells = " | ".join(f"{_fmt(j, n)} / {_fmt(t, n)} / {_fmt(r.cross, n)}" for n in ALL_TENSORS)
        lines.append(f"| {r.case.name} | {r.mode} | {r.status} | {cells} |")
    problems = [(r.case.name, f, s) for r in results for f, s in [*r.sides.items(), ("jax-vs-torch", r.cross)]
                if s is not None and s.status != "passed"]
    if problems:
        lines += ["", "## Not passed", ""] + [f"- `{n}` {f} **{s.status}**: {s.detail.strip()}" for n, f, s in problems]
    text = "\n".join(lines) + "\n"
    if sweep is not None:
        from .probes.backend_sweep import sweep_markdown

        text += "\n" + sweep_markdown(*sweep)
    (out / "report.md").write_text(text)


def _print_table(results: list[CaseResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="max error per tensor vs the float64 oracle — jax / torch (x: jax vs torch)")
    table.add_column("case", no_wrap=True)
    table.add_column("mode")
    table.add_column("status")
    for t in ALL_TENSORS:
        table.add_column(t, no_wrap=True)
    style = {"passed": "green", "failed": "bold red", "skipped": "yellow"}
    for r in results:
        j, t = r.sides.get("jax"), r.sides.get("torch")
        table.add_row(r.case.name, r.mode, f"[{style[r.status]}]{r.status}[/]",
                      *(f"{_fmt(j, n)} / {_fmt(t, n)}" for n in ALL_TENSORS))
    console = Console(width=220)
    console.print(table)
    for r in results:
        for f, s in [*r.sides.items(), ("jax-vs-torch", r.cross)]:
            if s is not None and s.status == "failed":
                console.print(f"[bold red]FAILED[/] {r.case.name} {f}: {s.detail.strip()}", highlight=False)
    reasons = {(f, s.detail) for r in results for f, s in r.sides.items() if s.status == "skipped"}
    for f, why in sorted(reasons):
        console.print(f"[yellow]skipped[/] {f}: {why}", highlight=False)


def _frameworks(parser, text: str) -> list[str]:
    frameworks = [f.strip() for f in text.split(",") if f.strip()]
    if set(frameworks) - set(FRAMEWORKS) or not frameworks:
        parser.error(f"--frameworks must be a subset of {FRAMEWORKS}, got {text!r}")
    return frameworks


def run_report(args, parser) -> int:
    """The default command: every selected case through every framework, then the
    communication check of the configurations the filter selects."""
    frameworks = _frameworks(parser, args.frameworks)
    cases = select_cases(args.full, args.filter, args.masks)
    if not cases:
        parser.error(f"no case matches --filter {args.filter!r} (see `python -m parity list`)")
    configure_jax_devices(args.devices)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"ringbridge parity: {len(cases)} cases x {frameworks} on {args.devices}, seed {seed} "
          f"(reproduce with --seed {seed})")
    runners = {f: load_runner(f) for f in frameworks}
    from rich.progress import track

    sweep = (SweepOptions(args.sweep_seq, args.sweep_head_dim)
             if args.backend_sweep == "on" or (args.backend_sweep == "auto" and args.devices == "gpu") else None)
    run = run_matrix(cases, runners, seed, args.devices, sweep=sweep, accounting=not args.no_accounting,
                     name_filter=args.filter, progress=track,
                     checkpoint=lambda results, seconds: _write_reports(args.out, results, seed, seconds, args.devices))
    results, sweep, verdicts, seconds = run.results, run.sweep, run.verdicts, run.seconds
    mismatches = 0
    _print_table(results)
    if verdicts:
        from .checks.traffic import print_verdicts

        mismatches = print_verdicts(verdicts)
    _write_reports(args.out, results, seed, seconds, args.devices, sweep)
    counts = _counts(results)
    sweep_failed = 0
    if sweep is not None:
        sweep_failed = sum(r.side.status == "failed" for r in sweep[0]) + sum(s.status == "failed" for *_, s in sweep[1])
        print(f"backend sweep: {sum(r.side.status == 'passed' for r in sweep[0])} passed, "
              f"{sum(r.side.status == 'failed' for r in sweep[0])} failed, "
              f"{sum(r.side.status == 'skipped' for r in sweep[0])} skipped (framework:backend x case); "
              f"jax-vs-torch {sum(s.status == 'passed' for *_, s in sweep[1])}/{len(sweep[1])} passed")
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"in {seconds:.0f} s; reports in {args.out}/")
    if verdicts:
        from .checks.traffic import summary

        print(f"communication and compute: {summary(verdicts)}")
    return 1 if counts["failed"] or not counts["passed"] or mismatches or sweep_failed else 0


def _list(args, parser) -> int:
    print("\n".join(c.name for c in select_cases(args.full, args.filter, args.masks)))
    return 0


def _accounting(args, parser) -> int:
    from .checks.traffic import run_accounting

    configure_jax_devices(args.devices)
    return run_accounting(_frameworks(parser, args.frameworks), args.devices, args.filter)


def _bstar(args, parser) -> int:
    from .capacity.bstar import print_table

    return print_table(args.preset, args.chips, args.hardware)


def _calibrate(args, parser) -> int:
    from .capacity.calibrate import calibrate

    try:
        return calibrate(args.devices, args.world, args.small, args.predict, args.name, args.out)
    except ValueError as err:
        parser.error(str(err))


def _scaling(args, parser) -> int:
    from .probes.scaling import run_scaling

    configure_jax_devices(args.devices)
    return run_scaling(args.devices, tuple(int(n) for n in args.counts.split(",")), args.dtype, args.seq,
                       _frameworks(parser, args.frameworks), args.seed, args.plot, args.json)


def _determinism(args, parser) -> int:
    from .probes.determinism import run_determinism

    configure_jax_devices(args.devices)
    return run_determinism(args.devices, args.ring, args.seq, args.heads, args.head_dim, args.repeats,
                           _frameworks(parser, args.frameworks), args.jax_backends.split(","),
                           args.torch_backends.split(","), args.json, kv_heads=args.kv_heads,
                           documents=args.documents)


def _peers(args, parser) -> int:
    """Everything after ``peers`` goes to parity.probes.kernels' own parser; on the CPU a reduced
    run (portable kernels, the peers that run on a CPU, 128-token blocks, no timing)."""
    configure_jax_devices(args.devices)
    from .probes.kernels import main as kernels_main

    rest = list(args.rest)
    if args.devices == "cpu":
        rest = ["--backends", "reference", "--peers", "cpu", "--tokens", "128", "--head-dims", "64",
                "--no-timing", *rest]
    if "--out" not in rest:
        rest += ["--out", "parity-peers"]
    return kernels_main(rest, prog="python -m parity peers")


def _balance(args, parser) -> int:
    from .probes.balance import run_balance

    try:
        return run_balance(_ints(parser, "--tokens", args.tokens), _ints(parser, "--rings", args.rings), args.tile,
                           args.json)
    except ValueError as err:
        parser.error(str(err))


def _ints(parser, option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        parser.error(f"{option} must be comma-separated integers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parity", description="ringbridge's parity harness: one command per check.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[1])  # the commands
    sub = parser.add_subparsers(dest="command", metavar="command")

    def command(name: str, fn, help: str, devices: bool = True, frameworks: bool = False):
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn, parser=p)
        if devices:
            p.add_argument("--devices", choices=DEVICES, default=DEFAULT_DEVICES,
                           help="cpu: 8 simulated JAX devices and gloo worlds; gpu: GPUs and NCCL (default: %(default)s)")
        if frameworks:
            p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated subset of jax,torch")
        return p

    for name in ("run", "list"):
        p = command(name, run_report if name == "run" else _list,
                    "the parity report (default command)" if name == "run" else "print the selected case names",
                    devices=name == "run", frameworks=name == "run")
        p.add_argument("--full", action="store_true", help="the whole cross product instead of all-pairs")
        p.add_argument("--filter", default="", help="keep cases whose name contains every word of EXPR")
        p.add_argument("--masks", choices=("sample", "all"), default="sample",
                       help="of the packed-document / window / sink cases: the first of each strategy (default) or all")
        if name == "run":
            p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
            p.add_argument("--out", type=Path, default=Path("parity-report"))
            p.add_argument("--backend-sweep", choices=("auto", "on", "off"), default="auto",
                           help="every block backend of each framework through GPU-sized cases "
                                "(parity.probes.backend_sweep; auto: on for --devices gpu)")
            p.add_argument("--sweep-seq", type=int, default=8192, help="tokens of the sweep's ring-2 cases")
            p.add_argument("--sweep-head-dim", type=int, default=128)
            p.add_argument("--no-accounting", action="store_true",
                           help="skip the closing communication check (one configuration per model path; "
                                "python -m parity accounting checks them all)")

    p = command("accounting", _accounting, "communication model == XLA HLO == torch trace", frameworks=True)
    p.add_argument("--filter", default="", help="keep configurations whose name contains every word")

    from .capacity.bstar import PRESETS

    p = command("bstar", _bstar, "critical batch B* of FSDP+TP training", devices=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cs336-xxl")
    p.add_argument("--chips", type=int, default=None, help="N (devices) for the optimal-X rows")
    p.add_argument("--hardware", default=None,
                   help="a profile name in parity/capacity/profiles or a JSON file (python -m parity calibrate "
                        "writes one) instead of the preset's hardware")

    p = command("calibrate", _calibrate, "measure C and W per collective kind into a hardware profile")
    p.add_argument("--world", type=int, default=None, help="processes (default: all GPUs; 4 on CPU)")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke runs, tests)")
    p.add_argument("--predict", action="store_true", help="also time the FSDP+TP step and USP attention")
    p.add_argument("--name", default=None, help="profile name (default: calibrated-<devices><world>)")
    p.add_argument("--out", type=Path, default=Path("calibration"))

    from .probes.scaling import BASE

    p = command("scaling", _scaling, "error against device count (bf16 / fp16)", frameworks=True)
    p.add_argument("--counts", default="1,2,4,8", help="device counts (those above the machine's are skipped)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--seq", type=int, default=BASE.seq)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    p.add_argument("--json", default=None, help="write the points here")

    p = command("peers", _peers, "block backends and peer kernels: verified, then timed (parity.probes.kernels; "
                "its other options: --out, --tokens, --bench-tokens, --backends, --peers, --no-timing, ...)")

    p = command("determinism", _determinism, "run-to-run determinism per block kernel", frameworks=True)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--documents", default=None, help="a balance mix (short, heavy-tail, few-long): packed documents")
    p.add_argument("--jax-backends", default="reference,cudnn,fa3")
    p.add_argument("--torch-backends", default="reference,aten_flash,aten_cudnn")
    p.add_argument("--json", default=None)

    p = command("balance", _balance, "computed work per device over packed documents, from the schedule (no kernels)",
                devices=False)
    p.add_argument("--tokens", default="65536,131072", help="sequence lengths (comma-separated)")
    p.add_argument("--rings", default="2,4,8", help="ring sizes (comma-separated)")
    p.add_argument("--tile", type=int, default=128, help="tile edge of a tile-skipping kernel (count (b))")
    p.add_argument("--json", default=None, help="write the rows here")
    return parser


def main(argv=None) -> int:
    """Parse ``argv`` (the parity report when no command is named) and run the command."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "run")
    parser = build_parser()
    if argv[0] == "peers":  # the kernels probe parses the rest itself
        args, rest = parser.parse_known_args(argv)
        args.rest = rest
    else:
        args = parser.parse_args(argv)
    return args.fn(args, args.parser)
