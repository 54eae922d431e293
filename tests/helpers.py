"""Helpers shared by the test tiers (plain functions, not fixtures — those are in conftest.py)."""

from __future__ import annotations

import os

import pytest

from parity.core.cases import Case, full_matrix, pairwise_matrix
from parity.runners.pipeline import Side

FULL = os.environ.get("RINGBRIDGE_FULL", "") == "1"  # --full sets it before collection


def matrix_params() -> list:
    """The parity matrix as pytest params: the all-pairs cases always, and with ``--full`` the
    rest of the cross product, marked ``slow`` (so ``-m "not slow"`` leaves only all-pairs)."""
    pairwise = pairwise_matrix()
    params = [pytest.param(c, id=c.name) for c in pairwise]
    if FULL:
        chosen = {c.name for c in pairwise}
        params += [pytest.param(c, id=c.name, marks=pytest.mark.slow) for c in full_matrix() if c.name not in chosen]
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
