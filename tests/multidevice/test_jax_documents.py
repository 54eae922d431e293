"""Tier 2 — packed documents (``segment_ids``) in jax_impl: every strategy against a float64
dense truth, blocks without a shared document never computed (counted at run time, forward and
backward, against a brute-force count of the blocks that hold a visible pair), the replay equal
to the mesh, and bad ids refused before any collective. The parity matrix
(tests/multidevice/test_jax_parity.py) adds the document cases of ``parity.core.cases`` on top."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax import lax

import jax_impl
from helpers import FULL
from jax_impl import replay
from jax_impl.block import BlockBackend, get_backend, register_backend
from seqplan.layouts import layout_permutation
from seqplan.schedule import device_visits, ring_schedule

SEQ, HEADS, KV_HEADS, DIM = 64, 4, 2, 8


def _ids(kind: str, seq: int = SEQ) -> np.ndarray:
    """[1, seq] segment ids in original order: a long-tailed mix (documents spanning shards,
    length-1 documents), or ids reused non-contiguously."""
    if kind == "mix":
        lengths = [1, 13, 1, 2, 30, 5, 1, 1, 9, 40]
        return np.repeat(np.arange(len(lengths)), lengths)[:seq][None]
    return (np.arange(seq) // 5 % 3)[None]  # 0 0 0 0 0 1 1 1 1 1 2 ... 0 0 ...


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((1, SEQ, HEADS, DIM)) for _ in range(2))
    k, v = (rng.standard_normal((1, SEQ, KV_HEADS, DIM)) for _ in range(2))
    return q, k, v, do


def _truth(q, k, v, do, ids, causal):
    """float64 NumPy attention with the document (and causal) mask, original order; lse unused
    by the loss: (o, lse, dq, dk, dv)."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    ke, ve = (np.repeat(x, g, axis=2) for x in (k, v))
    scale = d ** -0.5
    s = np.einsum("bthd,bshd->bhts", q, ke) * scale
    visible = (ids[:, :, None] == ids[:, None, :])[:, None]
    if causal:
        visible = visible & np.tril(np.ones((t, t), bool))
    s = np.where(visible, s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = np.exp(s - lse[..., None])
    o = np.einsum("bhts,bshd->bthd", p, ve)
    dv = np.einsum("bhts,bthd->bshd", p, do)
    dp = np.einsum("bthd,bshd->bhts", do, ve)
    ds = p * (dp - np.einsum("bthd,bthd->bht", do, o)[..., None]) * scale
    dq = np.einsum("bhts,bshd->bthd", ds, ke)
    dk = np.einsum("bhts,bthd->bshd", ds, q)
    fold = lambda x: x.reshape(b, t, k.shape[2], g, d).sum(3)
    return o, lse, dq, fold(dk), fold(dv)


MESHES = {"ring4": {"ring": 4}, "usp2x2": {"ring": 2, "ulysses": 2}, "ulysses4": {"ulysses": 4},
          "double_ring2x2": {"ring_outer": 2, "ring_inner": 2}}
CASES = [("ring4", "zigzag", True, "mix", "ring")]
# The rest with --full (the parity matrix's sampled document cases cover every strategy by default).
CASES += [pytest.param(*c, marks=pytest.mark.slow) for c in (
    ("usp2x2", "zigzag", True, "interleaved", "ring"), ("double_ring2x2", "zigzag", False, "mix", "ring"),
    ("ring4", "stripe", True, "interleaved", "ring"), ("ring4", "contiguous", False, "interleaved", "allgather"),
    ("ulysses4", "contiguous", True, "mix", "ring"))] if FULL else []


@pytest.mark.parametrize("mesh_name,layout,causal,ids_kind,kv_exchange", CASES)
def test_documents_match_float64_truth(mesh_name, layout, causal, ids_kind, kv_exchange, jax_devices):
    """o, lse, dq, dk, dv of a packed-document call equal the dense masked float64 truth (float32: 1e-5)."""
    axes = MESHES[mesh_name]
    ring = int(np.prod([n for a, n in axes.items() if a != "ulysses"]))
    perm = layout_permutation(SEQ, layout, ring, axes.get("ulysses", 1))
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    q, k, v, do = _inputs()
    ids = _ids(ids_kind)

    def f(q, k, v):
        return jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=causal, layout=layout, return_lse=True,
                                                    kv_exchange=kv_exchange, segment_ids=jnp.asarray(ids[:, perm]))

    # The forward and its pullback jitted together: one program (called eagerly, every op of the
    # call compiled on its own — 289 programs, 10 s on 2 cores). The eager API path is
    # test_jax_api.py's (test_auto_and_explicit_meshes_eager_and_jitted[auto-eager]) and
    # test_cotangent_sharding.py's; this test is about the documents' numerics.
    @jax.jit
    def forward_and_pullback(q, k, v, do):
        (o, lse), pullback = jax.vjp(f, q, k, v)
        return [o, lse, *pullback((do, jnp.zeros_like(lse)))]

    got = forward_and_pullback(*(jnp.asarray(x[:, perm], jnp.float32) for x in (q, k, v, do)))
    inv = np.argsort(perm)
    got = [np.asarray(x)[:, :, inv] if n == "lse" else np.asarray(x)[:, inv]
           for n, x in zip(("o", "lse", "dq", "dk", "dv"), got)]
    for name, g, t in zip(("o", "lse", "dq", "dk", "dv"), got, _truth(q, k, v, do, ids, causal)):
        err = np.max(np.abs(g - t)) / np.max(np.abs(t))
        assert err < 1e-5, (name, err)


CALLS: list = []


def _record(kind: str, q, k, mask):
    def cb(device, qt, kt):
        CALLS.append((kind, int(device), int(qt), int(kt), mask))
    jax.debug.callback(cb, lax.axis_index("ring"), q.shape[1], k.shape[1])


def _counting_fwd(q, k, v, mask, scale, **segments):
    _record("fwd", q, k, mask)
    return get_backend("reference").fwd(q, k, v, mask, scale, **segments)


def _counting_bwd(do, q, k, v, o, lse, mask, scale, dlse=None, **segments):
    _record("bwd", q, k, mask)
    return get_backend("reference").bwd(do, q, k, v, o, lse, mask, scale, dlse, **segments)


register_backend(BlockBackend("counting_documents", _counting_fwd, _counting_bwd))


def _expected_blocks(ids: np.ndarray, layout: str, causal: bool, ring: int) -> dict:
    """Brute force, from the original-order ids and the layout alone: per device, the blocks of
    its schedule that hold at least one visible (query, key) pair, as (q tokens, k tokens,
    whether one document covers the block) — what must run; the others must not."""
    perm = layout_permutation(ids.shape[1], layout, ring)
    shard = ids.shape[1] // ring
    out = defaultdict(list)
    for r in range(ring):
        for visit in device_visits(ring_schedule(layout, causal, ring), r):
            if visit.block is None:
                continue
            qpos = perm[r * shard:(r + 1) * shard][slice(*visit.block.q_part.bounds(shard))]
            kpos = perm[visit.source * shard:(visit.source + 1) * shard][slice(*visit.block.kv_part.bounds(shard))]
            same = ids[0, qpos][:, None] == ids[0, kpos][None, :]
            visible = same & (kpos[None, :] <= qpos[:, None]) if causal else same
            if visible.any():
                one = len(set(ids[0, qpos]) | set(ids[0, kpos])) == 1
                out[r].append((len(qpos), len(kpos), one))
    return out


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("contiguous", False)])
def test_blocks_without_a_shared_document_are_never_computed(layout, causal, jax_devices):
    """The kernel calls that ran (recorded at run time) are exactly the blocks that hold a
    visible pair, forward and backward; a block inside one document runs without the document
    mask (a fused kernel can take it), every other one with it."""
    ring, ids = 4, np.repeat(np.arange(4), [6, 20, 30, 8])[None]  # monotone ids: the range test is exact
    perm = layout_permutation(SEQ, layout, ring)
    mesh = jax.make_mesh((ring,), ("ring",))
    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, SEQ, 2, 8)), jnp.float32)

    def loss(q):
        o = jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=causal, layout=layout,
                                                 block_backend="counting_documents",
                                                 segment_ids=jnp.asarray(ids[:, perm]))
        return jnp.sum(o)

    CALLS.clear()
    jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    jax.effects_barrier()
    expected = _expected_blocks(ids, layout, causal, ring)
    assert sum(map(len, expected.values())) < ring * ring  # the mix does skip blocks
    for kind in ("fwd", "bwd"):
        for r in range(ring):
            ran = sorted((qt, kt, not mask.documents) for k, d, qt, kt, mask in CALLS if (k, d) == (kind, r))
            assert ran == sorted(expected[r]), (kind, r, ran, expected[r])


@pytest.mark.skipif(not FULL, reason="20 s: --full (RINGBRIDGE_FULL=1); the replay parity matrix keeps a packed "
                    "case in the default run (test_replay_parity)")
def test_replay_with_documents_equals_the_mesh(jax_devices):
    """The one-device replay walks the same per-block decisions as the mesh run."""
    layout, ring, causal = "zigzag", 4, True
    perm = layout_permutation(SEQ, layout, ring)
    q, k, v, do = (jnp.asarray(x[:, perm], jnp.float32) for x in _inputs(2))
    ids = jnp.asarray(_ids("mix")[:, perm])
    mesh = jax.make_mesh((ring,), ("ring",))
    o, lse = jax_impl.sequence_parallel_attention(q, k, v, mesh, causal=causal, layout=layout, return_lse=True,
                                                  segment_ids=ids)
    kw = dict(strategy=replay.Strategy(ring=ring), causal=causal, layout=layout, segment_ids=ids)
    o_r, lse_r = replay.replay_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(o_r), np.asarray(o), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_r), np.asarray(lse), atol=1e-6)
    grads = replay.replay_attention_grads(q, k, v, o_r, lse_r, do, None, **kw)
    _, pullback = jax.vjp(lambda q, k, v: jax_impl.sequence_parallel_attention(
        q, k, v, mesh, causal=causal, layout=layout, segment_ids=ids), q, k, v)
    for got, want in zip(grads, pullback(do)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("ids,error,match", [
    (np.zeros((1, SEQ), np.float32), TypeError, "integer dtype"),
    (np.zeros((1, SEQ // 2), np.int32), ValueError, r"\[batch, seq\]"),
    (np.zeros((SEQ,), np.int32), ValueError, r"\[batch, seq\]"),
])
def test_bad_segment_ids_are_refused_before_any_collective(ids, error, match, jax_devices):
    mesh = jax.make_mesh((4,), ("ring",))
    q = jnp.zeros((1, SEQ, HEADS, DIM), jnp.float32)
    with pytest.raises(error, match=match):
        jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, segment_ids=ids)


def test_local_entry_point_checks_its_shard(jax_devices):
    """The per-device function checks the ids it holds (local shapes)."""
    q = jnp.zeros((1, 16, HEADS, DIM), jnp.float32)
    with pytest.raises(ValueError, match="local segment_ids"):
        jax_impl.ring_attention(q, q, q, None, segment_ids=jnp.zeros((1, 8), jnp.int32))

