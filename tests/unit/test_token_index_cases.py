"""Token-index parity cases (``Case.token_index``): packed documents laid out by the per-document
zigzag, passed as explicit token indices. Here, without any framework: the case's validation and
name, its inputs (documents in units of 2R tokens, the token indices), the per-row layout
(``permutation(case, x)``, ``to_layout`` / ``from_layout`` row by row), the dense controls' guard,
and the traffic model's extra int32 gather worked by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from parity.accounting.model import attention_traffic
from parity.core.cases import Case, token_index_cases
from parity.core.inputs import from_layout, make_inputs, oracle, permutation, to_layout, without_token_index
from parity.core.reference import document_zigzag_permutation
from seqplan.layouts import DOCUMENT_ZIGZAG, document_runs


def test_a_token_index_case_is_validated_and_named():
    case = Case(ring=4, documents="mix", batch=2, token_index=True)
    assert case.name == "ring-r4-zigzag-causal-h8kv8-d16-b2-t64-float32-docs-mix-token-index"
    assert case.to_dict()["token_index"] is True
    assert Case(ring=2, window=(5, 2), token_index=True).name.endswith("-token-index-win5x2")
    with pytest.raises(TypeError, match="token_index must be a bool"):
        Case(ring=2, token_index=1)
    with pytest.raises(ValueError, match=r"seq % \(2·ring\) == 0"):
        Case(ring=8, seq=24, layout="contiguous", token_index=True)
    hybrid = Case(ring=4, documents="mix", batch=2, token_index=True, row_layout="document-hybrid")
    assert hybrid.name.endswith("-token-index-document-hybrid")
    with pytest.raises(ValueError, match="row_layout must be one of"):
        Case(ring=2, token_index=True, row_layout="hybrid")
    with pytest.raises(ValueError, match="token_index cases only"):
        Case(ring=2, row_layout="document-hybrid")


@pytest.mark.parametrize("case", token_index_cases(), ids=lambda c: c.name)
def test_inputs_documents_come_in_units_of_2r_and_the_layout_is_the_per_document_zigzag(case, seed):
    """Every document is a multiple of 2R tokens long; the layout is the per-document zigzag of
    the ids (against the oracle's obvious version), one permutation per row; the laid-out token
    indices are that permutation; to_layout then from_layout gives every tensor back."""
    x = make_inputs(case, seed)
    assert x.token_index.shape == (case.batch, case.seq) and x.token_index.dtype == np.int32
    np.testing.assert_array_equal(x.token_index, np.broadcast_to(np.arange(case.seq), (case.batch, case.seq)))
    for row in x.segment_ids:
        assert all(length % (2 * case.ring) == 0 for length in document_runs(row)[1])
    perm = permutation(case, x)
    if case.row_layout == DOCUMENT_ZIGZAG:
        np.testing.assert_array_equal(perm, document_zigzag_permutation(x.segment_ids, case.ring))
    else:  # the hybrid splits only what balance needs (balanced_split_at): each document either way
        _assert_each_document_zigzag_or_in_runs(perm, x.segment_ids, case.ring)
    y = to_layout(x, perm)
    np.testing.assert_array_equal(y.token_index, perm)
    for name in ("q", "k", "v", "do", "segment_ids"):
        want = np.stack([getattr(x, name)[b, perm[b]] for b in range(case.batch)])  # the per-row x[:, perm]
        np.testing.assert_array_equal(getattr(y, name), want, err_msg=name)
    np.testing.assert_array_equal(y.dlse, np.stack([x.dlse[b][:, perm[b]] for b in range(case.batch)]))
    back = from_layout({"o": y.q, "lse": y.dlse, "dsinks": np.arange(3.0)}, perm)
    np.testing.assert_array_equal(back["o"], x.q)
    np.testing.assert_array_equal(back["lse"], x.dlse)
    np.testing.assert_array_equal(back["dsinks"], np.arange(3.0))


def _assert_each_document_zigzag_or_in_runs(perm, segment_ids, ring):
    """The hybrid's per-row layout, checked document by document: a split document is laid as its
    per-document zigzag (shard r holds its chunks r and 2R-1-r, in order); any other lies in
    contiguous pieces, one per shard that holds any of it (whole on one shard where it fits)."""
    shard = perm.shape[1] // ring
    for row, ids in zip(perm, segment_ids):
        holder = np.empty_like(row)
        holder[row] = np.arange(len(row)) // shard  # the shard each original token lands on
        place = np.empty_like(row)
        place[row] = np.arange(len(row))
        for start, length in zip(*document_runs(ids)):
            tokens = np.arange(start, start + length)
            chunk = length // (2 * ring)
            zigzag = np.concatenate([[r] * chunk for r in (*range(ring), *reversed(range(ring)))])
            split = ring > 1 and np.array_equal(holder[tokens], zigzag)
            for r in set(holder[tokens].tolist()):
                mine = tokens[holder[tokens] == r]
                assert np.all(np.diff(place[mine]) == 1), (start, length, r)  # one run, in order
                assert split or np.all(np.diff(mine) == 1), (start, length, r)  # else one contiguous piece


def test_rows_get_different_layouts_and_none_means_one_document_per_row(seed):
    """Two rows whose documents lie at different places get different permutations (the per-row
    form is needed), rows with the same boundaries the same one (the layout reads where documents
    start, not the ids' values: seed 1456806595 draws different ids on the same boundaries);
    without documents each row is one document: the static zigzag over the ring in every row."""
    case = token_index_cases()[0]
    x = make_inputs(case, seed)
    perm = permutation(case, x)
    starts = [document_runs(row)[0] for row in x.segment_ids]
    if np.array_equal(*starts):
        np.testing.assert_array_equal(perm[0], perm[1])
    else:
        assert not np.array_equal(perm[0], perm[1])
    plain = Case(ring=4, batch=2, layout="contiguous", token_index=True)
    x = make_inputs(plain, seed)
    assert x.segment_ids is None
    zigzag = permutation(Case(ring=4, layout="zigzag"))
    np.testing.assert_array_equal(permutation(plain, x), np.stack([zigzag, zigzag]))


def test_the_static_layout_is_unchanged_and_the_per_row_form_checks_its_shape(seed):
    """A case without token indices keeps its one [t] permutation (``x[:, perm]``); a per-row
    permutation of the wrong shape is refused; a token-index case needs its inputs."""
    case = Case(ring=4, batch=2, documents="mix")
    x = make_inputs(case, seed)
    perm = permutation(case)
    assert perm.ndim == 1
    np.testing.assert_array_equal(to_layout(x, perm).q, x.q[:, perm])
    with pytest.raises(ValueError, match=r"per-row permutation must be \[batch, seq\]"):
        to_layout(x, np.zeros((3, 64), np.int64))
    with pytest.raises(ValueError, match="pass x"):
        permutation(token_index_cases()[0])


def test_token_index_draws_change_only_the_ids(seed):
    """A token-index case draws the same q, k, v, do, dlse as the case without (ids come after,
    drawn in units of 2R); its oracle, in original order, is the document-masked causal one."""
    case = token_index_cases()[0]
    plain = replace(case, token_index=False)
    x, y = make_inputs(case, seed), make_inputs(plain, seed)
    for name in ("q", "k", "v", "do", "dlse"):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    assert y.token_index is None
    assert not np.array_equal(x.segment_ids, y.segment_ids)
    ref = oracle(case, x)
    assert np.isfinite(ref["o"]).all() and not np.allclose(ref["o"], oracle(plain, y)["o"])


def test_a_dense_control_gets_no_token_index_and_refuses_a_meaningful_one(seed):
    """In original order the token indices are the positions: the controls drop them, but only
    when they are arange(t) — anything else would be a mask the control cannot apply."""
    case = token_index_cases()[0]
    x = make_inputs(case, seed)
    assert without_token_index(x).token_index is None
    plain = without_token_index(x)
    assert without_token_index(plain) is plain
    laid = to_layout(x, permutation(case, x))
    with pytest.raises(ValueError, match="must be arange"):
        without_token_index(replace(x, token_index=laid.token_index))


def test_token_index_gathers_by_hand():
    """Token indices add one forward all-gather of int32 [b, t/(R·U)] per group, like the ids:
    ring 4 alone (b 1): 16 tokens · 4 B = 64 B, (4-1)·64 = 192 B in one call; USP r2×u2 with ids
    (b 2): each of ids and indices 128 B over Ulysses and 256 B over the ring, 4 calls, 768 B;
    the double ring ro2×ri2 with ids (b 1): 64 B inner, 128 B outer for each, 4 calls, 384 B. On
    one device nothing; nothing in the backward, nothing else changes."""
    alone = Case(ring=4, token_index=True)
    assert attention_traffic(alone).rows() == attention_traffic(Case(ring=4)).rows() | {("fwd", "all-gather"): (1, 192)}
    usp = Case(ring=2, ulysses=2, batch=2, documents="mix", token_index=True)
    assert attention_traffic(usp).rows() == (attention_traffic(replace(usp, token_index=False)).rows()
                                             | {("fwd", "all-gather"): (4, 768)})
    double = attention_traffic(Case(ring=4, ring_outer=2, documents="one", token_index=True)).rows()
    assert double[("fwd", "all-gather")] == (4, 2 * (64 + 128))
    assert ("fwd", "all-gather") not in attention_traffic(Case(ring=1, documents="mix", token_index=True)).rows()
    assert ("bwd", "all-gather") not in attention_traffic(usp).rows()
