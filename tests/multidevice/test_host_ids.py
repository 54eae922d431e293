"""Tier 2 — torch's ``host_ids`` block on gloo ranks: packed documents on the per-document hybrid,
the calls reading every ring shard's ids and token indices from the caller's host arrays instead
of copying the gathered ones off the device (that copy is made to fail inside the block), bit for
bit the result without the block — ring 4 with all-gather KV and its shared prefix, USP 2×2 on the
ring exchange; a host copy that differs from the ids the ranks pass gives NaN, not an answer; a
block whose rows are not the call's is refused before any collective. Why: the copy waits for all
of the GPU's queued work once per call (once per layer); the block removes it, and must change no
bit and hide no mismatch."""

from __future__ import annotations

import numpy as np
import pytest

from seqplan.layouts import hybrid_layout, pad_documents
from seqplan.shared import ring_shards, shared_extent
from torch_tasks import documents_task

HEADS, KV_HEADS, DIM = 4, 2, 8
NAMES = ("o", "lse", "dq", "dk", "dv")
LENGTHS = ([5, 4, 2, 5, 2, 4, 4, 2, 1, 6, 6, 4, 4, 1, 4, 6, 6, 40, 5, 4, 2, 1, 1, 4, 5],
           [1, 2, 5, 1, 5, 5, 4, 2, 4, 6, 4, 3, 3, 3, 6, 4, 32, 3, 5, 6, 5, 2, 3, 3, 6, 5])
DOCUMENTS = np.stack([np.repeat(np.arange(len(n)) + 100 * i, n) for i, n in enumerate(LENGTHS)])
MESHES = {  # (mesh axes, ring size, call keywords)
    "ring 4, all-gather KV, shared prefix": ((("ring", 4),), 4, dict(kv_exchange="allgather")),
    "USP 2x2, ring exchange": ((("ring", 2), ("ulysses", 2)), 2, dict(kv_exchange="ring")),
}


def _laid_problem(ring: int, seed: int = 0):
    torch = pytest.importorskip("torch")
    ids, _ = pad_documents(DOCUMENTS, ring, 2 * ring * 2)
    layout = hybrid_layout(ids, ring, split_at=20)
    laid_ids = np.take_along_axis(ids, layout.perm, 1).astype(np.int32)
    rng = np.random.default_rng(seed)
    b, seq = ids.shape
    x = {n: torch.from_numpy(rng.standard_normal((b, seq, h, DIM)).astype(np.float32))
         for n, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS), ("do", HEADS))}
    x["dlse"] = torch.from_numpy(rng.standard_normal((b, HEADS, seq)).astype(np.float32))
    x["segment_ids"] = torch.from_numpy(laid_ids)
    x["token_index"] = torch.from_numpy(np.ascontiguousarray(layout.token_index))
    return x, laid_ids, layout.token_index.astype(np.int32)


def _call(worlds, axes, x, kwargs, host=None):
    shards = worlds(int(np.prod([n for _, n in axes]))).run(
        documents_task, axes, x, dict(causal=True, layout="contiguous") | kwargs, False, False, host)
    return sorted(shards, key=lambda s: (s["data"], s["block"]))


@pytest.mark.parametrize("name", list(MESHES))
def test_host_ids_change_no_bit_and_copy_nothing(worlds, name):
    torch = pytest.importorskip("torch")
    axes, ring, kwargs = MESHES[name]
    x, laid_ids, token_index = _laid_problem(ring)
    if kwargs["kv_exchange"] == "allgather":
        kwargs = kwargs | {"shared_tokens": shared_extent(ring_shards(laid_ids, ring))}
    plain = _call(worlds, axes, x, kwargs)
    held = _call(worlds, axes, x, kwargs, host={"segment_ids": laid_ids, "token_index": token_index})
    for a, b in zip(plain, held):
        for n in NAMES:
            assert torch.equal(a[n], b[n]), (name, a["coords"], n)


def test_a_host_copy_that_differs_gives_nan_everywhere(worlds):
    axes, ring, kwargs = MESHES["USP 2x2, ring exchange"]
    x, laid_ids, token_index = _laid_problem(ring, seed=1)
    wrong = laid_ids.copy()
    wrong[1, 7] += 1000  # one token's id on one row: every rank gathers the true ids and sees it
    for s in _call(worlds, axes, x, kwargs, host={"segment_ids": wrong, "token_index": token_index}):
        assert bool(s["o"].isnan().all()) and bool(s["lse"].isnan().all()), s["coords"]
    wrong_index = token_index.copy()
    wrong_index[0, [3, 4]] = wrong_index[0, [4, 3]]
    for s in _call(worlds, axes, x, kwargs, host={"segment_ids": laid_ids, "token_index": wrong_index}):
        assert bool(s["o"].isnan().all()), s["coords"]


def test_a_block_that_is_not_the_calls_is_refused(worlds):
    axes, ring, kwargs = MESHES["ring 4, all-gather KV, shared prefix"]
    x, laid_ids, token_index = _laid_problem(ring)
    with pytest.raises(Exception, match=r"host_ids: the block's rows are \(2, 64\)"):
        _call(worlds, axes, x, kwargs, host={"segment_ids": laid_ids[:, :64], "token_index": token_index[:, :64]})
    with pytest.raises(Exception, match="give the block token_index exactly when the calls pass token_index"):
        _call(worlds, axes, x, kwargs, host={"segment_ids": laid_ids})


def test_host_ids_refuses_what_is_not_rows_of_ids():
    pytest.importorskip("torch")
    import torch_impl

    with pytest.raises(TypeError, match=r"segment_ids must be an integer \[b, seq\] array"):
        with torch_impl.host_ids(np.zeros(8, np.int32)):
            pass
    with pytest.raises(ValueError, match="token_index .* must have segment_ids' shape"):
        with torch_impl.host_ids(np.zeros((1, 8), np.int32), np.zeros((1, 4), np.int32)):
            pass
    ids = np.arange(8)[None]
    with torch_impl.host_ids(ids) as held:
        ids[0, 0] = 99  # a later write to the caller's array does not reach the block's copy
        assert held.segment_ids[0, 0] == 0 and not held.segment_ids.flags.writeable
    assert torch_impl.loop.declared_host_ids() is None


def test_a_blocks_plans_are_made_once_and_never_hashed(monkeypatch):
    """Inside a ``host_ids`` block the calls' host arrays are the block's own, read-only: a plan
    made from them is kept in the block by which of its arrays it came from, so the next call
    (the next layer) takes it without hashing the ids (``cached_plan`` is never asked). An equal
    copy that is not the block's array still goes through ``cached_plan``, which checks content."""
    torch = pytest.importorskip("torch")
    import torch_impl
    from torch_impl import loop
    from torch_impl.config import make_config

    asked, made = [], []
    monkeypatch.setattr(loop, "cached_plan", lambda planner, *a, **f: asked.append(planner) or planner(*a, **f))

    def planner(ids, index, *, device):
        made.append(device)
        return ids.sum() + index.sum() + device

    ring, ids, index = 2, DOCUMENTS[:, :64].astype(np.int32), np.tile(np.arange(64, dtype=np.int32), (2, 1))
    config = make_config(torch.zeros(2, 32, 2, 8), causal=True, layout="contiguous", scale=None, block_backend="auto",
                         deterministic=None, token_index=True)
    with torch_impl.host_ids(ids, index) as held:
        block = held.shards(ring)
        assert not block.ids.flags.writeable and not block.index.flags.writeable
        gathered = torch.from_numpy(block.ids.copy()), torch.from_numpy(block.index.copy())
        calls = [loop.ShardMasks.build(config, ring, 32, gathered[0], "cpu", gathered[1], block) for _ in range(2)]
        plans = [m.plan(planner, m.ids_host, m.positions, device=1) for m in calls]
        assert plans[0] == plans[1] and made == [1] and not asked
        last = calls[1]
        last.plan(planner, last.ids_host, last.positions, device=0)  # another flag: its own plan
        assert made == [1, 0] and not asked
        copy = last.plan(planner, last.ids_host.copy(), last.positions, device=1)  # not the block's array
        assert copy == plans[0] and asked == [planner] and made == [1, 0, 1]


def test_the_checks_run_the_block_the_driver_times(monkeypatch):
    """``RINGBRIDGE_HOST_IDS=1``: the parity runner's ranks call inside ``host_ids`` over their data
    block's rows (the driver's rows time the same block), and outside it without the variable."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from parity.runners.torch_runner import host_ids_block
    from torch_impl.loop import declared_host_ids

    ids, index = np.arange(16).reshape(4, 4) // 2, np.tile(np.arange(4), (4, 1))
    x, case = SimpleNamespace(segment_ids=ids, token_index=index), SimpleNamespace(data=2)
    monkeypatch.delenv("RINGBRIDGE_HOST_IDS", raising=False)
    with host_ids_block(x, case, {"data": 1}):
        assert declared_host_ids() is None
    monkeypatch.setenv("RINGBRIDGE_HOST_IDS", "1")
    with host_ids_block(x, case, {"data": 1}):
        held = declared_host_ids()
        np.testing.assert_array_equal(held.segment_ids, ids[2:])
        np.testing.assert_array_equal(held.token_index, index[2:])


def test_a_call_without_ids_keeps_its_own_token_index_check():
    """A block with token indices does not stand in for a call that passes no segment ids (the
    block does not apply to it): the call's own indices are range-checked, out of range refused."""
    torch = pytest.importorskip("torch")
    import torch_impl
    from torch_impl.api import _check_token_index

    q = torch.zeros(1, 4, 2, 8)
    bad = torch.tensor([[0, 1, 2, 99]])
    with torch_impl.host_ids(np.zeros((1, 8), np.int32), np.arange(8)[None]):
        with pytest.raises(ValueError, match="token_index values must lie in"):
            _check_token_index(bad, q, 8)  # documents=False: the block is not this call's
        _check_token_index(bad, q, 8, documents=True)  # the block's range stands in (the device compare catches the rest)

