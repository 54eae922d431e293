"""The one-device replays of both frameworks with explicit ``token_index`` on the per-document
zigzag: equal to the float64 oracle (outputs and gradients, read back to original order), to
each other, and a wrong token index is caught; bad token indices are refused before any work."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import FULL
from parity.core.reference import attention_backward, attention_forward
from seqplan.layouts import document_layout, pad_documents, static_token_index
from seqplan.strategy import Strategy

RING = 2
STRATEGIES = {"ring": Strategy(ring=RING), "allgather": Strategy(ring=RING, kv_exchange="allgather"),
              "usp": Strategy(ring=RING, ulysses=2), "double": Strategy(ring=4, outer=2)}


def _problem(seed, ring):
    rng = np.random.default_rng(seed)
    ids = np.array([[0] * 9 + [1] + [2] * 14 + [3] * 3, [7] * 3 + [8] * 21 + [9] * 3])  # a length-1 document
    padded, _ = pad_documents(ids, ring)
    layout = document_layout(padded, ring)
    laid = np.take_along_axis(padded, layout.perm, 1).astype(np.int32)
    q, k, v, do = (rng.standard_normal((2, padded.shape[1], 4, 8)).astype(np.float32) for _ in range(4))
    k, v = k[:, :, :2], v[:, :, :2]
    return layout.token_index, laid, q, k, v, do


def _run(framework, strategy, index, ids, q, k, v, do, window=None, grads=True):
    kw = dict(strategy=strategy, causal=True, layout="contiguous", segment_ids=ids, token_index=index, window=window)
    if framework == "jax":
        import jax.numpy as xp

        from jax_impl import replay
        cast = xp.asarray
    else:
        import torch

        from torch_impl import replay
        cast = torch.from_numpy
    kw["segment_ids"], kw["token_index"] = cast(ids), None if index is None else cast(np.ascontiguousarray(index))
    q, k, v, do = (cast(x) for x in (q, k, v, do))
    o, lse = replay.replay_attention(q, k, v, **kw)
    if not grads:
        return [np.asarray(o), np.asarray(lse)]
    dq, dk, dv = replay.replay_attention_grads(q, k, v, o, lse, do, **kw)
    return [np.asarray(x) for x in (o, lse, dq, dk, dv)]


def _rel(x, ref):
    return np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref)


DEFAULT_CASES = [("ring", (5, 0)), ("allgather", None)]  # the default tier: seconds; --full: every pair
CASES = [pytest.param(name, window, marks=() if (name, window) in DEFAULT_CASES else pytest.mark.slow)
         for name in STRATEGIES for window in (None, (5, 0)) if FULL or (name, window) in DEFAULT_CASES]


@pytest.mark.parametrize(("name", "window"), CASES)
def test_replay_with_token_index_matches_oracle_in_both_frameworks(name, window):
    strategy = STRATEGIES[name]
    index, ids, q, k, v, do = _problem(0, strategy.ring)
    fwd = attention_forward(q, k, v, causal=True, q_pos=index, k_pos=index, segment_ids=ids, window=window)
    ref = [fwd.o, fwd.lse, *attention_backward(fwd, q, k, v, do)]
    results = {fw: _run(fw, strategy, index, ids, q, k, v, do, window) for fw in ("jax", "torch")}
    for fw, got in results.items():
        for name_, x, r in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
            assert _rel(x, r) < 1e-5, (fw, name_)
    for a, b in zip(results["jax"], results["torch"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_wrong_token_index_is_caught(framework):
    """The static layout's indices (the default) on data laid out per document: wrong answer."""
    index, ids, q, k, v, do = _problem(1, RING)
    fwd = attention_forward(q, k, v, causal=True, q_pos=index, k_pos=index, segment_ids=ids)
    wrong = static_token_index(q.shape[1], "contiguous", RING, batch=2)
    assert _rel(_run(framework, STRATEGIES["ring"], wrong, ids, q, k, v, do, grads=False)[0], fwd.o) > 1e-2
    assert _rel(_run(framework, STRATEGIES["ring"], None, ids, q, k, v, do, grads=False)[0], fwd.o) > 1e-2


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_bad_token_index_is_refused(framework):
    index, ids, q, k, v, do = _problem(2, RING)
    with pytest.raises(ValueError, match=r"token_index must be \[batch, seq\]"):
        _run(framework, STRATEGIES["ring"], index[:, :-2], ids, q, k, v, do)
    with pytest.raises(TypeError, match="token_index must have an integer dtype"):
        _run(framework, STRATEGIES["ring"], index.astype(np.float32), ids, q, k, v, do)
    with pytest.raises(ValueError, match=r"token_index values must lie in \[0, "):
        _run(framework, STRATEGIES["ring"], index + 1, ids, q, k, v, do)
