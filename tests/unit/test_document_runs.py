"""Tier 1 — ``seqplan.documents.document_runs``, the run list a varlen kernel is given, proved
against the mask it stands for: per-run attention over the packed queries and keys (in place: no
gather) sees exactly the (query, key) pairs the document mask (and the causal mask on a diagonal
block) allows, and blocks it cannot express are refused (None), never approximated."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from helpers import pairs_from_runs, sorted_document_ids
from seqplan.documents import document_runs


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


@pytest.mark.parametrize("trial", range(20))
def test_runs_see_exactly_the_masked_pairs(trial, seed):
    rng = np.random.default_rng(seed + trial)
    b, t = int(rng.integers(1, 3)), int(rng.integers(1, 24))
    ids = sorted_document_ids(rng, b, 2 * t)
    for q_ids, kv_ids, causal in ((ids[:, :t], ids[:, :t], True), (ids[:, t:], ids[:, :t], False),
                                  (ids[:, :t], ids[:, t:], False), (ids[:, :t], ids[:, :t], False)):
        runs = document_runs(q_ids, kv_ids, causal)
        assert runs is not None
        got = pairs_from_runs(runs, b, t, kv_ids.shape[1], causal)
        np.testing.assert_array_equal(got, _pairs_from_mask(q_ids, kv_ids, causal))
        empty = ~_pairs_from_mask(q_ids, kv_ids, causal).any(1)
        assert (runs.empty_rows is None and not empty.any()) or np.array_equal(runs.empty_rows, empty) or causal
        unread = ~_pairs_from_mask(q_ids, kv_ids, causal).any(0)
        assert (runs.unread_keys is None and not unread.any()) or np.array_equal(runs.unread_keys, unread)


def test_runs_walk_both_sides_in_place_and_mark_what_nobody_sees():
    ids = np.array([[0, 0, 1, 1, 1, 2]], np.int32)
    runs = document_runs(ids, ids, causal=True)
    assert runs.empty_rows is None and runs.unread_keys is None and list(runs.cu_q) == [0, 2, 5, 6] == list(runs.cu_k)
    later = np.array([[2, 2, 3, 3, 4, 4]], np.int32)
    runs = document_runs(later, ids, causal=False)  # keys of 0 and 1 (one run, no queries), 2 shared, 3 and 4 alone
    assert list(runs.cu_q) == [0, 0, 2, 6] and list(runs.cu_k) == [0, 5, 6, 6]
    assert runs.empty_rows.tolist() == [False, False, True, True, True, True]
    assert runs.unread_keys.tolist() == [True, True, True, True, True, False]


def test_blocks_that_are_not_runs_are_refused():
    split = np.array([[0, 0, 1, 1, 0, 0]], np.int32)  # document 0 in two runs
    ok = np.array([[0, 0, 1, 1, 2, 2]], np.int32)
    assert document_runs(split, ok, causal=False) is None and document_runs(ok, split, causal=False) is None
    # a document split among the keys that no query reads does not matter
    assert document_runs(np.array([[4, 4, 5]], np.int32), split, causal=False) is not None
    # shared documents in different orders cannot walk both sides in one pass
    assert document_runs(np.array([[0, 1]], np.int32), np.array([[1, 0]], np.int32), causal=False) is None
    assert document_runs(ok, ok[:, ::-1].copy(), causal=True) is None  # causal needs the block's own tokens



def test_a_diagonal_blocks_runs_are_its_rows_runs_or_refused(seed):
    """A causal diagonal block (keys = its queries' tokens) takes its runs straight from the ids'
    runs per row (``_own_runs``, no pairwise walk): on random ids — unsorted, repeated, several
    rows, runs across the row edge — the same offsets as the walk over the same ids, or None
    exactly where the walk refuses (an id in two runs of one row)."""
    rng = np.random.default_rng(seed)
    refused = 0
    for _ in range(300):
        b, t = int(rng.integers(1, 4)), int(rng.integers(1, 30))
        ids = rng.integers(0, int(rng.integers(1, 6)), (b, t)).astype(np.int32)
        if rng.random() < 0.5:
            ids = np.sort(ids, axis=1)  # every row runs only: the case a packed batch gives
        fast, walk = document_runs(ids, ids, causal=True), document_runs(ids, ids, causal=False)
        assert (fast is None) == (walk is None), ids
        if fast is None:
            refused += 1
            continue
        for name in ("cu_q", "cu_k", "max_q", "max_k"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(walk, name), err_msg=f"{name} {ids}")
        assert fast.empty_rows is None and fast.unread_keys is None
    assert 30 < refused < 270  # both outcomes drawn often

_JITTED: dict = {}


def _jitted(form, causal: bool, m: int):
    """``form(q_ids, kv_ids, causal, m)`` jitted once per (form, causal, m) for the whole module
    (the trials share shapes: one compilation each, not one per trial); the run list is a pytree
    whose static fields (``identity``) pass through jit."""
    import jax

    key = (form.__name__, causal, m)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(lambda a, b: form(a, b, causal, m))
    return _JITTED[key]


@pytest.mark.parametrize("trial", range(6))
def test_jax_device_segments_agree_with_the_host_run_list(trial, seed):
    """jax_impl's traced run list (cuDNN's packed form, kernels/packed.py) describes the same
    segments as seqplan.documents on the host: the same query runs, each with its document's key
    run, documents without keys left out (their rows uncovered), and the same refusals."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels.runs import packed_segments

    rng = np.random.default_rng(seed + 100 + trial)
    b, t = 2, 16  # one shape for every trial: one compilation (_jitted)
    ids = sorted_document_ids(rng, b, 2 * t)
    if trial % 4 == 3:  # a document split in two runs of the queries: refused by both
        ids[:, t - 1] = ids[:, 0]
    for q_ids, kv_ids, causal in ((ids[:, :t], ids[:, :t], True), (ids[:, t:], ids[:, :t], False),
                                  (ids[:, :t], ids[:, t:], False)):
        host = document_runs(q_ids, kv_ids, causal)
        seg = _jitted(packed_segments, causal, t)(jnp.asarray(q_ids), jnp.asarray(kv_ids))
        if host is None:
            assert not bool(seg.ok)
            continue
        assert bool(seg.ok)
        q_len = np.asarray(seg.q_seqlen)
        kv_len = np.asarray(seg.kv_seqlen)
        q_off = np.asarray(seg.q_offsets)[:, :-1]
        kv_off = np.asarray(seg.kv_offsets)[:, :-1]
        host_q = np.diff(host.cu_q)
        host_k = np.diff(host.cu_k)
        kept = (host_k > 0) & (host_q > 0)  # the device's segments: the runs where queries meet keys
        device_q = [(r, o, n) for r in range(b) for o, n in zip(q_off[r], q_len[r]) if n >= 0]
        assert [n for _, _, n in device_q] == host_q[kept].tolist()
        assert [n for r in range(b) for n in kv_len[r] if n >= 0] == host_k[kept].tolist()
        starts = host.cu_k[:-1][kept]
        assert [r * kv_ids.shape[1] + o for r in range(b) for o, n in zip(kv_off[r], kv_len[r]) if n >= 0] \
            == starts.tolist()
        empty = np.zeros(b * t, bool) if host.empty_rows is None else host.empty_rows
        np.testing.assert_array_equal(~np.asarray(seg.covered_q).reshape(-1), empty)


def test_jax_packed_statistics_round_trip():
    """lse [b, h, t] -> cuDNN's per-segment statistics [B·M, N, T] -> lse: every covered row
    comes back, left-out rows read -inf."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels.packed import lse_from_stats, stats_from_lse
    from jax_impl.kernels.runs import packed_segments

    q_ids = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 6, 7, 7]], np.int32)
    kv_ids = np.array([[0, 1, 1, 3, 3, 3], [5, 6, 6, 6, 7, 9]], np.int32)  # document 2 has no key here
    seg = packed_segments(jnp.asarray(q_ids), jnp.asarray(kv_ids), False, m=4)
    lse = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 6)), jnp.float32)
    stats = stats_from_lse(lse, seg, 2, 3, 6)
    assert stats.shape == (8, 3, 6)
    back = np.asarray(lse_from_stats(stats, seg, 2, 3, 6))
    covered = np.asarray(seg.covered_q)
    assert covered.tolist() == [[True] * 5 + [False], [True] * 6]
    np.testing.assert_array_equal(back[:, :, ~covered[0]][0], -np.inf)
    np.testing.assert_array_equal(np.where(covered[:, None, :], back, 0), np.where(covered[:, None, :], lse, 0))
    assert np.asarray(seg.slot).tolist() == [[0, 1, -1, -1], [2, 3, 4, -1]]


@pytest.mark.parametrize("trial", range(4))
def test_jax_varlen_offsets_gather_each_runs_keys(trial, seed):
    """FlashAttention's form of the traced runs (kernels/runs.py varlen_offsets): the packed keys
    (gathered by kv_index between cu_k offsets) of run i are exactly the keys of run i's document,
    and the causal diagonal block needs no gather (cu_k == cu_q)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels.runs import varlen_offsets

    rng = np.random.default_rng(seed + 200 + trial)
    b, t = 2, 16
    ids = sorted_document_ids(rng, b, 2 * t)
    diag = _jitted(varlen_offsets, True, t)(jnp.asarray(ids[:, :t]), jnp.asarray(ids[:, :t]))
    assert bool(diag.ok) and np.array_equal(diag.cu_q, diag.cu_k)
    q_ids, kv_ids = ids[:, t:], ids[:, :t]
    runs = _jitted(varlen_offsets, False, t)(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    cu_q, cu_k, index = (np.asarray(x) for x in (runs.cu_q, runs.cu_k, runs.kv_index))
    flat_q, flat_kv = q_ids.reshape(-1), np.concatenate([kv_ids.reshape(-1), [-1]])
    for i in range(len(cu_q) - 1):
        if cu_q[i] == cu_q[i + 1]:
            assert cu_k[i] == cu_k[i + 1]  # an unused slot
            continue
        doc, row = flat_q[cu_q[i]], cu_q[i] // t
        got = sorted(index[cu_k[i]:cu_k[i + 1]].tolist())
        want = [row * t + j for j in np.flatnonzero(kv_ids[row] == doc)]
        assert got == want and all(flat_kv[j] == doc for j in got)
    assert np.all(index[cu_k[-1]:] == b * t)  # past the last run: the zero row


def test_jax_dispatch_picks_the_fewest_slots_or_the_portable_kernel():
    """runs.dispatch: the smallest run-slot count that holds the block's runs; the portable
    branch for a block with a split document or more runs than MAX_RUNS."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    def chosen(ids, causal=True):
        ids = jnp.asarray(np.asarray(ids, np.int32))
        return int(runs.dispatch((ids, ids), causal, lambda r: jnp.int32(r.cu_q.shape[0] - 1),
                                 lambda: jnp.int32(-1)))

    assert chosen([[0, 0, 1, 1, 2, 2, 2, 2]]) == 4  # 3 runs: the 4-slot kernel, b·m = 4 sequences
    assert chosen([np.arange(8) // 1]) == 8  # 8 runs in 8 tokens: slots capped at t
    assert chosen([[0, 0, 1, 1, 0, 0, 2, 2]]) == -1  # document 0 in two runs: portable
    many = np.repeat(np.arange(runs.MAX_RUNS + 1), 2)[None]
    assert chosen(many) == -1  # more runs than MAX_RUNS: portable
    assert chosen(np.repeat(np.arange(10), 2)[None]) == 16


def test_fa3_varlen_forms_hold_more_runs_than_the_packed_form():
    """A block of more than 64 documents (a whole 128k sequence under Ulysses: 84-163 for the
    balance mixes) runs FA3's varlen form on ``VARLEN_RUN_SLOTS`` (powers of two) up to 256 runs, the forward and
    the backward; past that, and on cuDNN's packed form (``RUN_SLOTS``) past 64, the portable kernel."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import fa3_varlen, runs

    seen = []

    @functools.partial(jax.jit, static_argnums=(1, 2))  # as the kernels call it (eagerly, every op compiles alone)
    def dispatch(ids, slots, lengths):
        return runs.dispatch((ids, ids), True, lambda r: jnp.int32(r.cu_q.shape[0] - 1), lambda: jnp.int32(-1), slots,
                             lengths=lengths)

    def chosen(n_runs, slots, lengths=False):
        return int(dispatch(np.repeat(np.arange(n_runs, dtype=np.int32), 4)[None], slots, lengths))  # t = 4 runs

    # the forward's forms at a power of two and past one; the backward's (each slot count compiled
    # with every length bound: the slowest to trace) across the largest step
    for n_runs, want in ((64, 64), (65, 128)):
        assert chosen(n_runs, runs.VARLEN_RUN_SLOTS) == want
    assert chosen(129, runs.VARLEN_RUN_SLOTS, lengths=True) == 256
    assert chosen(257, runs.VARLEN_RUN_SLOTS) == -1
    assert chosen(65, runs.RUN_SLOTS) == -1  # the packed form's limit is unchanged

    real = runs.dispatch  # the adapter hands its dispatch the varlen slots, forward and backward
    try:
        runs_dispatch = lambda *a, **k: seen.append(a[4] if len(a) > 4 else k.get("slots")) or real(*a, **k)
        fa3_varlen.dispatch = runs_dispatch
        from seqplan.schedule import BlockMask, MaskKind

        q = jnp.zeros((1, 8, 1, 8), jnp.bfloat16)
        ids = jnp.zeros((1, 8), jnp.int32)
        mask = BlockMask(MaskKind.CAUSAL, documents=True)
        for call in (lambda: fa3_varlen.fa3_varlen_block_fwd(q, q, q, mask, 1.0, (ids, ids)),
                     lambda: fa3_varlen.fa3_varlen_block_bwd(q, q, q, q, q, jnp.zeros((1, 1, 8)), mask, 1.0,
                                                             segments=(ids, ids))):
            try:
                call()
            except Exception:  # noqa: BLE001 — no FA3 here: only the slots it was dispatched with matter
                pass
    finally:
        fa3_varlen.dispatch = real
    assert seen == [runs.CAUSAL_VARLEN_RUN_SLOTS] * 2  # a causal block: the finer sizes (its form is its run starts)
    assert chosen(35, runs.CAUSAL_VARLEN_RUN_SLOTS) == 48 and chosen(97, runs.CAUSAL_VARLEN_RUN_SLOTS) == 128


def _one_run_per_id_truth(ids: np.ndarray) -> bool:
    starts = np.r_[True, ids[1:] != ids[:-1]]
    return len(set(ids[starts].tolist())) == int(starts.sum())


@pytest.mark.parametrize("trial", range(6))
def test_jax_run_checks_without_a_sort_agree_with_the_host(trial, seed):
    """``runs.expressible`` compares the ids at the run starts pairwise (no sort: on a GPU a sort
    left the device idle after it) up to ``PAIRWISE_RUNS`` runs, and sorts past that: both say
    what the host says — every id one run — including an id split in two runs, and a row with more
    runs than the limit is refused; ``causal_offsets`` (a causal block's varlen form) gives the
    run starts as offsets of both sides and refuses what ``expressible`` refuses."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    rng = np.random.default_rng(seed + 400 + trial)
    b, t = 2, 320  # longer than PAIRWISE_RUNS: the limit past it sorts
    ids = sorted_document_ids(rng, b, t)
    if trial % 2:  # one row's first document again at its end: two runs of one id
        ids = ids.copy()
        ids[1, -3:] = ids[1, 0] if ids[1, 0] != ids[1, -4] else ids[1, 0] + 1000
    want = all(_one_run_per_id_truth(row) for row in ids)
    most = max(int(np.r_[True, row[1:] != row[:-1]].sum()) for row in ids)
    for limit in (runs.PAIRWISE_RUNS, runs.PAIRWISE_RUNS + 1):  # pairwise, then the sort
        ok, got_most = jax.jit(lambda a, limit=limit: runs.expressible(a, a, True, limit=limit))(jnp.asarray(ids))
        assert bool(ok) == want and int(got_most) == most
    ok, _ = jax.jit(lambda a: runs.expressible(a, a, False, limit=most - 1))(jnp.asarray(ids))
    assert not bool(ok)  # more runs than the limit
    offsets = jax.jit(lambda a: runs.causal_offsets(a, a, 256))(jnp.asarray(ids))
    assert bool(offsets.ok) == want and offsets.identity and offsets.covers_block
    starts = [r * t + i for r, row in enumerate(ids) for i in np.flatnonzero(np.r_[True, row[1:] != row[:-1]])]
    cu = np.asarray(offsets.cu_q)
    np.testing.assert_array_equal(cu, offsets.cu_k)
    assert sorted(set(cu.tolist())) == sorted({*starts, *(r * t for r in range(1, b + 1))})  # unused slots: a row's end
    assert not bool(jax.jit(lambda a: runs.causal_offsets(a, a, most - 1).ok)(jnp.asarray(ids)))
    # the slots count query runs: keys with more runs than the largest slot count still fuse (a
    # FULL block of 2 query runs against 14 key runs on 4 slots), up to PAIRWISE_RUNS key runs
    q_two, kv_many = np.repeat([0, 1], 4)[None], np.r_[0, 0, 1, 1, 2:14][None]
    full = jax.jit(lambda a, c: runs.dispatch((a, c), False, lambda r: jnp.int32(r.cu_q.shape[0] - 1),
                                              lambda: jnp.int32(-1), (4,)))
    assert int(full(jnp.asarray(q_two, jnp.int32), jnp.asarray(kv_many, jnp.int32))) == 4
    many = jnp.asarray(np.arange(300, dtype=np.int32)[None])  # 300 runs: more than a sort-checked limit allows
    assert not bool(jax.jit(lambda a: runs.expressible(a, a, False, limit=257)[0])(many))


@pytest.mark.parametrize("trial", range(6))
def test_jax_boundary_runs_see_exactly_the_masked_pairs(trial, seed):
    """runs.boundary_runs — a FULL block whose keys precede its queries as three runs a row over
    its own memory — sees exactly the document mask's pairs when it says ``ok``, marks the rows
    and keys nobody sees, and says ``ok`` whenever the ids are runs in original order (the
    contiguous / zigzag blocks of a causal call); ids shared out of order are refused."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels.runs import boundary_runs

    rng = np.random.default_rng(seed + 300 + trial)
    b, t = 2, 16
    ids = sorted_document_ids(rng, b, 2 * t)
    q_ids, kv_ids = ids[:, t:], ids[:, :t]
    if trial % 3 == 2:  # the queries' first document in two runs of the keys: not three runs
        kv_ids = kv_ids.copy()  # (reusing the queries' last id here was a no-op for a draw of one document a row)
        kv_ids[:, 0], kv_ids[:, 1], kv_ids[:, -1] = q_ids[:, 0], q_ids[:, 0] + 1000, q_ids[:, 0]
    runs = jax.jit(boundary_runs)(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    assert runs.identity  # the block's own keys: no gather
    if trial % 3 == 2:
        assert not bool(runs.ok)
        return
    assert bool(runs.ok)

    class Host:  # the varlen form as _pairs_from_runs reads it
        cu_q, cu_k = np.asarray(runs.cu_q), np.asarray(runs.cu_k)

    want = _pairs_from_mask(q_ids, kv_ids, False)
    np.testing.assert_array_equal(pairs_from_runs(Host, b, t, t, False), want)
    np.testing.assert_array_equal(np.asarray(runs.covered_q).reshape(-1), want.any(1))
    np.testing.assert_array_equal(np.asarray(runs.covered_kv).reshape(-1), want.any(0))


def test_jax_length_ladder_bounds_the_longest_run():
    """The backward's static max_seqlen: the smallest bound of the ladder that holds the longest
    run of either side (a shorter one would drop tiles), picked on the device — the finer ladder
    for a causal block, the coarser for a FULL one."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    assert runs.length_ladder(32768) == (256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)
    assert runs.length_ladder(1024) == (256, 384, 512, 768, 1024) and runs.length_ladder(16) == (16,)
    assert runs.length_ladder(300) == (256, 300)
    assert runs.causal_length_ladder(2048) == (256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
    assert runs.causal_length_ladder(300) == (256, 300) and runs.causal_length_ladder(16) == (16,)
    t = 4096
    for longest in (1, 511, 512, 513, 1500, 2500, 4096):
        ids = np.concatenate([np.zeros(longest), 1 + np.arange(t - longest)]).astype(np.int32)[None]
        ids = jnp.asarray(ids)
        for causal, ladder in ((True, runs.causal_length_ladder), (False, runs.length_ladder)):
            got = int(runs.dispatch((ids, ids), causal, lambda r: jnp.int32(r.chosen_bound()[0]),
                                    lambda: jnp.int32(-1), slots=(t,), lengths=True))
            assert got == min(b for b in ladder(t) if b >= longest), (causal, longest)


def test_a_causal_block_compiles_no_bound_its_slots_cannot_reach():
    """A causal block's runs cover its t tokens, so at m run slots its longest run has at least
    ceil(t / m) keys: ``fused_branches`` compiles no smaller bound for that slot count (each
    compiled bound is one more kernel call the host prepares on every execution). The bound picked
    is still the smallest of the whole ladder holding the longest run, for run counts on every
    slot size and over them (the portable kernel)."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    t, slots, ladder = 4096, (4, 16, 64), runs.causal_length_ladder(4096)
    compiled = {}

    def kernel(r):
        compiled[(r.cu_q.shape[0] - 1) // r.covered_q.shape[0]] = r.bounds  # slots a row; static: recorded at trace time
        return jnp.int32(r.chosen_bound()[0])

    pick = jax.jit(lambda ids: runs.dispatch((ids, ids), True, kernel, lambda: jnp.int32(-1), slots=slots,
                                             lengths=True))
    rng = np.random.default_rng(0)
    for documents in (1, 2, 4, 5, 9, 16, 17, 40, 64, 65, 300):
        cuts = np.sort(rng.choice(np.arange(1, t), documents - 1, replace=False))
        lengths = np.diff(np.r_[0, cuts, t])
        ids = jnp.asarray(np.repeat(np.arange(documents), lengths).astype(np.int32)[None])
        want = min(b for b in ladder if b >= lengths.max()) if documents <= slots[-1] else -1
        assert int(pick(ids)) == want, documents
    # two rows, runs of exactly t / m keys (the floor itself): 4 of 1,024 and 16 of 256 — 16 slots, bound 1,024
    rows = np.stack([np.repeat(np.arange(4), t // 4), np.repeat(np.arange(16), t // 16)]).astype(np.int32)
    assert int(pick(jnp.asarray(rows))) == 1024
    assert int(pick(jnp.asarray(rows[1:]))) == 256 and int(pick(jnp.asarray(rows[:1]))) == 1024
    assert sorted(compiled) == list(slots)
    for m, bounds in compiled.items():
        assert [q for q, _ in bounds] == [b for b in ladder if b * m >= t], m
    assert len(compiled[4]) == 9 < len(compiled[16]) == len(compiled[64]) == len(ladder) == 17


def test_jax_run_lists_are_pytrees_with_static_flags():
    """The run lists are typed pytrees: their arrays are the leaves (a forward keeps the
    all-gather plans as custom_vjp residuals, which take arrays only), ``identity`` and the
    backward's ``max_q`` / ``max_k`` bounds static (the kernels branch and compile on them)."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels.runs import VarlenRuns, packed_segments, prefix_plans, varlen_offsets

    ids = jnp.asarray([[0, 0, 1, 1, 2, 2, 2, 3]], jnp.int32)
    index = jnp.arange(8, dtype=jnp.int32)[None]
    # built in one program, as the kernels build them, and returned from it: only pytrees of arrays
    # can be (eagerly, each op of the builders compiles alone: 164 programs, 5 s on 2 cores)
    records = jax.jit(lambda ids, index: [varlen_offsets(ids, ids, True, 4).bounded(256, 128),
                                          packed_segments(ids, ids, True, 4), *prefix_plans(ids, ids, index, index)])(
        ids, index)
    for record in records:
        leaves, tree = jax.tree.flatten(record)
        assert leaves and all(isinstance(x, jax.Array) for x in leaves), type(record).__name__
        assert type(jax.tree.unflatten(tree, leaves)) is type(record)
    back = jax.jit(lambda r: r)(records[0])
    assert isinstance(back, VarlenRuns) and back.identity and (back.max_q, back.max_k) == (256, 128)
    assert not records[2].identity and records[2].covered_kv is None  # the one call's keys are gathered


def test_token_index_blocks_hold_as_many_runs_as_the_varlen_forms():
    """A token-index block (the per-row layouts) of 65-256 documents — USP 2×2's shard of the 128k
    short mix holds ≈ 82 — runs a fused form, diagonal (causal) and off the diagonal (FULL on new
    ids); past 256 runs the portable kernel."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    @jax.jit  # as the kernels call it: one program per block size (eagerly, every op compiles alone: 7 s)
    def dispatch(ids, q_index, kv_index):
        return runs.index_dispatch((ids, ids), (q_index, kv_index),
                                   lambda causal, r: jnp.int32(r.cu_q.shape[0] - 1), lambda: jnp.int32(-1))

    def chosen(n_runs, later):
        ids = np.repeat(np.arange(n_runs, dtype=np.int32), 4)[None]
        t = ids.shape[1]
        return int(dispatch(ids, np.arange(t, dtype=np.int32)[None] + later * t, np.arange(t, dtype=np.int32)[None]))

    assert runs.INDEX_RUN_SLOTS[-1] == runs.VARLEN_MAX_RUNS
    # the diagonal block, then one whose queries all follow its keys (FULL: the same program, other
    # indices); each form traced at 82 runs (the large slot) and one size on either side of it
    assert chosen(82, 0) == chosen(82, 1) == runs.VARLEN_MAX_RUNS
    assert chosen(10, 1) == 16
    assert chosen(runs.VARLEN_MAX_RUNS + 1, 0) == -1


def test_one_switch_returns_the_widest_dtype_of_its_forms():
    """``runs.switch_with_fallback``: the branches of one ``lax.switch`` agree on each output's
    dtype — the widest any form returns (a covering causal form keeps bf16, a gathered one
    accumulates dK in float32), each form traced once for it (``runs._form`` drops the sizes)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    assert runs._form(("causal", runs.RUNS, 16, 4096)) == ("causal", runs.RUNS)
    assert runs._form((runs.RUNS, 4, None)) == (runs.RUNS,) and runs._form(("full", runs.BOUNDARY)) == ("full", runs.BOUNDARY)
    bf16 = lambda: jnp.ones((2,), jnp.bfloat16)
    f32 = lambda: jnp.ones((2,))
    variants = {(runs.BOUNDARY,): bf16, (runs.RUNS, 4, None): f32, (runs.RUNS, 16, None): f32}
    for pick in ((runs.BOUNDARY,), (runs.RUNS, 16, None)):
        out = runs.switch_with_fallback(variants, pick, lambda: jnp.zeros((2,)))
        assert out.dtype == jnp.float32
    same = {(runs.RUNS, 4, None): bf16, (runs.RUNS, 16, None): bf16}
    assert runs.switch_with_fallback(same, (runs.RUNS, 4, None), lambda: jnp.zeros((2,))).dtype == jnp.bfloat16


def test_a_length_floor_past_the_block_is_refused():
    """``length_choice``'s floor on the longest run can be no more than the block's length (no run
    is longer): a larger one is the caller's mistake, refused by name, not an empty ladder."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels import runs

    ladder = runs.causal_length_ladder(1024)
    assert runs.length_choice(ladder, 1024, 1024, jnp.int32(600), least=1024).bounds == ((1024, 1024),)
    for least in (0, 1025):
        with pytest.raises(ValueError, match="floor on the longest run"):
            runs.length_choice(ladder, 1024, 1024, jnp.int32(600), least=least)


@pytest.mark.parametrize("case", ["p=0", "p=t-1", "three rows", "two runs", "index falls"])
def test_jax_own_key_runs_see_exactly_a_local_parts_pairs(case, seed, monkeypatch):
    """runs.own_key_runs — a shared-prefix call's local part, queries [p, t) against the shard's
    own keys in place — sees exactly the pairs the mask allows (same document, key index <= query
    index) when it says ``ok`` — runs of one id whose token indices increase — at p = 0, at the
    last position and at a drawn p over three rows. It marks the keys before position p's run as
    read by nobody, fits exactly as many slots as it has sequences, and refuses a document in two
    runs and indices that fall inside a run."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels import runs as kernel_runs
    from jax_impl.kernels.runs import own_key_plans, own_key_runs

    rng = np.random.default_rng(seed + 500)
    b, t = (3 if case == "three rows" else 2), 24
    p = {"p=0": 0, "p=t-1": t - 1}.get(case, int(rng.integers(1, t - 1)))
    ids = sorted_document_ids(rng, b, t)
    index = np.stack([np.arange(t) * 3 + 7 * row for row in range(b)]).astype(np.int32)  # increasing, not consecutive
    if case == "two runs":  # the first document again after a different one
        ids[:, -1], ids[:, -2] = ids[:, 0], -1
    if case == "index falls":  # one document a row, its indices no longer increasing
        ids[:, :] = ids[:, :1]
        index[:, t // 2] = index[:, 0] - 1
    starts = lambda row: {0, max(j for j in range(p + 1) if j == 0 or row[j] != row[j - 1])} | {
        j for j in range(p + 1, t) if row[j] != row[j - 1]}  # the keys before p's run, that run, the later ones
    need = sum(len(starts(row)) for row in ids)
    monkeypatch.setattr(kernel_runs, "PREFIX_SLOTS", (need - 1, need, 2 * t))  # own_key_plans: the largest trimmed
    runs, fits, short, plans, built = jax.jit(lambda i, x: (
        own_key_runs(i, x, p, 2 * t), own_key_runs(i, x, p, need).ok, own_key_runs(i, x, p, need - 1).ok,
        own_key_plans(i, x, p), [own_key_runs(i, x, p, plan.cu_q.shape[0] - 1) for plan in own_key_plans(i, x, p)],
    ))(jnp.asarray(ids), jnp.asarray(index))
    assert runs.identity and not runs.covers_block  # the shard's own keys, some read by nobody
    for plan, own in zip(plans, built):  # each plan trimmed from the largest is the one built for its slots
        assert bool(plan.ok) == bool(own.ok), plan.cu_q.shape
        for name in ("cu_q", "cu_k", "covered_kv", "longest") if own.ok else ():
            np.testing.assert_array_equal(getattr(plan, name), getattr(own, name), err_msg=name)
    if case in ("two runs", "index falls"):
        assert not bool(runs.ok) and not bool(fits)
        return
    assert bool(runs.ok) and bool(fits) and not bool(short)
    sizes = [plan.cu_q.shape[0] - 1 for plan in plans]  # both sides of the edge where the floor allows it
    assert need in sizes or need < 2 * b
    assert {bool(plan.ok) for plan in plans} == ({False, True} if need - 1 >= 2 * b else {True})
    assert int(np.sum(np.diff(np.asarray(runs.cu_k)) > 0)) == need

    class Host:  # the varlen form as pairs_from_runs reads it
        cu_q, cu_k = np.asarray(runs.cu_q), np.asarray(runs.cu_k)

    want = np.zeros((b * (t - p), b * t), bool)
    for row in range(b):
        block = (ids[row, p:, None] == ids[row, None, :]) & (index[row, None, :] <= index[row, p:, None])
        want[row * (t - p):(row + 1) * (t - p), row * t:(row + 1) * t] = block
    np.testing.assert_array_equal(pairs_from_runs(Host, b, t - p, t, True), want)
    assert np.asarray(runs.covered_q).all() and want.any(1).all() and runs.covers_queries  # no select over o / dq
    np.testing.assert_array_equal(np.asarray(runs.covered_kv).reshape(-1), want.any(0))
    assert int(runs.longest) == max(np.diff(Host.cu_k)[np.diff(Host.cu_q) > 0])
