"""Tier 2 — all-gather KV's shared prefix (``shared_tokens``, seqplan.shared) through the public
API on 4 devices: packed documents on the per-document hybrid, where only each shard's leading
shared tokens travel, against the float64 oracle in original order — forward and gradients, at
the smallest value the ids allow, a larger one, the whole shard and none shared (0 on ids whose
documents all stay home); a value the ids break refused on every rank; and the one-call kernel
path (FlashAttention-2's varlen ops emulated in bfloat16) equal to the portable one. Why: the
split computes each query's keys in one of two parts with no merge, and gathers and
reduce-scatters only the prefixes — an off-by-one there is a wrong gradient, not a crash."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.core.reference import attention_backward, attention_forward
from seqplan.layouts import hybrid_layout, pad_documents
from seqplan.shared import ring_shards, shared_extent
from torch_tasks import documents_task

RING = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
NAMES = ("o", "lse", "dq", "dk", "dv")
# Two rows of 128 tokens: one document long enough to be split over the ring (40 and 32 tokens)
# among short ones kept whole.
LENGTHS = ([5, 4, 2, 5, 2, 4, 4, 2, 1, 6, 6, 4, 4, 1, 4, 6, 6, 40, 5, 4, 2, 1, 1, 4, 5],
           [1, 2, 5, 1, 5, 5, 4, 2, 4, 6, 4, 3, 3, 3, 6, 4, 32, 3, 5, 6, 5, 2, 3, 3, 6, 5])
DOCUMENTS = np.stack([np.repeat(np.arange(len(n)) + 100 * i, n) for i, n in enumerate(LENGTHS)])


def _problem(seed: int, ids=DOCUMENTS, split_at: int = 20):
    padded, _ = pad_documents(ids, RING)
    layout = hybrid_layout(padded, RING, split_at=split_at)
    rng = np.random.default_rng(seed)
    b, seq = padded.shape
    x = {n: rng.standard_normal((b, seq, h, DIM)) for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS),
                                                                 ("do", HEADS))}
    x["dlse"] = rng.standard_normal((b, HEADS, seq))
    return padded, layout, x


def _laid(x, perm, seq_axis=1):
    index = np.expand_dims(perm, tuple(range(2, x.ndim))) if seq_axis == 1 else perm[:, None, :]
    return np.take_along_axis(x, index, seq_axis)


def _run(worlds, x, ids, layout, **kwargs):
    laid = {n: torch.from_numpy(_laid(a, layout.perm, 2 if n == "dlse" else 1).astype(np.float32))
            for n, a in x.items()}
    laid["segment_ids"] = torch.from_numpy(_laid(ids, layout.perm).astype(np.int32))
    laid["token_index"] = torch.from_numpy(np.ascontiguousarray(layout.token_index))
    shards = worlds(RING).run(documents_task, (("ring", RING),), laid,
                              dict(causal=True, layout="contiguous", kv_exchange="allgather") | kwargs)
    if any("error" in s for s in shards if isinstance(s, dict)):
        return shards
    inverse = np.argsort(layout.perm, axis=1)
    out = {}
    for name in NAMES:
        seq_axis = 2 if name == "lse" else 1
        whole = torch.cat([s[name] for s in sorted(shards, key=lambda s: s["block"])], dim=seq_axis)
        out[name] = _laid(whole.double().numpy(), inverse, seq_axis)
    return out


def _truth(x, ids):
    fwd = attention_forward(x["q"], x["k"], x["v"], causal=True, segment_ids=ids)
    return dict(zip(NAMES, (fwd.o, fwd.lse, *attention_backward(fwd, x["q"], x["k"], x["v"], x["do"], x["dlse"]))))


def _rel(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_shared_prefix_matches_float64_truth(worlds):
    ids, layout, x = _problem(seed=0)
    laid_ids = _laid(ids, layout.perm)
    extent = shared_extent(ring_shards(laid_ids, RING))
    t = ids.shape[1] // RING
    assert 0 < extent < t, "the case must have shared and whole documents"
    truth = _truth(x, ids)
    for shared_tokens in (extent, extent + 3, t):
        got = _run(worlds, x, ids, layout, shared_tokens=shared_tokens)
        for name in NAMES:
            assert _rel(got[name], truth[name]) < 1e-5, (shared_tokens, name, _rel(got[name], truth[name]))


def test_nothing_shared_gathers_nothing(worlds):
    """Documents short enough to stay whole: ``shared_tokens=0``, no part gathered, still exact."""
    ids = np.repeat(np.arange(16), 4)[None]  # 16 documents of 4 tokens, 16 a shard
    ids, layout, x = _problem(seed=1, ids=ids, split_at=64)
    assert shared_extent(ring_shards(_laid(ids, layout.perm), RING)) == 0
    got, truth = _run(worlds, x, ids, layout, shared_tokens=0), _truth(x, ids)
    for name in NAMES:
        assert _rel(got[name], truth[name]) < 1e-5, (name, _rel(got[name], truth[name]))


def test_a_broken_promise_is_refused_on_every_rank(worlds):
    ids, layout, x = _problem(seed=2)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    with pytest.raises(Exception, match=f"these ids need shared_tokens >= {extent}"):
        _run(worlds, x, ids, layout, shared_tokens=extent - 1)


def test_the_one_call_kernel_path_equals_the_portable_one(worlds):
    """bfloat16 on ``aten_varlen`` with FA2's varlen ops emulated: each part one varlen call, forward
    and backward (4 ranks x 2 parts each way), equal to the float64 truth at bfloat16's level."""
    ids, layout, x = _problem(seed=3)
    extent = shared_extent(ring_shards(_laid(ids, layout.perm), RING))
    laid = {n: torch.from_numpy(_laid(a, layout.perm, 2 if n == "dlse" else 1).astype(np.float32))
            for n, a in x.items()}
    laid["segment_ids"] = torch.from_numpy(_laid(ids, layout.perm).astype(np.int32))
    laid["token_index"] = torch.from_numpy(np.ascontiguousarray(layout.token_index))
    shards = worlds(RING).run(documents_task, (("ring", RING),), laid,
                              dict(causal=True, layout="contiguous", kv_exchange="allgather", shared_tokens=extent),
                              False, True)  # count=False, emulate_varlen=True
    t = ids.shape[1] // RING
    for s in shards:  # each part one call (query rows: b·P, then b·(t - P)); a one-row forward probes the rng state
        parts = [c for c in s["calls"] if c[1] > 1]
        want = [(op, rows) for op in ("flash_forward", "flash_backward") for rows in (2 * (t - extent), 2 * extent)]
        assert sorted(parts) == sorted(want), s["calls"]
    inverse = np.argsort(layout.perm, axis=1)
    fwd = attention_forward(x["q"], x["k"], x["v"], causal=True, segment_ids=ids)
    grads = attention_backward(fwd, x["q"], x["k"], x["v"], x["do"], np.zeros_like(x["dlse"]))
    for name, want in zip(("o", "dq", "dk", "dv"), (fwd.o, *grads)):
        whole = torch.cat([s[name] for s in sorted(shards, key=lambda s: s["block"])], dim=1)
        got = _laid(whole.double().numpy(), inverse)
        assert _rel(got, want) < 2e-2, (name, _rel(got, want))
