"""Packed documents in the harness's floor: the segment-id patterns a case draws, and the float64
oracle's document mask, checked against a brute-force loop over (query, key) pairs and against
attention of each document on its own."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core import reference
from parity.core.cases import Case
from parity.core.documents import draw_segment_ids, lengths_to_ids, long_tailed_lengths
from parity.core.inputs import make_inputs, oracle, permutation, to_layout
from parity.core.names import DOCUMENTS


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    """(id, length) of each maximal run of equal ids."""
    cuts = np.flatnonzero(np.diff(row)) + 1
    return [(int(part[0]), len(part)) for part in np.split(row, cuts)]


def _brute_force(q, k, v, ids, pos, causal, scale):
    """o and lse by loops over batch, head, query, key: the definition, one pair at a time."""
    b, t, h, d = q.shape
    group = h // k.shape[2]
    o, lse = np.zeros_like(q), np.zeros((b, h, t))
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                keys = [j for j in range(t) if ids[bi, i] == ids[bi, j] and (not causal or pos[j] <= pos[i])]
                scores = np.array([scale * q[bi, i, hi] @ k[bi, j, hi // group] for j in keys])
                lse[bi, hi, i] = np.log(np.sum(np.exp(scores - scores.max()))) + scores.max()
                weights = np.exp(scores - lse[bi, hi, i])
                o[bi, i, hi] = sum(w * v[bi, j, hi // group] for w, j in zip(weights, keys))
    return o, lse


@pytest.mark.parametrize("pattern", DOCUMENTS[1:])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_oracle_document_mask_matches_a_brute_force_loop(pattern, causal, seed):
    """o and lse of the oracle with segment ids, in zigzag layout order (masked by original
    position), GQA, equal the pair-by-pair loop."""
    rng = np.random.default_rng(seed)
    b, t, h, hk, d, scale = 2, 16, 4, 2, 4, 0.4
    q = rng.standard_normal((b, t, h, d))
    k, v = rng.standard_normal((2, b, t, hk, d))
    pos = reference.layout_permutation(t, "zigzag", ring_size=2)
    ids = draw_segment_ids(pattern, b, t, rng)[:, pos]
    fwd = reference.attention_forward(q, k, v, causal=causal, scale=scale, q_pos=pos, k_pos=pos, segment_ids=ids)
    o, lse = _brute_force(q, k, v, ids, pos, causal, scale)
    np.testing.assert_allclose(fwd.o, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fwd.lse, lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_oracle_with_documents_is_each_document_alone(causal, seed):
    """Contiguous documents: every output and gradient equals the oracle run on that document's
    tokens alone (no ids) — an independent derivation of the mask's effect on the backward too."""
    rng = np.random.default_rng(seed)
    t, h, d = 20, 2, 4
    lengths = [1, 7, 3, 1, 8]
    ids = lengths_to_ids(lengths, [5, 9, 2, 40, 3])[None]  # unsorted values: any integers are ids
    q, k, v, do = rng.standard_normal((4, 1, t, h, d))
    dlse = rng.standard_normal((1, h, t))
    fwd = reference.attention_forward(q, k, v, causal=causal, segment_ids=ids)
    grads = reference.attention_backward(fwd, q, k, v, do, dlse)
    start = 0
    for n in lengths:
        doc = slice(start, start + n)
        alone = reference.attention_forward(q[:, doc], k[:, doc], v[:, doc], causal=causal)
        want = [alone.o, alone.lse, *reference.attention_backward(alone, q[:, doc], k[:, doc], v[:, doc], do[:, doc],
                                                                  dlse[:, :, doc])]
        got = [fwd.o[:, doc], fwd.lse[:, :, doc], *(g[:, doc] for g in grads)]
        for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=f"{name} of the document at {start}")
        start += n


def test_oracle_gradients_with_documents_match_float64_autograd(seed):
    """dq, dk, dv with segment ids and an lse cotangent equal torch float64 autograd of the
    textbook formula under the loop-built mask (interleaved ids, stripe order, causal)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    b, t, h, hk, d, scale = 2, 12, 4, 1, 4, 0.3
    q, do = rng.standard_normal((2, b, t, h, d))
    k, v = rng.standard_normal((2, b, t, hk, d))
    dlse = rng.standard_normal((b, h, t))
    pos = reference.layout_permutation(t, "stripe", ring_size=3)
    ids = draw_segment_ids("interleaved", b, t, rng)[:, pos]
    fwd = reference.attention_forward(q, k, v, causal=True, scale=scale, q_pos=pos, k_pos=pos, segment_ids=ids)
    got = reference.attention_backward(fwd, q, k, v, do, dlse, scale=scale)
    allowed = np.array([[[ids[bi, i] == ids[bi, j] and pos[j] <= pos[i] for j in range(t)] for i in range(t)]
                        for bi in range(b)])
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = torch.einsum("bthd,bshd->bhts", tq, tk.repeat_interleave(h // hk, 2)) * scale
    s = s.masked_fill(~torch.tensor(allowed)[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), tv.repeat_interleave(h // hk, 2))
    ((o * torch.tensor(do)).sum() + (lse * torch.tensor(dlse)).sum()).backward()
    for name, g, w in zip(("dq", "dk", "dv"), got, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_oracle_rejects_bad_ids():
    q = np.ones((1, 4, 1, 2))
    with pytest.raises(ValueError, match="segment_ids must be integers of shape"):
        reference.attention_forward(q, q, q, segment_ids=np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="segment_ids must be integers"):
        reference.attention_forward(q, q, q, segment_ids=np.zeros((1, 4)))
    with pytest.raises(ValueError, match="needs segment_ids"):
        reference.attention_forward(q, q, q, kv_segment_ids=np.zeros((1, 4), np.int32))


@pytest.mark.parametrize("seq", [8, 64, 4096])
def test_patterns_have_the_shapes_they_promise(seq, seed):
    """mix: increasing ids, each document one run, two of length 1 and one of ~seq/3; one: one
    id; singletons: all distinct; interleaved: some id in two separate runs, ids not sorted."""
    rng = np.random.default_rng(seed)
    for row in draw_segment_ids("mix", 3, seq, rng):
        runs = _runs(row)
        assert np.all(np.diff(row) >= 0) and len({i for i, _ in runs}) == len(runs)
        lengths = sorted(n for _, n in runs)
        assert lengths[:2] == [1, 1] and lengths[-1] >= seq // 3
    for row in draw_segment_ids("one", 3, seq, rng):
        assert len(set(row.tolist())) == 1
    for row in draw_segment_ids("singletons", 3, seq, rng):
        assert len(set(row.tolist())) == seq
    for row in draw_segment_ids("interleaved", 3, seq, rng):
        runs = _runs(row)
        assert len({i for i, _ in runs}) < len(runs), "no id comes back after another document"
        assert not np.all(np.diff(row) >= 0)
    assert draw_segment_ids("none", 2, seq, rng) is None
    assert draw_segment_ids("mix", 2, seq, rng).dtype == np.int32


def test_long_tailed_lengths_sum_to_seq_and_keep_the_forced_documents(seed):
    rng = np.random.default_rng(seed)
    for seq in (3, 17, 1000):
        lengths = long_tailed_lengths(rng, seq, median=seq / 12, forced=(1, 1, seq // 3))
        assert lengths.sum() == seq and lengths.min() >= 1
    # a forced length that no longer fits (5 > 4 - 1 - 1) is dropped; the room left (2) is drawn — as
    # one length 2 or, when a lognormal draw rounds to 1, as two lengths 1 (seed-dependent)
    got = sorted(long_tailed_lengths(rng, 4, median=10, forced=(1, 1, 5)).tolist())
    assert got in ([1, 1, 2], [1, 1, 1, 1]), got


def test_inputs_with_documents_add_ids_and_nothing_else(seed):
    """A document case draws the same q, k, v, do, dlse as the case without (ids come last), its
    ids are [b, t] int32 in original order, and to_layout permutes them like the tokens."""
    plain = Case(ring=4, batch=2, layout="zigzag")
    packed = Case(ring=4, batch=2, layout="zigzag", documents="interleaved")
    x, y = make_inputs(plain, seed), make_inputs(packed, seed)
    assert x.segment_ids is None and y.segment_ids.shape == (2, 64) and y.segment_ids.dtype == np.int32
    for name in ("q", "k", "v", "do", "dlse"):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    perm = permutation(packed)
    np.testing.assert_array_equal(to_layout(y, perm).segment_ids, y.segment_ids[:, perm])
    assert to_layout(x, perm).segment_ids is None
    np.testing.assert_array_equal(make_inputs(packed, seed).segment_ids, y.segment_ids)  # from the seed alone
    assert not np.allclose(oracle(plain, x)["o"], oracle(packed, y)["o"])  # and the oracle uses them


def test_case_names_gain_a_suffix_only_with_documents():
    assert Case(ring=2).name == "ring-r2-zigzag-causal-h8kv8-d16-b1-t64-float32"
    assert Case(ring=2, documents="mix").name == "ring-r2-zigzag-causal-h8kv8-d16-b1-t64-float32-docs-mix"
    assert Case(ring=2, documents="mix").to_dict()["documents"] == "mix"
    with pytest.raises(ValueError, match="documents must be one of"):
        Case(documents="packed")


@pytest.mark.parametrize("pattern", ["mix", "interleaved"])
def test_torch_float64_truth_applies_the_document_mask(pattern, seed):
    """The GPU-sized truth (parity.runners.torch_truth) equals the NumPy oracle on document cases."""
    pytest.importorskip("torch")
    from parity.runners.torch_truth import case_truth

    case = Case(ring=2, batch=2, seq=32, kv_heads=2, documents=pattern)
    x = make_inputs(case, seed)
    want, got = oracle(case, x), case_truth(case, x, "cpu")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)
