"""The parity report's work (``python -m parity``'s default command; ``parity.cli`` parses and
prints): every case through every framework, then — as asked — the block-backend sweep and the
communication check of the configurations the filter selects, returned as one typed record."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .core.cases import Case
from .runners.base import Runner, Unavailable
from .runners.pipeline import CaseResult, run_case_everywhere


@dataclass(frozen=True)
class SweepOptions:
    """The block-backend sweep's problem size (``parity.probes.backend_sweep``)."""

    seq: int
    head_dim: int


@dataclass
class MatrixRun:
    """What one parity run produced: the cases' results, the sweep's (None: not run), the
    communication verdicts (empty: not run) and the wall time."""

    results: list[CaseResult]
    sweep: tuple | None
    verdicts: list
    seconds: float


def run_matrix(cases: list[Case], runners: dict[str, Runner | Unavailable], seed: int, devices: str, *,
               sweep: SweepOptions | None, accounting: bool, name_filter: str,
               checkpoint: Callable[[list[CaseResult], float], None] | None = None,
               progress: Callable = lambda items, **_: items) -> MatrixRun:
    """Every case through every runner, ``checkpoint(results, seconds)`` once the cases are done
    (a run cut short later keeps them), then the sweep and the communication check."""
    from .runners.torch_world import close_worlds

    available = [f for f, r in runners.items() if not isinstance(r, Unavailable)]
    start = time.time()
    swept, verdicts = None, []
    try:
        results = [run_case_everywhere(c, runners, seed, devices) for c in progress(cases, description="cases")]
        if checkpoint is not None:
            checkpoint(results, time.time() - start)
        if sweep is not None:
            from .probes.backend_sweep import SWEEP_BACKENDS, run_sweep, sweep_cases

            swept = run_sweep(sweep_cases(seq=sweep.seq, head_dim=sweep.head_dim),
                              {f: SWEEP_BACKENDS[f] for f in runners}, devices, seed)
        if accounting and available:
            from .checks.traffic import run_all

            limit = min(runners[f].device_count(devices) for f in available)
            verdicts = run_all(available, devices, name_filter, limit, every_config=False)
    finally:
        close_worlds()
    return MatrixRun(results, swept, verdicts, time.time() - start)
