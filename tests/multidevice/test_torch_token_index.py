"""Tier 2 — explicit token indices (``token_index``) through torch_impl's public API on gloo
worlds: packed documents laid out by the per-document zigzag (``seqplan.layouts.document_layout``)
against the float64 oracle computed in ORIGINAL order (forward and gradients, read back through
the layout's inverse), the static layout's indices equal to passing none, a wrong index caught,
and bad indices refused on every rank before any collective (``check_ranks`` comparing them).
Each rank takes its local shard of the global layout-order tensors, as a torch caller passes
them. The one-device replays' own checks are in tests/unit/test_token_index_replay.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import FULL
from parity.core.reference import attention_backward, attention_forward
from seqplan.layouts import document_layout, layout_permutation, pad_documents, static_token_index
from torch_tasks import bad_token_index_task, documents_task

HEADS, KV_HEADS, DIM = 4, 2, 8
NAMES = ("o", "lse", "dq", "dk", "dv")
# Two rows of packed documents in original order (a length-1 document among them).
DOCUMENTS = np.array([[0] * 9 + [1] + [2] * 14 + [3] * 3, [7] * 3 + [8] * 21 + [9] * 3])
MESHES = {"ring4": (("ring", 4),), "usp2x2": (("ring", 2), ("ulysses", 2)), "ulysses2": (("ulysses", 2),),
          "double2x2": (("ring_outer", 2), ("ring_inner", 2)), "data2-ring2": (("data", 2), ("ring", 2))}


def _original(ids: np.ndarray, seed: int) -> dict:
    """float64 q, k, v, do [b, T, ., d] and dlse [b, h, T] in original order."""
    rng = np.random.default_rng(seed)
    b, t = ids.shape
    x = {n: rng.standard_normal((b, t, h, DIM)) for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS),
                                                               ("do", HEADS))}
    x["dlse"] = rng.standard_normal((b, HEADS, t))
    return x


def _laid(x: np.ndarray, perm: np.ndarray, seq_axis: int = 1) -> np.ndarray:
    """``x`` in the per-row layout ``perm`` [b, T] along ``seq_axis`` (lse / dlse: 2)."""
    index = np.expand_dims(perm, tuple(range(2, x.ndim))) if seq_axis == 1 else perm[:, None, :]
    return np.take_along_axis(x, index, seq_axis)


def _world_run(worlds, axes, x: dict, perm: np.ndarray, *, layout: str, token_index, window=None,
               kv_exchange: str = "ring") -> dict:
    """o, lse, dq, dk, dv of the world on ``x`` (original order, plus "segment_ids") laid out by
    ``perm``, stitched and read back to original order."""
    sizes = dict(axes)
    laid = {n: torch.from_numpy(_laid(a, perm, 2 if n == "dlse" else 1).astype(np.float32)) for n, a in x.items()
            if n != "segment_ids"}
    laid["segment_ids"] = torch.from_numpy(_laid(x["segment_ids"], perm))
    if token_index is not None:
        laid["token_index"] = torch.from_numpy(np.ascontiguousarray(token_index))
    kwargs = dict(causal=True, layout=layout, window=window, kv_exchange=kv_exchange)
    shards = worlds(int(np.prod(list(sizes.values())))).run(documents_task, axes, laid, kwargs)
    inverse = np.argsort(perm, axis=1)
    out = {}
    for name in NAMES:
        seq_axis = 2 if name == "lse" else 1
        rows = [torch.cat([s[name] for s in sorted((s for s in shards if s["data"] == d), key=lambda s: s["block"])],
                          dim=seq_axis) for d in range(sizes.get("data", 1))]
        whole = torch.cat(rows, dim=0)
        out[name] = _laid(whole.double().numpy(), inverse, seq_axis)
    return out


def _rel(x, ref) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _truth(x: dict, **masks) -> dict:
    fwd = attention_forward(x["q"], x["k"], x["v"], causal=True, **masks)
    return dict(zip(NAMES, (fwd.o, fwd.lse, *attention_backward(fwd, x["q"], x["k"], x["v"], x["do"], x["dlse"]))))


TRUTH_CASES = [("ring4", "contiguous", None, "ring"), ("usp2x2", "zigzag", None, "ring"),
               ("ring4", "contiguous", (6, 0), "ring")]
# The other strategies with --full (RINGBRIDGE_FULL=1).
TRUTH_CASES += [pytest.param(*c, marks=pytest.mark.slow) for c in (
    ("ring4", "zigzag", None, "allgather"), ("ulysses2", "contiguous", (6, 0), "ring"),
    ("double2x2", "zigzag", None, "ring"), ("usp2x2", "contiguous", (3, 0), "allgather"),
    ("data2-ring2", "zigzag", None, "ring"))] if FULL else []


@pytest.mark.parametrize("mesh_name,layout,window,kv_exchange", TRUTH_CASES)
def test_document_zigzag_with_token_index_matches_float64_truth(mesh_name, layout, window, kv_exchange, worlds):
    """o, lse, dq, dk, dv of the per-document zigzag (segment ids and token indices, each rank its
    shard), read back to original order, equal the causal document-masked float64 oracle run in
    original order (float32 inputs: relative error 1e-5). With a window (on token indices) on
    the contiguous layout the ring must not be truncated as it is for the layout's positions."""
    axes = MESHES[mesh_name]
    sizes = dict(axes)
    ring, ulysses = sizes.get("ring", sizes.get("ring_outer", 1) * sizes.get("ring_inner", 1)), sizes.get("ulysses", 1)
    ids, _ = pad_documents(DOCUMENTS, ring, multiple=2 * ring * ulysses)
    row_layout = document_layout(ids, ring)
    x = _original(ids, seed=0) | {"segment_ids": ids}
    got = _world_run(worlds, axes, x, row_layout.perm, layout=layout, token_index=row_layout.token_index,
                     window=window, kv_exchange=kv_exchange)
    truth = _truth(x, segment_ids=ids, window=window)
    for name in NAMES:
        assert _rel(got[name], truth[name]) < 1e-5, (name, _rel(got[name], truth[name]))


def test_static_token_index_equals_the_default_and_a_wrong_one_is_caught(worlds):
    """On the zigzag layout, token indices equal to its static positions give the call without
    them (another schedule: non-causal blocks under the token-index window), forward and
    backward; on data laid out per document, the static indices are far from the truth."""
    ring, layout = 4, "zigzag"
    ids, _ = pad_documents(DOCUMENTS, ring)
    b, seq = ids.shape
    x = _original(ids, seed=1) | {"segment_ids": ids}
    perm = np.broadcast_to(layout_permutation(seq, layout, ring), (b, seq))
    axes = MESHES["ring4"]
    default = _world_run(worlds, axes, x, perm, layout=layout, token_index=None)
    static = _world_run(worlds, axes, x, perm, layout=layout,
                        token_index=static_token_index(seq, layout, ring, batch=b))
    for name in NAMES:
        np.testing.assert_allclose(static[name], default[name], rtol=1e-5, atol=1e-6, err_msg=name)
    truth = _truth(x, segment_ids=ids)
    assert _rel(default["o"], truth["o"]) < 1e-5  # the zigzag's own positions are right for zigzag data
    per_document = document_layout(ids, ring).perm
    wrong = _world_run(worlds, axes, x, per_document, layout=layout,
                       token_index=static_token_index(seq, layout, ring, batch=b))
    assert _rel(wrong["o"], truth["o"]) > 1e-2


Q_SHAPE = (1, 8, 4, 8)  # each rank's shard of a 32-token sequence on ring 4
BAD = [
    ("float dtype", (1, 8), "float32", 0, "TypeError", "token_index must have an integer dtype"),
    ("short", (1, 4), "int32", 0, "ValueError", "local token_index must be [batch, seq] = (1, 8)"),
    ("flat", (8,), "int32", 0, "ValueError", "local token_index must be [batch, seq] = (1, 8)"),
    ("past the end", (1, 8), "int32", 32, "ValueError", "local token_index values must lie in [0, 32)"),
    ("negative", (1, 8), "int64", -1, "ValueError", "local token_index values must lie in [0, 32)"),
]


@pytest.mark.parametrize("desc,index_shape,dtype,value,exc,message", BAD, ids=[b[0] for b in BAD])
def test_bad_token_index_same_error_on_every_rank(desc, index_shape, dtype, value, exc, message, worlds):
    results = worlds(4).run(bad_token_index_task, (("ring", 4),), Q_SHAPE, index_shape, dtype, value)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == exc and message in text, results[0]


def test_valid_token_index_reaches_the_tripwire(worlds):
    """The tripwire works: valid indices get past validation to the first collective."""
    results = worlds(4).run(bad_token_index_task, (("ring", 4),), Q_SHAPE, (1, 8), "int32", 31)
    assert all(kind == "AssertionError" and "collective was reached" in text for kind, text in results), results


def test_the_rank_check_compares_token_index(worlds):
    """check_ranks=True: a rank without token indices among ranks with them gets the same
    ValueError on every rank, naming their shape, before any attention collective."""
    results = worlds(4).run(bad_token_index_task, (("ring", 4),), Q_SHAPE, (1, 8), "int32", 0, True, (1,))
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, text = results[0]
    assert kind == "ValueError" and "token_index shape: from () to (1, 8)" in text, results[0]


@pytest.mark.parametrize("layout_name", ["document-hybrid", "zigzag"])
def test_allgather_one_varlen_call_per_rank_matches_float64_truth(layout_name, worlds):
    """All-gather-KV on ``aten_varlen`` (FlashAttention-2's varlen ops emulated, bf16 inputs): each
    rank's forward and backward are ONE varlen call against its gathered key prefixes
    (``torch_impl.allgather.prefix_plan``) — the per-document hybrid by token indices, the static
    zigzag by its own positions — and o, dq, dk, dv (after the reduce-scatter), read back to
    original order, equal the float64 oracle to bf16 accuracy."""
    from seqplan.layouts import hybrid_layout

    ring = 4
    ids, _ = pad_documents(DOCUMENTS, ring)
    b, seq = ids.shape
    x = _original(ids, seed=2) | {"segment_ids": ids}
    x["dlse"] = np.zeros_like(x["dlse"])  # the varlen backward takes no lse cotangent
    if layout_name == "zigzag":
        perm, token_index, layout = np.broadcast_to(layout_permutation(seq, "zigzag", ring), (b, seq)), None, "zigzag"
    else:
        row = hybrid_layout(ids, ring, split_at=12)
        perm, token_index, layout = row.perm, row.token_index, "contiguous"
    laid = {n: torch.from_numpy(_laid(a, perm, 2 if n == "dlse" else 1).astype(np.float32)) for n, a in x.items()
            if n != "segment_ids"}
    laid["segment_ids"] = torch.from_numpy(_laid(ids, perm))
    if token_index is not None:
        laid["token_index"] = torch.from_numpy(np.ascontiguousarray(token_index))
    kwargs = dict(causal=True, layout=layout, kv_exchange="allgather")
    shards = worlds(ring).run(documents_task, MESHES["ring4"], laid, kwargs, False, True)
    t = seq // ring
    for s in shards:
        real = [c for c in s["calls"] if c[1] > 1]  # the one-token call that fetches the rng state aside
        assert real == [("flash_forward", b * t), ("flash_backward", b * t)], real
    inverse = np.argsort(perm, axis=1)
    ordered = sorted(shards, key=lambda s: s["block"])
    truth = _truth(x, segment_ids=ids)
    for name in ("o", "dq", "dk", "dv"):
        whole = torch.cat([s[name] for s in ordered], dim=1).double().numpy()
        assert _rel(_laid(whole, inverse), truth[name]) < 2e-2, (name, _rel(_laid(whole, inverse), truth[name]))
