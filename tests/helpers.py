"""Helpers shared by the test tiers (plain functions, not fixtures — those are in conftest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from parity.core.cases import Case, full_matrix, pairwise_matrix
from parity.runners.pipeline import Side

FULL = os.environ.get("RINGBRIDGE_FULL", "") == "1"  # --full sets it before collection


def matrix_params() -> list:
    """The parity matrix as pytest params: the all-pairs cases (their masked ones sampled) always,
    and with ``--full`` the rest, marked ``slow`` (so ``-m "not slow"`` leaves the default set)."""
    from parity.cli import select_cases

    # The default tier samples the packed-document / window / sink cases as the report does (the
    # first of each strategy and kind); --full adds the rest of the all-pairs matrix's and the
    # whole cross product, marked slow.
    sampled = select_cases(False, masks="sample")
    params = [pytest.param(c, id=c.name) for c in sampled]
    if FULL:
        chosen = {c.name for c in sampled}
        params += [pytest.param(c, id=c.name, marks=pytest.mark.slow)
                   for c in [*pairwise_matrix(), *full_matrix()] if c.name not in chosen and not chosen.add(c.name)]
    return params


def assert_passed(side: Side, case: Case, label: str = "", seed: int | None = None) -> None:
    """Fail with the case, the seed and every tensor out of policy unless ``side`` passed
    (a skipped side fails too: a test is never passed by not running)."""
    where = f"{label} {case.name}".strip() + ("" if seed is None else f" (seed {seed})")
    assert side.status == "passed", f"{where} {side.status}: {side.detail}"


def jax_runner():
    from parity.runners.jax_runner import RUNNER

    return RUNNER


def torch_runner():
    from parity.runners.torch_runner import RUNNER

    return RUNNER


# ---- varlen run lists (seqplan.documents), proved pair by pair ----

def pairs_from_runs(runs, b: int, t: int, s: int, causal: bool) -> np.ndarray:
    """[b·t, b·s] visible pairs as a varlen kernel computes them from the run list."""
    seen = np.zeros((b * t, b * s), bool)
    assert runs.cu_q[-1] == b * t and runs.cu_k[-1] == b * s  # every query and key in one run, in place
    index = np.arange(b * s)
    for i in range(len(runs.cu_q) - 1):
        q0, q1, k0, k1 = runs.cu_q[i], runs.cu_q[i + 1], runs.cu_k[i], runs.cu_k[i + 1]
        for a in range(q1 - q0):
            for c in range(k1 - k0):
                if not causal or c <= a + (k1 - k0) - (q1 - q0):  # causal aligned bottom-right, as FA2
                    seen[q0 + a, index[k0 + c]] = True
    return seen


def sorted_document_ids(rng, b: int, n: int) -> np.ndarray:
    """Each row: documents as runs of increasing ids (lengths 1.. drawn), ids offset per row."""
    rows = []
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), size=rng.integers(0, n // 2), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(n), side="right") + 100 * row)
    return np.stack(rows).astype(np.int32)
