"""Tier 1 — the benchmark's FLOP count on masked problems: TFLOP/s of packed-document and
sliding-window rows are counted on the mask area, so the count of visible pairs must equal a
brute-force count of the mask (and the unmasked convention, s²/2 causal, must stay)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import Problem


def _brute(problem: Problem) -> int:
    i = np.arange(problem.seq)
    visible = np.ones((problem.seq, problem.seq), bool)
    if problem.causal:
        visible &= i[None, :] <= i[:, None]
    if problem.window is not None:
        left, right = problem.window
        visible &= (i[None, :] >= i[:, None] - left) & (i[None, :] <= i[:, None] + right)
    ids = problem.segment_ids()
    rows = [visible] if ids is None else [visible & (row[:, None] == row[None, :]) for row in ids]
    return int(sum(m.sum() for m in rows)) * (problem.batch if ids is None else 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents,window", [("mix", None), ("none", (37, 5)), ("mix", (20, 0)), ("one", (3, 90))])
def test_visible_pairs_equal_a_brute_force_count(causal, documents, window):
    problem = Problem(seq=512, batch=2, causal=causal, documents=documents, window=window)
    assert problem.visible_pairs() == _brute(problem)


def test_unmasked_problems_keep_the_papers_convention():
    assert Problem(seq=1024, causal=True).visible_pairs() == 1024**2 / 2
    assert Problem(seq=1024, causal=False).flops(True) == 4 * 32 * 128 * 1024**2
