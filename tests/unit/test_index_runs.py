"""Tier 1 — ``seqplan.documents.index_runs``, the run list of a block whose causal mask is by token
index (``token_index`` calls), proved against the mask it stands for: per-run attention in place,
under the one varlen mask it returns, sees exactly the pairs "same document and key index <= query
index" allows — on every block of the per-document zigzag (which it must express) and of the
static layouts, and on shuffled indices, which it may refuse (None) but never approximate."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import pairs_from_runs, sorted_document_ids
from seqplan.documents import index_runs
from seqplan.layouts import (
    DOCUMENT_HYBRID,
    DOCUMENT_ZIGZAG,
    document_layout,
    hybrid_layout,
    layout_permutation,
    pad_documents,
)


def _pairs_by_index(q_ids, kv_ids, q_index, kv_index) -> np.ndarray:
    b, t = q_index.shape
    s = kv_index.shape[1]
    seen = np.zeros((b * t, b * s), bool)
    for row in range(b):
        block = (q_ids[row][:, None] == kv_ids[row][None, :]) & (kv_index[row][None, :] <= q_index[row][:, None])
        seen[row * t:(row + 1) * t, row * s:(row + 1) * s] = block
    return seen


def _check(q_ids, kv_ids, q_index, kv_index, must: bool) -> str | None:
    """Assert the runs are exact; returns the mask used ("causal" / "full") or None if refused."""
    got = index_runs(q_ids, kv_ids, q_index, kv_index)
    if got is None:
        assert not must, "a block of a layout the runs must express was refused"
        return None
    runs, causal = got
    b, t = q_index.shape
    seen = pairs_from_runs(runs, b, t, kv_index.shape[1], causal)
    np.testing.assert_array_equal(seen, _pairs_by_index(q_ids, kv_ids, q_index, kv_index))
    if runs.empty_rows is not None:  # the adapter zeroes exactly the rows that see nothing
        np.testing.assert_array_equal(runs.empty_rows, ~seen.any(1))
    return "causal" if causal else "full"


def _blocks(ids, index, ring: int):
    """Every (device, source) block of a ring over ``ring`` shards, in layout order."""
    t = ids.shape[1] // ring
    part = lambda x, r: x[:, r * t:(r + 1) * t]
    for device in range(ring):
        for source in range(ring):
            yield device, source, part(ids, device), part(ids, source), part(index, device), part(index, source)


def _row_layout(name: str, ids, ring: int, rng):
    if name == DOCUMENT_ZIGZAG:
        return document_layout(ids, ring)
    return hybrid_layout(ids, ring, split_at=2 * ring * int(rng.integers(1, 4)))


@pytest.mark.parametrize("name", [DOCUMENT_ZIGZAG, DOCUMENT_HYBRID])
@pytest.mark.parametrize("trial", range(8))
def test_per_row_layouts_every_block_exact(name, trial, seed):
    """The layouts the runs exist for: every block expressible — the diagonal one causal run per
    document, every other block full runs — and exact."""
    rng = np.random.default_rng(seed + trial)
    ring, b = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    ids, _ = pad_documents(sorted_document_ids(rng, b, int(rng.integers(2, 40))), ring)
    layout = _row_layout(name, ids, ring, rng)
    laid = np.take_along_axis(ids, layout.perm, 1)
    for device, source, *block in _blocks(laid, layout.token_index, ring):
        mask = _check(*block, must=True)
        assert mask == ("causal" if device == source else "full")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("trial", range(6))
def test_static_layouts_as_token_indices(layout, trial, seed):
    """Token indices equal to a static layout's: every block of the contiguous layout is
    expressible; zigzag blocks may be refused (a document spanning both halves of a shard) but
    are exact whenever taken. Also without ids (one document per row)."""
    rng = np.random.default_rng(seed + 50 + trial)
    ring, b = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    seq = 2 * ring * int(rng.integers(1, 8))
    ids = sorted_document_ids(rng, b, seq)
    index = np.broadcast_to(layout_permutation(seq, layout, ring), (b, seq)).astype(np.int32)
    laid = np.take_along_axis(ids, index, 1)
    for _, _, q_ids, kv_ids, q_index, kv_index in _blocks(laid, index, ring):
        _check(q_ids, kv_ids, q_index, kv_index, must=layout == "contiguous")
        _check(np.zeros_like(q_ids), np.zeros_like(kv_ids), q_index, kv_index, must=layout == "contiguous")
        bare, one = (index_runs(ids, ids_k, q_index, kv_index)
                     for ids, ids_k in ((None, None), (np.zeros_like(q_ids), np.zeros_like(kv_ids))))
        assert (bare is None) == (one is None)
        if bare is not None:
            assert bare[1] == one[1] and np.array_equal(bare[0].cu_q, one[0].cu_q)
            assert np.array_equal(bare[0].cu_k, one[0].cu_k)


@pytest.mark.parametrize("trial", range(20))
def test_shuffled_indices_refused_or_exact(trial, seed):
    """Arbitrary token indices: whatever is taken is exact (most are refused)."""
    rng = np.random.default_rng(seed + 100 + trial)
    b, t, s = int(rng.integers(1, 3)), int(rng.integers(1, 10)), int(rng.integers(1, 10))
    q_ids, kv_ids = (np.sort(rng.integers(0, 3, (b, n)), 1) for n in (t, s))
    q_index, kv_index = (rng.permutation(40)[:n] for n in (t, s))
    q_index = np.stack([np.sort(q_index) if rng.random() < 0.5 else q_index] * b)
    kv_index = np.stack([np.sort(kv_index) if rng.random() < 0.7 else kv_index] * b)
    _check(q_ids, kv_ids, q_index, kv_index, must=False)


def test_needs_both_masks_refused():
    """One document square (causal) beside one whose queries all follow its keys (full): one
    varlen call applies one mask, so the block is refused rather than run under either."""
    q_ids = kv_ids = np.array([[0, 0, 1, 1]])
    q_index = np.array([[0, 1, 12, 13]])
    kv_index = np.array([[0, 1, 10, 11]])
    assert index_runs(q_ids, kv_ids, q_index, kv_index) is None
    assert index_runs(q_ids[:, :2], kv_ids[:, :2], q_index[:, :2], kv_index[:, :2])[1] is True
    assert index_runs(q_ids[:, 2:], kv_ids[:, 2:], q_index[:, 2:], kv_index[:, 2:])[1] is False


# ---- the traced counterpart (JAX): index_segments' new ids, index_dispatch's conditions ----------

def _check_traced(q_ids, kv_ids, q_index, kv_index, must: bool) -> None:
    """index_segments' ids stand for the token-index mask exactly whenever ``ok``; on a diagonal
    block of increasing documents the causal document mask does."""
    jnp = pytest.importorskip("jax.numpy")
    from jax_impl.kernels.runs import increasing_in_documents, index_segments

    truth = _pairs_by_index(q_ids, kv_ids, q_index, kv_index)
    b, t = q_index.shape
    s = kv_index.shape[1]
    if t == s and np.array_equal(q_index, kv_index) and np.array_equal(q_ids, kv_ids):
        ok = bool(increasing_in_documents(jnp.asarray(q_ids), jnp.asarray(q_index)))
        assert ok or not must
        if ok:
            causal = np.zeros_like(truth)
            for row in range(b):
                causal[row * t:(row + 1) * t, row * s:(row + 1) * s] = ((q_ids[row][:, None] == kv_ids[row][None, :])
                                                                        & np.tri(t, s, dtype=bool))
            np.testing.assert_array_equal(causal, truth)
        return
    import jax

    traced = jax.jit(index_segments)  # one compiled program per shape (eager dispatch is slower)
    q_new, kv_new, ok = (np.asarray(x) for x in traced(*(jnp.asarray(x) for x in (q_ids, kv_ids, q_index, kv_index))))
    assert bool(ok) or not must, "a block of a layout the new ids must express was refused"
    if bool(ok):
        got = np.zeros_like(truth)
        for row in range(b):
            got[row * t:(row + 1) * t, row * s:(row + 1) * s] = q_new[row][:, None] == kv_new[row][None, :]
        np.testing.assert_array_equal(got, truth)


@pytest.mark.parametrize("name", [DOCUMENT_ZIGZAG, DOCUMENT_HYBRID])
@pytest.mark.parametrize("trial", range(3))
def test_traced_forms_of_the_per_row_layouts(name, trial, seed):
    rng = np.random.default_rng(seed + 200 + trial)
    ring, b = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    ids, _ = pad_documents(sorted_document_ids(rng, b, int(rng.integers(2, 40))), ring)
    layout = _row_layout(name, ids, ring, rng)
    laid = np.take_along_axis(ids, layout.perm, 1).astype(np.int32)
    for _, _, *block in _blocks(laid, layout.token_index.astype(np.int32), ring):
        _check_traced(*block, must=True)


@pytest.mark.parametrize("trial", range(8))
def test_traced_forms_refuse_or_are_exact(trial, seed):
    rng = np.random.default_rng(seed + 300 + trial)
    b, t, s = int(rng.integers(1, 3)), int(rng.integers(1, 10)), int(rng.integers(1, 10))
    q_ids, kv_ids = (np.sort(rng.integers(0, 3, (b, n)), 1).astype(np.int32) for n in (t, s))
    q_index, kv_index = (rng.permutation(40)[:n] for n in (t, s))
    q_index = np.stack([np.sort(q_index) if rng.random() < 0.5 else q_index] * b).astype(np.int32)
    kv_index = np.stack([np.sort(kv_index) if rng.random() < 0.7 else kv_index] * b).astype(np.int32)
    _check_traced(q_ids, kv_ids, q_index, kv_index, must=False)


def test_plans_are_remembered_by_content():
    """``cached_plan``: equal contents (another array object) reuse the plan; a changed id, index,
    dtype or flag plans again — a stale run list would silently mask the wrong pairs."""
    from seqplan.documents import cached_plan

    calls = []

    def planner(*arrays, **flags):
        calls.append(1)
        return index_runs(*arrays)

    ids, index = np.array([[0, 0, 1, 1]]), np.array([[0, 1, 2, 3]])
    first = cached_plan(planner, ids, ids, index, index)
    assert cached_plan(planner, ids.copy(), ids.copy(), index.copy(), index.copy()) is first and len(calls) == 1
    for changed in ([[0, 1, 1, 1]], [[0, 0, 1, 2]]):
        cached_plan(planner, np.array(changed), ids, index, index)
    cached_plan(planner, ids.astype(np.int16), ids, index, index)
    cached_plan(planner, None, None, index, index)
    assert len(calls) == 5
    cached_plan(planner, ids, ids, index, index, causal=True)
    cached_plan(planner, ids, ids, index, index, causal=False)
    assert len(calls) == 7  # flags are part of the key
    from seqplan.documents import forget_plans

    forget_plans()  # the benchmarks' fresh-plans rows: the same ids plan again, as a new batch's would
    again = cached_plan(planner, ids, ids, index, index)
    assert len(calls) == 8 and again is not first


def test_a_checksum_collision_plans_again(monkeypatch):
    """The cache's CRC-32 key is confirmed against the arrays on a hit: with every checksum forced
    equal, other contents still get their own plan, never the one stored under the same key."""
    import zlib

    from seqplan import documents

    monkeypatch.setattr(zlib, "crc32", lambda data: 7)
    ids, index = np.array([[0, 0, 1, 1]]), np.array([[0, 1, 2, 3]])
    first = documents.cached_plan(index_runs, ids, ids, index, index)
    other = np.array([[0, 1, 1, 1]])
    second = documents.cached_plan(index_runs, other, other, index, index)
    assert second is not first and np.array_equal(second[0].cu_q, index_runs(other, other, index, index)[0].cu_q)


def test_far_apart_ids_do_not_collide():
    """3·id + 1 for id 1431655765 wraps to 0 = 3·0 in int32: the new ids are built from each id's
    rank in the row, so a query that sees nothing (document B, its keys all later) never meets
    document 0's keys — on the host and traced alike."""
    far = 1431655765  # 3·far + 1 == 2**32
    q_ids = kv_ids = np.array([[0, 0, far, far]], np.int32)
    q_index, kv_index = np.array([[4, 5, 12, 13]], np.int32), np.array([[0, 1, 14, 15]], np.int32)
    assert _check(q_ids, kv_ids, q_index, kv_index, must=True) == "full"
    _check_traced(q_ids, kv_ids, q_index, kv_index, must=True)


# ---- prefix_runs: a device's queries against every key in one call (all-gather-KV) ---------------

def _prefix_pairs(plan, b: int, t: int, s: int) -> np.ndarray:
    """The pairs FlashAttention's bottom-right causal mask sees over the plan's gathered keys."""
    seen = np.zeros((b * t, b * s), bool)
    for n in range(len(plan.cu_q) - 1):
        queries = np.arange(plan.cu_q[n], plan.cu_q[n + 1])
        keys = plan.key_index[plan.cu_k[n]:plan.cu_k[n + 1]]
        for i, query in enumerate(queries):
            seen[query, keys[: len(keys) - len(queries) + 1 + i]] = True
    return seen


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", DOCUMENT_ZIGZAG, DOCUMENT_HYBRID, "shuffled"])
def test_prefix_runs_see_exactly_the_causal_document_pairs(layout, seed):
    """Every device's plan of a ring of 4, queries against the whole sequence, sees exactly "same
    document and key index <= query index" — on the static, per-row and shuffled layouts (for
    the shuffled one each query may be its own run: exact still, only longer)."""
    from seqplan.documents import prefix_runs

    rng = np.random.default_rng(seed)
    ring, ids = 4, np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3])
    ids, _ = pad_documents(ids, ring)
    b, seq = ids.shape
    if layout in ("contiguous", "zigzag"):
        perm = np.broadcast_to(layout_permutation(seq, layout, ring), (b, seq))
    elif layout == "shuffled":
        perm = np.stack([rng.permutation(seq) for _ in range(b)])
    else:
        perm = (document_layout(ids, ring) if layout == DOCUMENT_ZIGZAG else hybrid_layout(ids, ring, split_at=30)).perm
    laid = np.take_along_axis(ids, perm, 1)
    t = seq // ring
    for r in range(ring):
        part = slice(r * t, (r + 1) * t)
        plan = prefix_runs(laid[:, part], laid, perm[:, part], perm)
        assert plan is not None
        assert np.array_equal(_prefix_pairs(plan, b, t, seq), _pairs_by_index(laid[:, part], laid, perm[:, part], perm))
        if layout != "shuffled":  # a device's pieces of documents: few runs, keys within a chunk per document
            assert len(plan.cu_q) - 1 <= 2 * b * len(np.unique(laid[:, part])), len(plan.cu_q)
            assert plan.keys <= b * seq + 2 * b * t


def test_prefix_runs_key_documents_by_shifted_ids_or_by_rank_alike(monkeypatch):
    """``prefix_runs`` sorts (document, token index) as one int64: the ids shifted to start at 0,
    or — where ids lie too far apart for that — their ranks. A run's keys are its document's,
    wherever the document sorts, so any one-to-one relabelling of the ids gives the same plan:
    negative ids near -2³¹, ids relabelled out of order, and int64 ids 2⁵⁸ apart (the ranks'
    path) plan exactly like small ones, and see exactly the causal document pairs."""
    from seqplan.documents import prefix_runs

    ids = np.array([[0] * 9 + [1] + [2] * 30 + [3] * 4, [7] * 3 + [8] * 37 + [9] * 4])
    index = np.stack([np.r_[np.arange(22) * 2, np.arange(22) * 2 + 1]] * 2)  # each row zigzagged in two
    b, seq = ids.shape
    t = seq // 2
    small = prefix_runs(ids[:, :t], ids, index[:, :t], index)
    relabelled = {"negative": ids - 2 ** 31 + 20, "out of order": (ids * 7919) % 10007 - 5000,
                  "2^58 apart": ids.astype(np.int64) << 58}
    ranked = []
    real_unique = np.unique
    monkeypatch.setattr(np, "unique", lambda *a, **k: ranked.append(1) or real_unique(*a, **k))  # the ranks' path sorts
    for name, far in relabelled.items():
        assert len(real_unique(far)) == len(real_unique(ids))  # one-to-one
        ranked.clear()
        plan = prefix_runs(far[:, :t], far, index[:, :t], index)
        assert bool(ranked) == (name == "2^58 apart"), name  # the path the test means to take
        for field in ("cu_q", "cu_k", "key_index"):
            assert np.array_equal(getattr(plan, field), getattr(small, field)), (name, field)
        assert (plan.max_q, plan.max_k) == (small.max_q, small.max_k), name
        assert np.array_equal(_prefix_pairs(plan, b, t, seq), _pairs_by_index(far[:, :t], far, index[:, :t], index))


def test_prefix_runs_refuse_what_they_cannot_express():
    """None, never an approximation: a query whose own key is absent (it would see nothing), a
    negative index, and more gathered keys than ``max_keys``."""
    from seqplan.documents import prefix_runs

    index = np.arange(8)[None]
    ids = np.zeros((1, 8), np.int32)
    assert prefix_runs(ids[:, :4], ids[:, 4:], index[:, :4], index[:, 4:]) is None  # keys all after the queries
    assert prefix_runs(ids, ids, index - 1, index) is None
    shuffled = np.array([[3, 0, 6, 1, 7, 2, 5, 4]])
    assert prefix_runs(ids, ids, shuffled, shuffled, max_keys=8) is None  # 8 one-query runs: 36 keys
    assert prefix_runs(ids, ids, shuffled, shuffled).keys == 36


@pytest.mark.parametrize("layout", ["zigzag", DOCUMENT_HYBRID, "shuffled"])
def test_traced_plans_trimmed_from_the_largest_equal_their_own(layout, seed, monkeypatch):
    """``jax_impl.kernels.runs.prefix_plans`` builds only its largest plan and trims the others
    from it (``trimmed_plan``): each equals :func:`prefix_runs` built for its own slot count —
    the same ``ok`` always, and where it fits (the only plans the switch runs) the same offsets,
    key index and longest run. Slot counts from 2 (short of every layout here) up, so both sides
    of ``ok`` are met on the ordered layouts; on the shuffled one the short plans never fit, and
    whether the largest does depends on the draw (a shard of 12 queries can hold few enough runs)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    monkeypatch.setattr(runs, "PREFIX_SLOTS", (2, 3, 4, 6, 8, 16, 64))
    rng = np.random.default_rng(seed)
    ring, ids = 4, np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3])
    ids, _ = pad_documents(ids, ring)
    b, seq = ids.shape
    if layout == "zigzag":
        perm = np.broadcast_to(layout_permutation(seq, layout, ring), (b, seq))
    elif layout == "shuffled":
        perm = np.stack([rng.permutation(seq) for _ in range(b)])
    else:
        perm = hybrid_layout(ids, ring, split_at=30).perm
    laid, t = np.take_along_axis(ids, perm, 1).astype(np.int32), seq // ring

    @jax.jit  # one compile for every shard (the same shapes)
    def both(q_ids, kv_ids, q_index, kv_index, cap=runs.PREFIX_KEY_FACTOR * b * seq):
        own = [runs.prefix_runs(q_ids, kv_ids, q_index, kv_index, plan.cu_q.shape[0] - 1, cap)
               for plan in runs.prefix_plans(q_ids, kv_ids, q_index, kv_index)]
        return runs.prefix_plans(q_ids, kv_ids, q_index, kv_index), own

    fits = set()
    for r in range(ring):
        part = slice(r * t, (r + 1) * t)
        args = tuple(jnp.asarray(x, jnp.int32) for x in (laid[:, part], laid, perm[:, part], perm))
        trimmed, own = both(*args)
        assert len(trimmed) > 1
        for plan, want in zip(trimmed, own):
            assert plan.cu_q.shape == want.cu_q.shape and bool(plan.ok) == bool(want.ok)
            fits.add(bool(want.ok))
            if want.ok:
                for name in ("cu_q", "cu_k", "kv_index", "covered_q", "longest"):
                    assert np.array_equal(getattr(plan, name), getattr(want, name)), (layout, r, name)
                # every query in a run that reads a key: what lets the kernels skip their selects over o / dq
                cu_q, cu_k = np.asarray(want.cu_q), np.asarray(want.cu_k)
                run = np.searchsorted(cu_q, np.arange(cu_q[-1]), side="right") - 1
                assert want.covers_queries and (np.diff(cu_k)[run] > 0).all(), (layout, r)
    # some slot counts short of the runs; on the ordered layouts some holding them as well
    assert False in fits and (layout == "shuffled" or True in fits), fits


def test_a_trimmed_plan_does_not_fit_where_its_keys_outgrow_the_capacity():
    """``trimmed_plan`` keeps the largest plan's verdict on the keys: with a key capacity below
    what the runs read, a plan of enough slots for the runs still does not fit — as
    :func:`prefix_runs` built for those slots says."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    ids = jnp.asarray(np.repeat(np.arange(4), 8)[None].astype(np.int32))  # 4 documents of 8 tokens
    index = jnp.arange(32, dtype=jnp.int32)[None]
    run_count = jax.jit(lambda i, x: jnp.sum(jax.vmap(runs._row_prefix)(i, i, x, x)[3]))(ids, index)
    # jitted: op by op, eagerly, the plans took 12 s on 2 cores (each op its own compile)
    plan = jax.jit(runs.prefix_runs, static_argnums=(4, 5))
    trimmed_ok = jax.jit(lambda largest, m, count: runs.trimmed_plan(largest, m, count).ok, static_argnums=1)
    for cap in (64, 16):  # room for every key the 4 runs read (32), then not
        largest = plan(ids, ids, index, index, 8, cap)
        for m in (4, 6):
            own = plan(ids, ids, index, index, m, cap)
            assert int(run_count) == 4 and bool(trimmed_ok(largest, m, run_count)) == bool(own.ok)
            assert bool(own.ok) == (cap == 64)


def test_one_call_mask_names_what_the_kernel_must_take():
    """``seqplan.schedule.one_call_mask``: causal by token indices (the window (UNBOUNDED, 0)) or by
    the layout with documents takes the one call; a window beyond causal, or neither documents
    nor token indices, walks the blocks."""
    from seqplan.schedule import UNBOUNDED, BlockMask, MaskKind, one_call_mask

    by_index = one_call_mask(False, (UNBOUNDED, 0), True, False)
    assert by_index == BlockMask(MaskKind.FULL, documents=True, window=(UNBOUNDED, 0))
    assert one_call_mask(True, None, False, True) == BlockMask(MaskKind.CAUSAL, documents=True)
    assert one_call_mask(False, (64, 0), True, True) is None  # a sliding window on the indices
    assert one_call_mask(True, None, False, False) is None  # plain causal: the fused causal kernels' job
    assert one_call_mask(True, (64, 0), False, True) is None
