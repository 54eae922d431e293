"""Helpers shared by the test tiers (plain functions, not fixtures — those are in conftest.py)."""

from __future__ import annotations

import os

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
