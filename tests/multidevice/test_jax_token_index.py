"""Tier 2 — explicit token indices (``token_index``) through jax_impl's public API: packed
documents laid out by the per-document zigzag (``seqplan.layouts.document_layout``) against the
float64 oracle computed in ORIGINAL order (forward and gradients, read back through the layout's
inverse), the static layout's indices equal to passing none, a wrong index caught, and bad
indices refused before any collective. The one-device replays' own checks are in
tests/unit/test_token_index_replay.py."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

import jax_impl
from helpers import FULL
from parity.core.reference import attention_backward, attention_forward
from seqplan.layouts import document_layout, layout_permutation, pad_documents, static_token_index

HEADS, KV_HEADS, DIM = 4, 2, 8
# Two rows of packed documents in original order (a length-1 document among them).
DOCUMENTS = np.array([[0] * 9 + [1] + [2] * 14 + [3] * 3, [7] * 3 + [8] * 21 + [9] * 3])
MESHES = {"ring4": {"ring": 4}, "usp2x2": {"ring": 2, "ulysses": 2}, "ulysses4": {"ulysses": 4},
          "double_ring2x2": {"ring_outer": 2, "ring_inner": 2}}


def _problem(axes: dict, seed: int):
    """The padded ids and their per-document zigzag over the mesh's ring, and float64 q, k, v, do
    [b, T, ...] in original order."""
    ring = axes.get("ring", axes.get("ring_outer", 1) * axes.get("ring_inner", 1))
    ulysses = axes.get("ulysses", 1)
    ids, _ = pad_documents(DOCUMENTS, ring, multiple=2 * ring * ulysses)
    layout = document_layout(ids, ring)
    rng = np.random.default_rng(seed)
    b, t = ids.shape
    q, do = (rng.standard_normal((b, t, HEADS, DIM)) for _ in range(2))
    k, v = (rng.standard_normal((b, t, KV_HEADS, DIM)) for _ in range(2))
    return ids, layout, (q, k, v, do)


def _laid(x, perm):
    """``x`` [b, T, ...] (original order) in the per-row layout ``perm`` [b, T]."""
    return np.take_along_axis(x, perm.reshape(perm.shape + (1,) * (x.ndim - 2)), 1)


def _run(mesh, q, k, v, do, *, token_index, segment_ids, layout: str, causal: bool = True, grads: bool = True,
         window=None, kv_exchange: str = "ring"):
    """o, lse (and dq, dk, dv for cotangent ``do``) of the public API on layout-ordered inputs, in
    one jitted program (an eager ``jax.vjp`` would run the backward op by op)."""
    def attention(q, k, v):
        return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=causal, layout=layout, return_lse=True,
                                                    segment_ids=segment_ids, token_index=token_index, window=window,
                                                    kv_exchange=kv_exchange)

    def outputs(q, k, v, do):
        if not grads:
            return attention(q, k, v)
        (o, lse), pullback = jax.vjp(attention, q, k, v)
        return (o, lse, *pullback((do, jnp.zeros_like(lse))))

    return [np.asarray(x) for x in jax.jit(outputs)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, do)))]


def _rel(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


TRUTH_CASES = [("ring4", "contiguous", None, "ring"), ("usp2x2", "zigzag", None, "ring"),
               ("ring4", "contiguous", (6, 0), "ring")]
# The other strategies with --full (RINGBRIDGE_FULL=1).
TRUTH_CASES += [pytest.param(*c, marks=pytest.mark.slow) for c in (
    ("ring4", "zigzag", None, "allgather"), ("ulysses4", "contiguous", (6, 0), "ring"),
    ("double_ring2x2", "zigzag", None, "ring"), ("usp2x2", "contiguous", (3, 0), "allgather"))] if FULL else []


@pytest.mark.parametrize("mesh_name,layout,window,kv_exchange", TRUTH_CASES)
def test_document_zigzag_with_token_index_matches_float64_truth(mesh_name, layout, window, kv_exchange, jax_devices):
    """o, lse, dq, dk, dv of the per-document zigzag (segment ids and token indices in layout
    order), read back to original order, equal the causal document-masked float64 oracle run in
    original order (float32 inputs: relative error 1e-5). The static ``layout`` argument only
    fixes the divisibility rules: the token indices decide the masks. With a window (on token
    indices) on the contiguous layout the ring must not be truncated as it is for the layout's
    own positions."""
    axes = MESHES[mesh_name]
    ids, row_layout, (q, k, v, do) = _problem(axes, seed=0)
    perm, inverse = row_layout.perm, row_layout.inverse
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    got = _run(mesh, *(_laid(x, perm) for x in (q, k, v, do)), token_index=jnp.asarray(row_layout.token_index),
               segment_ids=jnp.asarray(_laid(ids, perm)), layout=layout, window=window,
               kv_exchange=kv_exchange)
    got = [np.take_along_axis(x, inverse[:, None, :], 2) if name == "lse" else _laid(x, inverse)
           for name, x in zip(("o", "lse", "dq", "dk", "dv"), got)]
    truth = attention_forward(q, k, v, causal=True, segment_ids=ids, window=window)
    for name, x, ref in zip(("o", "lse", "dq", "dk", "dv"), got, (truth.o, truth.lse,
                                                                  *attention_backward(truth, q, k, v, do))):
        assert _rel(x, ref) < 1e-5, (name, _rel(x, ref))


def test_static_token_index_equals_the_default(jax_devices):
    """Token indices equal to the static layout's positions give the call without them (a
    different schedule: non-causal blocks under the token-index window), forward and backward."""
    ring, layout, seq = 4, "zigzag", 32
    ids = np.repeat(np.arange(3), [5, 19, 8])[None].repeat(2, 0)
    rng = np.random.default_rng(1)
    q, do = (rng.standard_normal((2, seq, HEADS, DIM)) for _ in range(2))
    k, v = (rng.standard_normal((2, seq, KV_HEADS, DIM)) for _ in range(2))
    perm = layout_permutation(seq, layout, ring)
    laid = [x[:, perm] for x in (q, k, v, do)]
    mesh = jax.make_mesh((ring,), ("ring",))
    segment_ids = jnp.asarray(ids[:, perm])
    default = _run(mesh, *laid, token_index=None, segment_ids=segment_ids, layout=layout)
    static = _run(mesh, *laid, token_index=jnp.asarray(static_token_index(seq, layout, ring, batch=2)),
                  segment_ids=segment_ids, layout=layout)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), static, default):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_wrong_token_index_gives_a_wrong_answer(jax_devices):
    """Data laid out per document but given the static layout's indices (or none): far from the
    truth — the token indices are what the masks read."""
    axes = MESHES["ring4"]
    ids, row_layout, (q, k, v, do) = _problem(axes, seed=2)
    perm = row_layout.perm
    mesh = jax.make_mesh((4,), ("ring",))
    laid = [_laid(x, perm) for x in (q, k, v, do)]
    truth = attention_forward(*laid[:3], causal=True, q_pos=row_layout.token_index, k_pos=row_layout.token_index,
                              segment_ids=_laid(ids, perm))
    wrong = static_token_index(ids.shape[1], "contiguous", 4, batch=ids.shape[0])
    for token_index in (jnp.asarray(wrong), None):
        o, _ = _run(mesh, *laid, token_index=token_index, segment_ids=jnp.asarray(_laid(ids, perm)),
                    layout="contiguous", grads=False)
        assert _rel(o, truth.o) > 1e-2


def test_local_attention_takes_its_shard_of_the_token_index(jax_devices):
    """``local_attention`` inside the caller's own shard_map, each device given its shard of the
    token indices, equals the global entry point."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = MESHES["ring4"]
    ids, row_layout, (q, k, v, do) = _problem(axes, seed=3)
    perm = row_layout.perm
    mesh = jax.make_mesh((4,), ("ring",))
    q, k, v = (jnp.asarray(_laid(x, perm), jnp.float32) for x in (q, k, v))
    ids, index = jnp.asarray(_laid(ids, perm)), jnp.asarray(row_layout.token_index)
    spec, ids_spec = P(None, "ring", None, None), P(None, "ring")
    local = jax.jit(jax.shard_map(
        lambda q, k, v, ids, index: jax_impl.local_attention(q, k, v, mesh, causal=True, layout="contiguous",
                                                             segment_ids=ids, token_index=index),
        mesh=mesh, in_specs=(spec,) * 3 + (ids_spec,) * 2, out_specs=spec))(
            *(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)),
            *(jax.device_put(x, NamedSharding(mesh, ids_spec)) for x in (ids, index)))
    whole = jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout="contiguous", segment_ids=ids,
                                                 token_index=index)
    np.testing.assert_allclose(np.asarray(local), np.asarray(whole), rtol=1e-6, atol=1e-6)


SEQ = 32


@pytest.mark.parametrize("token_index,error,match", [
    (np.zeros((1, SEQ), np.float32), TypeError, "token_index must have an integer dtype"),
    (np.zeros((1, SEQ // 2), np.int32), ValueError, r"token_index must be \[batch, seq\]"),
    (np.zeros((SEQ,), np.int32), ValueError, r"token_index must be \[batch, seq\]"),
    (np.full((1, SEQ), SEQ, np.int32), ValueError, r"token_index values must lie in \[0, 32\)"),
    (np.full((1, SEQ), -1, np.int32), ValueError, r"token_index values must lie in \[0, 32\)"),
])
def test_bad_token_index_is_refused_before_any_collective(token_index, error, match, jax_devices):
    """Refused at the API boundary, before shard_map traces anything."""
    mesh = jax.make_mesh((4,), ("ring",))
    q = jnp.zeros((1, SEQ, HEADS, DIM), jnp.float32)
    with pytest.raises(error, match=match):
        jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, token_index=jnp.asarray(token_index))


def test_under_jit_shape_and_dtype_are_checked(jax_devices):
    """Under ``jax.jit`` the indices are tracers: their shape and dtype are still refused."""
    mesh = jax.make_mesh((4,), ("ring",))
    q = jnp.zeros((1, SEQ, HEADS, DIM), jnp.float32)
    call = jax.jit(lambda q, index: jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, token_index=index))
    with pytest.raises(TypeError, match="token_index must have an integer dtype"):
        call(q, jnp.zeros((1, SEQ), jnp.float32))
    with pytest.raises(ValueError, match=r"token_index must be \[batch, seq\]"):
        call(q, jnp.zeros((1, SEQ + 4), jnp.int32))


def test_per_device_entry_point_checks_its_shard(jax_devices):
    """The per-algorithm functions check the token indices they hold (local shapes)."""
    q = jnp.zeros((1, 16, HEADS, DIM), jnp.float32)
    with pytest.raises(ValueError, match="local token_index"):
        jax_impl.ring_attention(q, q, q, None, token_index=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(TypeError, match="token_index must have an integer dtype"):
        jax_impl.ring_attention(q, q, q, None, token_index=jnp.zeros((1, 16), jnp.float32))


@pytest.mark.parametrize("layout_name", ["document-hybrid", "zigzag"])
def test_allgather_one_varlen_call_per_device_matches_float64_truth(layout_name, jax_devices, monkeypatch):
    """All-gather-KV through the public API on ``fa3_varlen`` (FlashAttention-3's varlen ops
    emulated, float16 inputs), packed documents on the per-document hybrid (token indices) or the
    static zigzag: each device's forward and backward are one varlen call against its gathered
    key prefixes (``jax_impl.allgather.prefix_forward`` / ``prefix_backward``; the block kernels
    of a walk, fused or portable, are planted with NaNs, so a device that walked would show), and o, dq,
    dk, dv (after the reduce-scatter), read back to original order, equal the float64 oracle to
    float16 accuracy."""
    import fa3_ops
    from jax_impl import block
    from jax_impl.kernels import runs
    from seqplan.layouts import hybrid_layout

    fa3_ops.emulate(monkeypatch)
    monkeypatch.setattr(runs, "PREFIX_SLOTS", (16,))  # one compiled form each: the cases need at most 7 runs
    monkeypatch.setattr(runs, "prefix_length_ladder", lambda n: (n,))
    nan = lambda *shapes: tuple(jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes)
    for name in ("reference", "fa3_varlen"):  # a block walked on either kernel would show
        monkeypatch.setitem(block._BACKENDS, name, block.BlockBackend(
            name, lambda q, k, v, *a, **kw: nan(q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)),
            lambda do, q, k, v, *a, **kw: nan(q, k, v), typed_for_shard_map=False))
    from jax_impl import allgather  # the one call's fallback (the portable kernel over every key) would show too

    monkeypatch.setattr(allgather, "reference_block_fwd", lambda q, *a, **kw: nan(
        q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))
    monkeypatch.setattr(allgather, "reference_block_bwd", lambda do, q, k, v, *a, **kw: nan(q, k, v))
    ring = 4
    ids, _ = pad_documents(DOCUMENTS, ring)
    b, seq = ids.shape
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((b, seq, HEADS, DIM)) for _ in range(2))
    k, v = (rng.standard_normal((b, seq, KV_HEADS, DIM)) for _ in range(2))
    if layout_name == "zigzag":
        perm, token_index, layout = np.broadcast_to(layout_permutation(seq, "zigzag", ring), (b, seq)), None, "zigzag"
    else:
        row = hybrid_layout(ids, ring, split_at=12)
        perm, token_index, layout = row.perm, jnp.asarray(row.token_index), "contiguous"
    mesh = jax.make_mesh((ring,), ("ring",))

    def attention(q, k, v):
        return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=True, layout=layout, kv_exchange="allgather",
                                                    segment_ids=jnp.asarray(_laid(ids, perm)), token_index=token_index,
                                                    block_backend="fa3_varlen")

    def outputs(q, k, v, do):
        o, pullback = jax.vjp(attention, q, k, v)
        return (o, *pullback(do))

    got = jax.jit(outputs)(*(jnp.asarray(_laid(x, perm), jnp.float16) for x in (q, k, v, do)))
    inverse = np.argsort(perm, axis=1)
    truth = attention_forward(q, k, v, causal=True, segment_ids=ids)
    for name, x, ref in zip(("o", "dq", "dk", "dv"), got, (truth.o, *attention_backward(truth, q, k, v, do))):
        x = _laid(np.asarray(x, np.float64), inverse)
        assert np.isfinite(x).all(), f"{name}: a device walked the blocks (NaN planted there)"
        assert _rel(x, ref) < 2e-2, (name, _rel(x, ref))
