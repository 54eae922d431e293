"""Tier 1 — jax_impl's ``fa3_varlen`` adapter end to end on the CPU, with FlashAttention-3's varlen
forward and backward emulated from their contract (cumulative offsets, bottom-right causal per
run, ``max_seqlen`` bounding the tiles a run gets, the backward taking the given o and lse).
Why this tier exists: the adapter's run lists, its boundary form, its backward's length ladder
and its empty-row / unread-key handling are traced index arithmetic that only a GPU would
otherwise run — here every output and gradient is checked against the portable kernel, and an
emulated kernel that drops tiles past ``max_seqlen`` makes a too-small bound fail loudly."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

import fa3_ops
from helpers import FULL
from seqplan.schedule import BlockMask, MaskKind

F32 = jnp.float32


@pytest.fixture
def emulated_fa3(monkeypatch):
    """flash_attn3_jax's varlen forward and its FFI backward target, emulated on the CPU."""
    return fa3_ops.emulate(monkeypatch)


def _docs(lengths, offset=0):
    return np.repeat(np.arange(len(lengths)) + offset, lengths).astype(np.int32)


T = 64
IDS = _docs([1, 20, 1, 1, 30, 9, 3, 19, 1, 5, 38])  # 128 tokens: length-1 documents, one spanning 64
CASES = {
    # the diagonal block: its own tokens, one run per document (slots, length ladder)
    "causal diagonal": (MaskKind.CAUSAL, IDS[None, :T], IDS[None, :T]),
    # later queries against earlier keys, one document across the edge: the boundary form
    "full, boundary": (MaskKind.FULL, IDS[None, T:], IDS[None, :T]),
    # keys after the queries (a non-causal call): the gathered slots form
    "full, keys after": (MaskKind.FULL, IDS[None, :T], IDS[None, T:]),
    # two batch rows, half the query documents absent from the keys
    "full, two rows, absent documents": (MaskKind.FULL, np.stack([IDS[:T], IDS[:T] + 500]),
                                         np.stack([IDS[:T], IDS[T:]])),
    # 1024 tokens (the ladder's bounds 256 … 1024): a run of 700 needs the longest bound (which
    # bound a run length picks: tests/unit/test_document_runs.py)
    "causal diagonal, one long run": (MaskKind.CAUSAL, _docs([2, 700, 322])[None], _docs([2, 700, 322])[None]),
}


# The 1024-token case (35 s in the suite of 2026-11-28, the file's slowest) with --full: which bound a
# run length picks is tested without compiling it (tests/unit/test_document_runs.py), and the one
# call's backward bound on the longest run below.
LONG = "causal diagonal, one long run"


@pytest.mark.parametrize("name", [n for n in CASES if FULL or n != LONG])
def test_fa3_varlen_adapter_matches_the_portable_kernel(name, emulated_fa3):
    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    kind, q_ids, kv_ids = CASES[name]
    (b, t), h, hk, d = q_ids.shape, 4, 2, 8
    keys = jax.random.split(jax.random.key(1), 4)
    q, do = (jax.random.normal(kk, (b, t, h, d), F32) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (b, t, hk, d), F32) for kk in keys[2:])
    mask, scale = BlockMask(kind, documents=True), d ** -0.5
    seg = (jnp.asarray(q_ids), jnp.asarray(kv_ids))

    @jax.jit  # the portable kernel's forward and backward as one program (eagerly, each op compiles alone)
    def reference(q, k, v, do, seg):
        o, lse = reference_block_fwd(q, k, v, mask, scale, seg)
        return o, lse, reference_block_bwd(do, q, k, v, o, lse, mask, scale, None, seg)

    o_r, lse_r, grads_r = reference(q, k, v, do, seg)
    # float16 through the adapter (its dtypes), compared in float32 at float16's level
    q16, k16, v16, do16 = (x.astype(jnp.float16) for x in (q, k, v, do))
    o_f, lse_f = jax.jit(lambda *a: emulated_fa3.fa3_varlen_block_fwd(*a, mask, scale, segments=seg))(q16, k16, v16)
    grads_f = jax.jit(lambda *a: emulated_fa3.fa3_varlen_block_bwd(*a, mask, scale, segments=seg))(
        do16, q16, k16, v16, o_r.astype(jnp.float16), lse_r)
    empty = ~np.isfinite(np.asarray(lse_r))
    assert np.array_equal(~np.isfinite(np.asarray(lse_f)), empty)  # o = 0, lse = -inf exactly where nothing is seen
    assert np.all(np.asarray(o_f).transpose(0, 2, 1, 3)[empty] == 0)
    np.testing.assert_allclose(np.where(empty, 0, lse_f), np.where(empty, 0, lse_r), atol=5e-3)
    for got, want in zip((o_f, *grads_f), (o_r, *grads_r)):
        want = np.asarray(want)
        assert np.max(np.abs(np.asarray(got) - want)) <= 1e-2 * max(np.max(np.abs(want)), 1.0)


def test_the_backward_bound_is_switched_on_the_device_around_the_kernel(emulated_fa3):
    """The backward's ``max_seqlen`` is one of several bounds compiled around the FFI call alone,
    picked on the device (``runs.length_choice``): a causal block of 512 tokens whose longest run
    is 300 gets 384 of (256, 384, 512) and equals the portable kernel; the same call made to take
    256 (planted) loses the tiles past it — the emulated kernel drops them, as FA3's grid would."""
    from jax_impl.kernels import runs
    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    ids = jnp.asarray(_docs([300, 212])[None])
    t, h, hk, d = 512, 2, 1, 8
    keys = jax.random.split(jax.random.key(2), 4)
    q, do = (jax.random.normal(kk, (1, t, h, d), F32) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, t, hk, d), F32) for kk in keys[2:])
    mask, scale = BlockMask(MaskKind.CAUSAL, documents=True), d ** -0.5
    o, lse = jax.jit(lambda q, k, v: reference_block_fwd(q, k, v, mask, scale, (ids, ids)))(q, k, v)
    want = jax.jit(lambda *a: reference_block_bwd(*a, mask, scale, None, (ids, ids)))(do, q, k, v, o, lse)
    assert runs.length_ladder(t) == (256, 384, 512)

    @partial(jax.jit, static_argnums=0)
    def backward(planted_at, do, q, k, v, o, lse):
        choice = runs.length_choice(runs.length_ladder(t), t, t, jnp.int32(300))
        if planted_at is not None:
            choice = runs.LengthChoice(choice.bounds, jnp.int32(planted_at))
        block = runs.varlen_offsets(ids, ids, True, 4).bounded_by(choice)
        return block.chosen_bound(), emulated_fa3.varlen_bwd(*(x.astype(jnp.float16) for x in (do, q, k, v, o)), lse,
                                                              True, scale, block)

    error = lambda got: max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w))) / np.max(np.abs(w)))
                            for g, w in zip(got, want))
    (max_q, max_k), got = backward(None, do, q, k, v, o, lse)
    assert (int(max_q), int(max_k)) == (384, 384) and error(got) <= 1e-2
    (max_q, _), planted = backward(0, do, q, k, v, o, lse)
    assert int(max_q) == 256 and error(planted) > 0.1


# --full only (≈ 20 s each, compiling every block's varlen forms): the default tier keeps the
# one-block test below (both forms and the fallback) and the torch replay on emulated FA2 ops
# (tests/unit/test_varlen_emulated.py), inside the suite's 12 minutes
REPLAY_CASES = [(2, True), (4, True), (2, False)] if FULL else []


@pytest.mark.parametrize("ring, with_ids", REPLAY_CASES)
def test_token_index_replay_runs_every_block_on_the_varlen_kernel(ring, with_ids, emulated_fa3, monkeypatch, seed):
    """The JAX replay of the per-document zigzag with explicit token indices on ``fa3_varlen``
    (emulated): every block takes a varlen form — the portable fallback is replaced by NaNs, so
    one block left to it at run time would show — and the result equals the portable kernel's.
    ``with_ids=False``: one document per row, the token indices alone."""
    from jax_impl import replay
    from seqplan.layouts import document_layout, pad_documents
    from seqplan.strategy import Strategy

    ids = np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3])  # a length-1 document
    if not with_ids:
        ids = np.zeros((2, 16 * ring), np.int64)
    padded, _ = pad_documents(ids, ring)
    layout = document_layout(padded, ring)
    laid = jnp.asarray(np.take_along_axis(padded, layout.perm, 1).astype(np.int32))
    index = jnp.asarray(layout.token_index)
    t = padded.shape[1]
    keys = jax.random.split(jax.random.key(seed), 4)
    q, do = (jax.random.normal(kk, (2, t, 4, 16), F32).astype(jnp.float16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (2, t, 2, 16), F32).astype(jnp.float16) for kk in keys[2:])

    @partial(jax.jit, static_argnums=0)  # one program: eager dispatch retraces every switch
    def run(backend, q, k, v, do, index, laid):
        kw = dict(strategy=Strategy(ring=ring), causal=True, layout="contiguous", token_index=index,
                  segment_ids=laid if with_ids else None, block_backend=backend)
        o, lse = replay.replay_attention(q, k, v, **kw)
        return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, **kw))

    want = run("reference", q, k, v, do, index, laid)
    from jax_impl.kernels import runs

    # one run-slot count and one length bound (they hold these blocks): one branch per form to compile
    monkeypatch.setattr(runs, "INDEX_RUN_SLOTS", (16,))
    monkeypatch.setattr(runs, "index_length_ladder", lambda n: (n,))
    nan = lambda *shapes: tuple(jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes)
    monkeypatch.setattr(emulated_fa3, "reference_block_fwd",
                        lambda q, k, v, *a, **kw: nan(q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)))
    monkeypatch.setattr(emulated_fa3, "reference_block_bwd", lambda do, q, k, v, *a, **kw: nan(q, k, v))
    got = run("fa3_varlen", q, k, v, do, index, laid)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.isfinite(x).all(), f"{name}: a block ran on the portable fallback (NaN planted there)"
        assert np.linalg.norm(x - y) <= 1e-2 * np.linalg.norm(y), name


@pytest.mark.parametrize("shuffled", [False, True])
def test_token_index_block_form_or_fallback(shuffled, emulated_fa3):
    """One block masked by token index: increasing indices take the FULL form on new ids, shuffled
    ones the portable fallback — both equal to the portable kernel (never a guess)."""
    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd
    from seqplan.schedule import UNBOUNDED

    rng = np.random.default_rng(3)
    t = 32
    order = rng.permutation(2 * t) if shuffled else np.arange(2 * t)
    q_index, kv_index = (jnp.asarray(x[None].astype(np.int32)) for x in (order[t:], order[:t]))
    ids = jnp.asarray(_docs([5, 20, 7])[None])
    mask, scale, seg, pos = BlockMask(MaskKind.FULL, documents=True, window=(UNBOUNDED, 0)), 8 ** -0.5, (ids, ids), (
        q_index, kv_index)
    keys = jax.random.split(jax.random.key(2), 4)
    q, do = (jax.random.normal(kk, (1, t, 4, 8), F32) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, t, 2, 8), F32) for kk in keys[2:])

    @jax.jit  # one program, as a kernel runs it (eagerly, each op compiles alone); the indices are its inputs
    def both(q, k, v, do, seg, pos):
        o_r, lse_r = reference_block_fwd(q, k, v, mask, scale, seg, pos)
        grads_r = reference_block_bwd(do, q, k, v, o_r, lse_r, mask, scale, None, seg, pos)
        q16, k16, v16, do16 = (x.astype(jnp.float16) for x in (q, k, v, do))
        o_f, lse_f = emulated_fa3.fa3_varlen_block_fwd(q16, k16, v16, mask, scale, segments=seg, positions=pos)
        grads_f = emulated_fa3.fa3_varlen_block_bwd(do16, q16, k16, v16, o_r.astype(jnp.float16), lse_r, mask, scale,
                                                    segments=seg, positions=pos)
        return o_r, lse_r, grads_r, o_f, lse_f, grads_f

    o_r, lse_r, grads_r, o_f, lse_f, grads_f = both(q, k, v, do, seg, pos)
    empty = ~np.isfinite(np.asarray(lse_r))
    assert np.array_equal(~np.isfinite(np.asarray(lse_f)), empty)
    for got, want in zip((o_f, *grads_f), (o_r, *grads_r)):
        want = np.asarray(want)
        assert np.max(np.abs(np.asarray(got, np.float32) - want)) <= 1e-2 * max(np.max(np.abs(want)), 1.0)


# the static zigzag (≈ 5 s) with --full: the public API's test on 4 devices runs it by default
# (tests/multidevice/test_jax_token_index.py), inside the suite's 12 minutes
# the backward as one call (the default) and, with --full (≈ 22 s), as two groups of runs
# (RINGBRIDGE_BACKWARD_GROUPS=2: off by default, measured not to pay on 4x H200 — docs/decisions.md;
# tests/unit/test_backward_groups.py checks its two calls against the one call by default)
ONE_CALL_CASES = [("document-hybrid", True, "1"), ("document-hybrid", False, "1")]
ONE_CALL_CASES += [pytest.param("document-hybrid", True, "2", marks=pytest.mark.slow),
                   pytest.param("zigzag", True, "1", marks=pytest.mark.slow)] if FULL else []


@pytest.mark.parametrize("layout, fits, groups", ONE_CALL_CASES)
def test_allgather_runs_each_device_as_one_varlen_call(layout, fits, groups, emulated_fa3, monkeypatch, seed):
    """The JAX replay of all-gather-KV with packed documents — by token indices on the per-document
    hybrid, by the static zigzag's own positions — on ``fa3_varlen`` (emulated): each device is one
    varlen call forward and one backward (``allgather.prefix_forward`` / ``prefix_backward``), the
    block kernels (fused and portable) replaced by NaNs so a block walked would show; equal to the
    portable walk.
    ``fits=False``: one run slot, too few — every device takes the fallback (the blocks on the
    portable kernel, here real again; the one call's kernels planted with NaNs) and still equals it.
    ``groups``: the backward as two calls (the long runs and the others, ``kernels.groups``; the
    emulated kernel leaves NaN in the rows a call skips) or as the one call."""
    from jax_impl import allgather, block, replay
    from jax_impl.kernels import fa3_varlen, runs
    from seqplan.layouts import hybrid_layout, layout_permutation, pad_documents
    from seqplan.strategy import Strategy

    ring = 4
    ids, _ = pad_documents(np.array([[0] * 9 + [1] + [2] * 30 + [3] * 3, [7] * 3 + [8] * 37 + [9] * 3]), ring)
    b, t = ids.shape
    if layout == "zigzag":
        perm, index = np.broadcast_to(layout_permutation(t, "zigzag", ring), (b, t)), None
    else:
        row = hybrid_layout(ids, ring, split_at=30)
        perm, index = row.perm, jnp.asarray(row.token_index)
    laid = jnp.asarray(np.take_along_axis(ids, perm, 1).astype(np.int32))
    keys = jax.random.split(jax.random.key(seed), 4)
    q, do = (jax.random.normal(kk, (b, t, 4, 16), F32).astype(jnp.float16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (b, t, 2, 16), F32).astype(jnp.float16) for kk in keys[2:])

    @partial(jax.jit, static_argnums=0)
    def run(backend, q, k, v, do, index, laid):
        kw = dict(strategy=Strategy(ring=ring, kv_exchange="allgather"), causal=True,
                  layout="contiguous" if index is not None else "zigzag", token_index=index, segment_ids=laid,
                  block_backend=backend)
        o, lse = replay.replay_attention(q, k, v, **kw)
        return (o, lse, *replay.replay_attention_grads(q, k, v, o, lse, do, **kw))

    want = run("reference", q, k, v, do, index, laid)
    monkeypatch.setenv("RINGBRIDGE_BACKWARD_GROUPS", groups)
    split = fits and groups == "2"  # slots and bounds fine enough that devices split their runs
    monkeypatch.setattr(runs, "PREFIX_SLOTS", (2, 4, 8) if split else (8,) if fits else (1,))
    ladder = (lambda n: (n // 4, n // 2, n)) if split else (lambda n: (n,))
    monkeypatch.setattr(runs, "prefix_length_ladder", ladder)
    if split:  # the same rule on the host plans (tests/unit/test_backward_groups.py: equal to the device's)
        from benchmarks.launched_tiles import call_tiles, split_tiles
        from seqplan.documents import shard_prefix_runs

        shards = lambda x: np.moveaxis(np.asarray(x).reshape(b, ring, t // ring), 1, 0)
        plans = [shard_prefix_runs(shards(laid), None if index is None else shards(index), device=d,
                                   shard_major=False, layout="contiguous" if index is not None else "zigzag")
                 for d in range(ring)]
        lengths = [np.diff(p.cu_k) for p in plans]
        assert any(split_tiles(x, (2, 4, 8), ladder(t))[0] < call_tiles(x, (2, 4, 8), ladder(t))
                   for x in lengths), "no device splits: the test would not exercise the two calls"
    nan = lambda *shapes: tuple(jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes)
    if not fits:  # a one call taken anyway would show
        monkeypatch.setattr(fa3_varlen, "varlen_fwd", lambda q, *a: nan(q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]),
                                                                                       F32)))
        monkeypatch.setattr(fa3_varlen, "_bwd_call", lambda do, q, k_p, v_p, *a: nan(q, k_p, v_p))
    for name in ("reference", "fa3_varlen") if fits else ():  # a block walked on either kernel would show
        monkeypatch.setitem(block._BACKENDS, name, block.BlockBackend(
            name, lambda q, k, v, *a, **kw: nan(q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)),
            lambda do, q, k, v, *a, **kw: nan(q, k, v), typed_for_shard_map=False))
    if fits:  # ... and so would the one call's fallback, the portable kernel over the gathered keys
        monkeypatch.setattr(allgather, "reference_block_fwd", lambda q, *a, **kw: nan(
            q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32)))
        monkeypatch.setattr(allgather, "reference_block_bwd", lambda do, q, k, v, *a, **kw: nan(q, k, v))
    got = run("fa3_varlen", q, k, v, do, index, laid)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.isfinite(x).all(), f"{name}: the path not expected ran (NaN planted there)"
        assert np.linalg.norm(x - y) <= 1e-2 * np.linalg.norm(y), (name, np.linalg.norm(x - y) / np.linalg.norm(y))


def test_one_call_backward_bound_holds_the_longest_run():
    """The one call's backward picks the smallest ``prefix_length_ladder`` bound that holds its
    longest run: FA3's backward launches tiles up to ``max_seqlen`` only (the emulated kernel
    above drops the rest, so a bound too small loses gradients). Here device 0 of a contiguous
    ring of 2 over 1024 tokens holds 300 tokens of one document and 212 of the next: its longest
    run is 300 keys, its bound 384 — not 256. The kernel stands in as its static bound (no
    attention compiled: the choice is what is tested)."""
    from jax_impl.kernels import runs

    assert runs.prefix_length_ladder(1024) == (256, 384, 512, 768, 1024)
    assert runs.prefix_length_ladder(131072) == (4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536,
                                                 98304, 131072)
    ids = jnp.asarray(_docs([300, 500, 224])[None])
    index = jnp.arange(1024, dtype=jnp.int32)[None]
    def choose(ids, index):
        plans = runs.prefix_plans(ids[:, :512], ids, index[:, :512], index)
        bound = runs.prefix_dispatch(plans, lambda r: jnp.int32(r.chosen_bound()[1]), lambda: jnp.int32(-1), keys=1024,
                                     lengths=True)
        return plans[0].longest, bound

    longest, bound = jax.jit(choose)(ids, index)
    assert (int(longest), int(bound)) == (300, 384)


def test_varlen_lse_buffers_are_declared_at_the_tokens_size(emulated_fa3, monkeypatch):
    """Both FFI calls size their lse buffer [nseq, h, ceil(total_q / nseq)] — room for the
    [h, total_q] the kernels use — not the library's [nseq, h, max_seqlen_q] (at 256 slots over a
    128k-token block that was 4.3 GB of float32 per call). The emulated targets read and write at
    the front of whatever they are given, so the adapter's results are checked above; here the sizes."""
    lse_shapes = {}
    emulated_call = jax.ffi.ffi_call

    def spy(name, result_types, **kw):
        call = emulated_call(name, result_types, **kw)
        if name == "flash_mha_fwd":  # the lse is the forward's second result
            lse_shapes[name] = result_types[1].shape
            return call

        def backward(*args, **attrs):  # ... and the backward's sixth input
            lse_shapes[name] = args[5].shape
            return call(*args, **attrs)
        return backward

    monkeypatch.setattr(jax.ffi, "ffi_call", spy)
    from jax_impl.kernels import runs

    b, t, h, d = 1, 1024, 4, 8
    ids = jnp.asarray(np.arange(t, dtype=np.int32)[None] // 4)  # 256 documents of 4 tokens: the 256-run slot
    plan = runs.varlen_offsets(ids, ids, True, 256)
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.float16)
    kv = jax.ShapeDtypeStruct((b, t, 2, d), jnp.float16)
    lse = jax.ShapeDtypeStruct((b, h, t), jnp.float32)
    # traced only (eval_shape): the declared sizes are what this test reads, and tracing one form is fast
    jax.eval_shape(lambda q, k, v: emulated_fa3.varlen_fwd(q, k, v, True, 0.5, plan), q, kv, kv)
    jax.eval_shape(lambda do, q, k, v, o, lse: emulated_fa3.varlen_bwd(do, q, k, v, o, lse, True, 0.5, plan),
                   q, q, kv, kv, q, lse)
    for name in ("flash_mha_fwd", "flash_mha_bwd"):
        assert lse_shapes[name] == (256, h, -(-b * t // 256)), (name, lse_shapes[name])


# 512 tokens: more than one length bound (a causal block's ladder from 256), so the backward's bound switch is
# compiled. One document by default (the case whose kernel changed: it took the plain variant); five with --full (8 s)
@pytest.mark.parametrize("lengths", [[512]] + ([[50, 170, 1, 230, 61]] if FULL else []),
                         ids=lambda x: f"{len(x)} documents")
def test_a_devices_own_document_block_is_one_run_time_decision_a_pass(lengths, emulated_fa3, monkeypatch):
    """A device's own block (here the whole sequence on a one-device mesh) on ``fa3_varlen``: no
    plain variant beside the document one (``BlockBackend.one_run_documents``), so the forward's
    only switch is the kernel's own (its run slots) and the backward's its slots and, inside, its
    length bound — before 2026-11-29 a switch on "one document covers the block" wrapped both,
    one more read-back of an index a pass (``benchmarks.program_size.run_time_switches``). One
    document is one run of the varlen kernel: both cases equal the portable kernel."""
    from jax.sharding import Mesh

    import jax_impl
    from benchmarks.program_size import run_time_switches

    ids = jnp.asarray(_docs(lengths)[None])
    t = ids.shape[1]
    # two slot counts, not ten: the same switches, a fifth of the branches to compile (15 s -> 4 s)
    monkeypatch.setattr(emulated_fa3, "CAUSAL_VARLEN_RUN_SLOTS", (4, 8))
    keys = jax.random.split(jax.random.key(3), 4)
    q, do = (jax.random.normal(kk, (1, t, 4, 16), F32).astype(jnp.float16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, t, 2, 16), F32).astype(jnp.float16) for kk in keys[2:])
    mesh = Mesh(np.array(jax.devices()[:1]), ("ring",))

    def attention(backend, q, k, v):
        return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, segment_ids=ids, block_backend=backend)

    def step(backend, q, k, v, do):
        o, pull = jax.vjp(partial(attention, backend), q, k, v)
        return o, *pull(do)

    switches = lambda fn, *args: run_time_switches(jax.make_jaxpr(fn)(*args))  # each one a wait for the GPU
    assert switches(partial(attention, "fa3_varlen"), q, k, v) == 1  # the run slots' (before: 2)
    assert switches(partial(step, "fa3_varlen"), q, k, v, do) == 3  # + the backward's slots, then its bound (before: 5)
    assert switches(partial(step, "reference"), q, k, v, do) == 2  # the portable kernel keeps its plain variant
    got = jax.jit(partial(step, "fa3_varlen"))(q, k, v, do)
    want = jax.jit(partial(step, "reference"))(q, k, v, do)
    for name, x, y in zip(("o", "dq", "dk", "dv"), got, want):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.max(np.abs(x - y)) <= 1e-2 * np.max(np.abs(y)), name


def test_deterministic_calls_ask_for_fa3s_deterministic_backward(emulated_fa3, monkeypatch):
    """A call with ``deterministic=True`` traces its backward inside ``config.deterministic_kernels``,
    and both FA3 backends emit their backward FFI call with ``deterministic=True`` — the mode
    measured bitwise reproducible on an H200 (docs/gpu/determinism-fa3-2026-11-29-h200.md), the
    reason neither is refused in that mode; with ``deterministic=False`` they ask for the faster
    default. Here: fa3_varlen's emitted attribute (emulated FFI), and fa3's dense backward wrapper
    (``fenced_backward``) with the kernel call recorded."""
    import jax_impl
    from jax_impl import config
    from jax_impl.kernels import fa3

    ids = jnp.asarray(_docs([20, 1, 30, 13])[None])
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, 64, 4, 8), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, 64, 2, 8), jnp.bfloat16) for kk in keys[1:])
    for deterministic in (True, False):
        fa3_ops.CALLS.clear()
        loss = lambda q, k, v, det=deterministic: jax_impl.ring_attention(
            q, k, v, None, causal=True, block_backend="fa3_varlen", deterministic=det, segment_ids=ids)[0].astype(
            F32).sum()
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        asked = [c["deterministic"] for c in fa3_ops.CALLS if "deterministic" in c]  # the backward calls
        assert asked and set(asked) == {deterministic}, fa3_ops.CALLS

    seen = []
    monkeypatch.setattr(fa3, "verified", lambda: True)
    monkeypatch.setattr(fa3, "flash_mha_bwd", lambda *a, deterministic=False: seen.append(deterministic))
    for on in (True, False):
        with config.deterministic_kernels(on):
            fa3.fenced_backward(*(None,) * 6, True, 1.0)
    fa3.fenced_backward(*(None,) * 6, True, 1.0)  # outside any call's backward: the default
    assert seen == [True, False, False]
