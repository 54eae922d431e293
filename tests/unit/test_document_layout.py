"""The per-document zigzag (seqplan.layouts.document_layout), its padding rule and the token
indices, against the obvious oracle (parity.core.reference.document_zigzag_permutation)."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core.reference import attention_forward, document_zigzag_permutation
from parity.probes.balance import visible_pairs
from seqplan.layouts import (
    document_layout,
    layout_permutation,
    pad_documents,
    rope_positions,
    static_token_index,
)


def _ids(rng, batch, docs, ring):
    rows = []
    for _ in range(batch):
        lengths = rng.integers(1, 5, size=docs) * 2 * ring
        rows.append(np.repeat(rng.permutation(docs), lengths))
    width = max(len(r) for r in rows)
    return np.stack([np.r_[r, np.full(width - len(r), docs)] for r in rows])


@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_document_layout_matches_oracle(ring):
    ids = _ids(np.random.default_rng(ring), 3, 5, ring)
    layout = document_layout(ids, ring)
    np.testing.assert_array_equal(layout.perm, document_zigzag_permutation(ids, ring))
    np.testing.assert_array_equal(layout.token_index, layout.perm)
    assert layout.token_index.dtype == np.int32
    for row in range(ids.shape[0]):
        assert sorted(layout.perm[row]) == list(range(ids.shape[1]))
        np.testing.assert_array_equal(layout.inverse[row][layout.perm[row]], np.arange(ids.shape[1]))


def test_every_device_gets_the_same_causal_pairs():
    """Each document contributes the same causal pairs to every device: the balance is exact."""
    ring = 4
    ids = _ids(np.random.default_rng(0), 1, 7, ring)[0]
    perm = document_layout(ids[None], ring).perm[0]
    per_device = visible_pairs(ids)[perm].reshape(ring, -1).sum(axis=1)
    assert len(set(per_device.tolist())) == 1, per_device
    zigzag = visible_pairs(ids)[layout_permutation(len(ids), "zigzag", ring)].reshape(ring, -1).sum(axis=1)
    assert len(set(zigzag.tolist())) > 1  # the probe can tell: the static zigzag is not balanced here


def test_each_document_is_one_increasing_run_per_shard():
    ring = 3
    ids = _ids(np.random.default_rng(1), 2, 6, ring)
    layout = document_layout(ids, ring)
    shard = ids.shape[1] // ring
    for row in range(ids.shape[0]):
        laid = ids[row][layout.perm[row]]
        for r in range(ring):
            part, index = laid[r * shard:(r + 1) * shard], layout.token_index[row, r * shard:(r + 1) * shard]
            starts = np.flatnonzero(np.r_[True, part[1:] != part[:-1]])
            assert len(starts) == len(set(part.tolist()))  # one run per document
            for a, b in zip(starts, np.r_[starts[1:], shard]):
                assert np.all(np.diff(index[a:b]) > 0)  # increasing: the own block is causal per document


def test_lengths_not_divisible_are_refused_and_padding_fixes_them():
    ids = np.array([[0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]])  # the `mix` pattern's length-1 documents
    with pytest.raises(ValueError, match="divisible by 2·R = 4.*pad_documents"):
        document_layout(ids, 2)
    padded, source = pad_documents(ids, 2, multiple=8)
    assert padded.shape[1] % 8 == 0
    starts = np.flatnonzero(np.r_[True, padded[0, 1:] != padded[0, :-1]])
    assert np.all(np.diff(np.r_[starts, padded.shape[1]]) % 4 == 0)
    real = source[0] >= 0
    np.testing.assert_array_equal(padded[0][real], ids[0])  # real tokens keep their ids, in order
    np.testing.assert_array_equal(source[0][real], np.arange(ids.shape[1]))
    document_layout(padded, 2)  # now accepted


def test_padding_is_exact_under_causal_masking():
    """Real rows of the padded, laid-out sequence equal the unpadded answer (pads come last in
    their document: no real query sees one)."""
    rng = np.random.default_rng(3)
    ids = np.array([[0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]])
    padded, source = pad_documents(ids, 2)
    layout = document_layout(padded, 2)
    q, k, v = (rng.standard_normal((1, padded.shape[1], 2, 4)) for _ in range(3))
    real = np.flatnonzero(source[0] >= 0)
    want = attention_forward(q[:, real], k[:, real], v[:, real], causal=True, segment_ids=ids).o
    take = lambda x: x[:, layout.perm[0]]
    got = attention_forward(take(q), take(k), take(v), causal=True, q_pos=layout.token_index,
                            k_pos=layout.token_index, segment_ids=take(padded)).o
    back = got[:, layout.inverse[0]]
    np.testing.assert_allclose(back[:, real], want, rtol=1e-12, atol=1e-12)
    # a wrong token index (the static zigzag's, on this per-document layout) is caught
    wrong = static_token_index(padded.shape[1], "zigzag", 2)
    bad = attention_forward(take(q), take(k), take(v), causal=True, q_pos=wrong, k_pos=wrong,
                            segment_ids=take(padded)).o[:, layout.inverse[0]]
    assert not np.allclose(bad[:, real], want)


def test_rope_positions_restart_per_document():
    ids = np.array([[5, 5, 5, 5, 9, 9, 9, 9]])
    layout = document_layout(ids, 2)
    pos = rope_positions(layout.token_index, np.take_along_axis(ids, layout.perm, 1))
    np.testing.assert_array_equal(np.take_along_axis(pos, layout.inverse, 1), [[0, 1, 2, 3, 0, 1, 2, 3]])


def test_static_token_index_is_the_layout_permutation():
    np.testing.assert_array_equal(static_token_index(16, "zigzag", 2, batch=2),
                                  np.stack([layout_permutation(16, "zigzag", 2)] * 2))


# ---- the per-document hybrid (seqplan.layouts.hybrid_layout) --------------------------------------

@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_hybrid_layout_is_a_permutation_of_equal_shards_with_runs(ring):
    """Per row a permutation (inverse and token indices consistent), equal shards; every shard's
    documents one run each with increasing token indices; a document under the threshold whole on
    one device unless no device had room; one at or over it on every device, as document-zigzag."""
    from seqplan.layouts import hybrid_layout

    rng = np.random.default_rng(10 + ring)
    ids = _ids(rng, 2, 9, ring)
    split_at = 4 * ring
    layout = hybrid_layout(ids, ring, split_at)
    shard = ids.shape[1] // ring
    np.testing.assert_array_equal(layout.token_index, layout.perm)
    for row in range(ids.shape[0]):
        assert sorted(layout.perm[row]) == list(range(ids.shape[1]))
        np.testing.assert_array_equal(layout.inverse[row][layout.perm[row]], np.arange(ids.shape[1]))
        laid = ids[row][layout.perm[row]]
        holders = {}
        for r in range(ring):
            part, index = laid[r * shard:(r + 1) * shard], layout.token_index[row, r * shard:(r + 1) * shard]
            starts = np.flatnonzero(np.r_[True, part[1:] != part[:-1]])
            assert len(starts) == len(set(part.tolist()))
            for a, b in zip(starts, np.r_[starts[1:], shard]):
                assert np.all(np.diff(index[a:b]) > 0)  # each document increasing
            for doc in set(part.tolist()):
                holders.setdefault(doc, set()).add(r)
        for r in range(ring):  # the shared documents first, in original order; then the whole ones
            part = laid[r * shard:(r + 1) * shard]
            index = layout.token_index[row, r * shard:(r + 1) * shard]
            is_shared = np.array([len(holders[doc]) > 1 for doc in part])
            assert not np.any(is_shared[1:] & ~is_shared[:-1])
            assert np.all(np.diff(index[is_shared]) > 0) and np.all(np.diff(index[~is_shared]) > 0)
        starts = np.flatnonzero(np.r_[True, ids[row, 1:] != ids[row, :-1]])
        for start, length in zip(starts, np.diff(np.r_[starts, ids.shape[1]])):
            doc = ids[row, start]
            if length >= split_at:
                assert holders[doc] == set(range(ring))


def test_hybrid_layout_balances_and_splits_what_it_must():
    """On the balance probe's mixes at 32k tokens, R 4: every device's runs within 1.05 of the
    mean, while keeping every document that fits whole on one device."""
    from parity.probes.balance import MIXES, document_counts, imbalance

    for mix in MIXES:
        counts = document_counts(mix.segment_ids(32768), 4, layout="document-hybrid")
        assert imbalance(counts["runs"]) <= 1.05, (mix.name, counts["runs"])


def test_hybrid_refuses_split_documents_not_divisible():
    from seqplan.layouts import hybrid_layout

    ids = np.array([[0] * 6 + [1] * 3 + [2] * 7])
    with pytest.raises(ValueError, match="document-hybrid needs every document it splits.*divisible by 2·R = 4"):
        hybrid_layout(ids, 2, split_at=5)
    hybrid_layout(np.array([[0] * 8 + [1] * 3 + [2] * 5]), 2, split_at=6)  # short ones may have any length


# ---- the hybrid's default threshold (seqplan.layouts.balanced_split_at) ---------------------------
# Why: the threshold decides how many tokens all-gather KV moves (every split document lands in every
# shard's shared prefix); these pin the rule — fewer shared tokens only within the balance tolerance.

def test_balanced_split_at_shares_fewer_tokens_on_the_mixes():
    """128k over 4 devices, the balance mixes padded as the chooser pads them: the default shares
    2,057 / 22,550 / 20,530 tokens a shard where splitting at the floor shares 6,171 / 26,650 /
    22,583 (the numbers the docstring and docs/decisions.md quote), every device's causal work
    within the tolerance of the mean."""
    from parity.probes.balance import MIXES
    from seqplan.layouts import BALANCE_TOLERANCE, causal_work, default_split_at, hybrid_layout, pad_documents
    from seqplan.shared import shared_tokens_for

    expected = {"short": (2057, 6171), "heavy-tail": (22550, 26650), "few-long": (20530, 22583)}
    for mix in MIXES:
        ids, _ = pad_documents(mix.segment_ids(131072)[None], 4, 8)
        shared = {}
        for name, split_at in (("default", None), ("floor", default_split_at(ids.shape[1], 4))):
            layout = hybrid_layout(ids, 4, split_at)
            work = causal_work(ids, layout.perm, 4)[0]
            shared[name] = shared_tokens_for(np.take_along_axis(ids, layout.perm, 1), 4)
            if name == "default":
                assert work.max() <= BALANCE_TOLERANCE * work.mean(), (mix.name, work)
        assert (shared["default"], shared["floor"]) == expected[mix.name], (mix.name, shared)


def test_balanced_split_at_splits_nothing_that_balances_whole():
    """Four equal documents over two devices: each device holds two whole, nothing is shared
    (the floor would split all four and share every token)."""
    from seqplan.layouts import balanced_split_at, hybrid_layout
    from seqplan.shared import ring_shards, shared_extent

    ids = np.repeat(np.arange(4), 8)[None]
    split_at = balanced_split_at(ids, 2)
    assert split_at > 8
    layout = hybrid_layout(ids, 2)
    assert shared_extent(ring_shards(np.take_along_axis(ids, layout.perm, 1), 2)) == 0
    assert shared_extent(ring_shards(np.take_along_axis(ids, hybrid_layout(ids, 2, 4).perm, 1), 2)) == 16


def test_balanced_split_at_splits_the_document_that_unbalances():
    """One 24-token document and one of 8 over two devices: kept whole, the long one must be cut
    for room and one device does most of its causal work; split alone, it leaves each device 4
    tokens of room, the short one is cut into two pieces (10 and 26 pairs) and the devices do 160
    against 176; so the default splits both (2R chunks each)."""
    from seqplan.layouts import BALANCE_TOLERANCE, balanced_split_at, causal_work, hybrid_layout

    ids = np.array([[0] * 24 + [1] * 8])
    assert balanced_split_at(ids, 2) == 8
    assert causal_work(ids, hybrid_layout(ids, 2, split_at=24).perm, 2)[0].tolist() == [160.0, 176.0]
    work = causal_work(ids, hybrid_layout(ids, 2).perm, 2)[0]
    assert work.max() <= BALANCE_TOLERANCE * work.mean()
    whole = causal_work(ids, hybrid_layout(ids, 2, split_at=25).perm, 2)[0]
    assert whole.max() > 1.1 * whole.mean()  # 200 against 136 pairs


def test_causal_work_counts_visible_pairs():
    """Per shard, the same-document causal pairs its queries see, against a direct count."""
    from seqplan.layouts import causal_work

    rng = np.random.default_rng(5)
    ids = np.sort(rng.integers(0, 5, (2, 24)), axis=1)
    perm = np.stack([rng.permutation(24) for _ in range(2)])
    work = causal_work(ids, perm, 3)
    for row in range(2):
        for r in range(3):
            queries = perm[row, r * 8:(r + 1) * 8]
            direct = sum(int(np.sum((ids[row] == ids[row, q]) & (np.arange(24) <= q))) for q in queries)
            assert work[row, r] == direct


def test_balanced_split_at_refuses_what_hybrid_refuses():
    from seqplan.layouts import balanced_split_at

    with pytest.raises(ValueError, match="divisible by ring_size"):
        balanced_split_at(np.zeros((1, 10), np.int32), 4)
    with pytest.raises(ValueError, match="integer"):
        balanced_split_at(np.zeros((1, 8)), 2)


def test_balanced_split_at_is_the_default_and_never_below_the_floor():
    """``hybrid_layout`` without ``split_at`` is ``hybrid_layout`` at ``balanced_split_at``, over a
    batch of rows with different documents; the threshold is never below ``default_split_at``
    (no document the floor would keep whole gets split); a ring of one keeps the floor."""
    from parity.probes.balance import MIXES
    from seqplan.layouts import balanced_split_at, default_split_at, hybrid_layout, pad_documents

    ids, _ = pad_documents(np.stack([mix.segment_ids(16384) for mix in MIXES]), 4, 8)
    split_at = balanced_split_at(ids, 4)
    assert split_at >= default_split_at(ids.shape[1], 4)
    np.testing.assert_array_equal(hybrid_layout(ids, 4).perm, hybrid_layout(ids, 4, split_at).perm)
    assert balanced_split_at(ids, 1) == default_split_at(ids.shape[1], 1)


def test_causal_work_counts_runs_as_documents():
    """An id that comes back later is another document (a run, as the layouts place it): its
    second run's queries count no pairs with the first run's keys."""
    from seqplan.layouts import causal_work

    ids = np.array([[0, 0, 1, 1, 0, 0, 2, 2]])
    work = causal_work(ids, np.arange(8)[None], 2)
    assert work.tolist() == [[6.0, 6.0]]  # (1+2)+(1+2) per shard; by ids the second shard would see 10


def test_balanced_split_at_refuses_a_tolerance_below_one():
    from seqplan.layouts import balanced_split_at

    with pytest.raises(ValueError, match="tolerance must be a number >= 1"):
        balanced_split_at(np.zeros((1, 8), np.int32), 2, tolerance=0.9)


def _spans_by_token(ids_all: np.ndarray) -> np.ndarray:
    """The plain definition: per row, each token's document against the set of shards holding it."""
    ring, b, t = ids_all.shape
    out = np.empty(ids_all.shape, bool)
    for row in range(b):
        shards_of = {}
        for r in range(ring):
            for doc in ids_all[r, row]:
                shards_of.setdefault(int(doc), set()).add(r)
        out[:, row, :] = [[len(shards_of[int(doc)]) > 1 for doc in ids_all[r, row]] for r in range(ring)]
    return out


def test_spans_shards_decided_per_run_equals_the_per_token_definition(seed):
    """``seqplan.shared.spans_shards`` groups runs of equal ids, not tokens (what makes a new
    batch's shared-prefix plan cheap): it equals the per-token definition on ids of every shape —
    one shard, one token a shard, a document split into several runs on one shard and across
    rows, negative and large ids, whole documents and split ones as the hybrid lays them out."""
    from seqplan.shared import ring_shards, spans_shards

    rng = np.random.default_rng(seed + 31)
    for trial in range(200):
        ring, b, t = (int(x) for x in rng.integers(1, (5, 4, 40)))
        ids = rng.integers(0, rng.integers(1, 12), size=(ring, b, t)) * (1 if trial % 3 else 1_000_003) - (trial % 5 == 0)
        if trial % 4 == 0:  # sorted rows: documents as runs, some across the shard edges
            ids = np.sort(ids.transpose(1, 0, 2).reshape(b, -1), axis=1).reshape(b, ring, t).transpose(1, 0, 2)
        assert np.array_equal(spans_shards(ids), _spans_by_token(ids)), trial
        for dtype, far in ((np.int32, -2 ** 31 + 40), (np.uint64, 2 ** 64 - 100)):  # ids near a dtype's edge
            shifted = (ids - ids.min()).astype(dtype) + np.array(far).astype(dtype)
            assert np.array_equal(spans_shards(shifted), _spans_by_token(ids)), (trial, dtype)
    assert spans_shards(np.zeros((4, 0, 3), np.int32)).shape == (4, 0, 3)  # no rows: nothing spans
    # 48 tokens over 4 contiguous shards of 12: document 4 (tokens 20-31) spans shards 1-2,
    # document 6 (34-37) shards 2-3; the others lie on one shard each
    ids = np.repeat(np.arange(8), [3, 9, 1, 7, 12, 2, 4, 10])[None]
    want = np.array([[0] * 12, [0] * 8 + [1] * 4, [1] * 8 + [0] * 2 + [1] * 2, [1] * 2 + [0] * 10]) == 1
    assert np.array_equal(spans_shards(ring_shards(ids, 4))[:, 0], want)
