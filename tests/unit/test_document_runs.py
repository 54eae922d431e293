"""Tier 1 — ``seqplan.documents.document_runs``, the run list a varlen kernel is given, proved
against the mask it stands for: per-run attention over the packed queries and gathered keys sees
exactly the (query, key) pairs the document mask (and the causal mask on a diagonal block) allows,
and blocks it cannot express are refused (None), never approximated."""

from __future__ import annotations

import numpy as np
import pytest

from seqplan.documents import document_runs


def _pairs_from_runs(runs, b: int, t: int, s: int, causal: bool) -> np.ndarray:
    """[b·t, b·s] visible pairs as a varlen kernel computes them from the run list."""
    seen = np.zeros((b * t, b * s), bool)
    index = np.arange(b * s) if runs.kv_index is None else runs.kv_index
    for i in range(len(runs.cu_q) - 1):
        q0, q1, k0, k1 = runs.cu_q[i], runs.cu_q[i + 1], runs.cu_k[i], runs.cu_k[i + 1]
        for a in range(q1 - q0):
            for c in range(k1 - k0):
                if not causal or c <= a + (k1 - k0) - (q1 - q0):  # causal aligned bottom-right, as FA2
                    seen[q0 + a, index[k0 + c]] = True
    return seen


def _pairs_from_mask(q_ids, kv_ids, causal: bool) -> np.ndarray:
    b, t = q_ids.shape
    s = kv_ids.shape[1]
    seen = np.zeros((b * t, b * s), bool)
    for row in range(b):
        block = q_ids[row][:, None] == kv_ids[row][None, :]
        if causal:
            block &= np.tri(t, s, dtype=bool)
        seen[row * t:(row + 1) * t, row * s:(row + 1) * s] = block
    return seen


def _sorted_ids(rng, b: int, n: int) -> np.ndarray:
    """Each row: documents as runs of increasing ids (lengths 1.. drawn), ids offset per row."""
    rows = []
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), size=rng.integers(0, n // 2), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(n), side="right") + 100 * row)
    return np.stack(rows).astype(np.int32)


@pytest.mark.parametrize("trial", range(20))
def test_runs_see_exactly_the_masked_pairs(trial, seed):
    rng = np.random.default_rng(seed + trial)
    b, t = int(rng.integers(1, 3)), int(rng.integers(1, 24))
    ids = _sorted_ids(rng, b, 2 * t)
    for q_ids, kv_ids, causal in ((ids[:, :t], ids[:, :t], True), (ids[:, t:], ids[:, :t], False),
                                  (ids[:, :t], ids[:, t:], False), (ids[:, :t], ids[:, :t], False)):
        runs = document_runs(q_ids, kv_ids, causal)
        assert runs is not None
        got = _pairs_from_runs(runs, b, t, kv_ids.shape[1], causal)
        np.testing.assert_array_equal(got, _pairs_from_mask(q_ids, kv_ids, causal))
        empty = ~_pairs_from_mask(q_ids, kv_ids, causal).any(1)
        assert (runs.empty_rows is None and not empty.any()) or np.array_equal(runs.empty_rows, empty) or causal


def test_in_order_keys_need_no_gather_and_missing_documents_are_empty_rows():
    ids = np.array([[0, 0, 1, 1, 1, 2]], np.int32)
    runs = document_runs(ids, ids, causal=True)
    assert runs.kv_index is None and runs.empty_rows is None and list(runs.cu_q) == [0, 2, 5, 6] == list(runs.cu_k)
    later = np.array([[2, 2, 3, 3, 4, 4]], np.int32)
    runs = document_runs(later, ids, causal=False)
    assert list(runs.cu_q) == [0, 2, 4, 6] and list(runs.cu_k) == [0, 1, 1, 1]
    assert runs.kv_index.tolist() == [5] and runs.empty_rows.tolist() == [False, False, True, True, True, True]


def test_blocks_that_are_not_runs_are_refused():
    split = np.array([[0, 0, 1, 1, 0, 0]], np.int32)  # document 0 in two runs
    ok = np.array([[0, 0, 1, 1, 2, 2]], np.int32)
    assert document_runs(split, ok, causal=False) is None and document_runs(ok, split, causal=False) is None
    assert document_runs(ok, ok[:, ::-1].copy(), causal=True) is None  # causal needs the block's own tokens
