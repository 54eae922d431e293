"""Tier 2 — sliding windows (``window``) and attention sinks (``sinks``) in jax_impl: every strategy
and layout against a float64 dense truth (o, lse, dq, dk, dv, dsinks; with and without segment ids,
GQA, windows inside a shard, spanning shards and wider than the sequence), blocks out of the window
never computed (counted at run time, forward and backward, against a brute-force count), the sinks'
gradient summed over the devices by shard_map's transpose with and without ``check_vma``, the
replay equal to the mesh, and bad input refused before any collective."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
from jax import lax

import jax_impl
from jax_impl import replay
from jax_impl.block import BlockBackend, get_backend, register_backend
from jax_impl.comm import Comm, using
from jax_impl.config import AttentionConfig
from seqplan.layouts import layout_permutation
from seqplan.schedule import UNBOUNDED, device_visits, ring_schedule

SEQ, HEADS, KV_HEADS, DIM = 64, 4, 2, 8
NAMES = ("o", "lse", "dq", "dk", "dv", "dsinks")


def _ids(kind: str | None) -> np.ndarray | None:
    """[1, SEQ] segment ids in original order: documents of mixed lengths (some spanning shards,
    some of one token), or ids reused non-contiguously."""
    if kind is None:
        return None
    if kind == "mix":
        return np.repeat(np.arange(10), [1, 13, 1, 2, 30, 5, 1, 1, 9, 1])[None]
    return (np.arange(SEQ) // 5 % 3)[None]


def _truth(q, k, v, do, dlse, *, causal, ids=None, window=None, sinks=None) -> dict:
    """float64 NumPy attention in original order with the causal, document and window masks and
    sinks (one more logit per row, no value): o, lse, and the gradients of the loss
    sum(do·o) + sum(dlse·lse) (dlse None: 0), dsinks included."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    ke, ve = (np.repeat(x, g, axis=2) for x in (k, v))
    scale = d ** -0.5
    s = np.einsum("bthd,bshd->bhts", q, ke) * scale
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = np.ones((b, 1, t, t), bool)
    if ids is not None:
        visible = visible & (ids[:, :, None] == ids[:, None, :])[:, None]
    if causal:
        visible = visible & (j <= i)
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        visible = visible & (j >= i - left) & (j <= i + right)
    s = np.where(visible, s, -np.inf)
    logits = s if sinks is None else np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))], -1)
    top = logits.max(-1)
    lse = np.log(np.exp(logits - top[..., None]).sum(-1)) + top
    p = np.exp(s - lse[..., None])
    o = np.einsum("bhts,bshd->bthd", p, ve)
    dlse = np.zeros_like(lse) if dlse is None else dlse
    delta = np.einsum("bthd,bthd->bht", do, o) - dlse  # D - dlse
    dv = np.einsum("bhts,bthd->bshd", p, do)
    ds = p * (np.einsum("bthd,bshd->bhts", do, ve) - delta[..., None]) * scale
    dq = np.einsum("bhts,bshd->bthd", ds, ke)
    dk = np.einsum("bhts,bthd->bshd", ds, q)
    fold = lambda x: x.reshape(b, t, k.shape[2], g, d).sum(3)
    out = dict(o=o, lse=lse, dq=dq, dk=fold(dk), dv=fold(dv))
    if sinks is not None:
        out["dsinks"] = -(np.exp(sinks[None, :, None] - lse) * delta).sum((0, 2))
    return out


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((1, SEQ, HEADS, DIM)) for _ in range(2))
    k, v = (rng.standard_normal((1, SEQ, KV_HEADS, DIM)) for _ in range(2))
    return q, k, v, do, rng.standard_normal((1, HEADS, SEQ)), rng.standard_normal(HEADS)


MESHES = {"ring4": {"ring": 4}, "usp2x2": {"ring": 2, "ulysses": 2}, "ulysses4": {"ulysses": 4},
          "double_ring2x2": {"ring_outer": 2, "ring_inner": 2},
          "double_ring_usp": {"ring_outer": 2, "ring_inner": 2, "ulysses": 2}}
# (mesh, layout, causal, window, sinks, ids, kv_exchange, lse used). Ring shards are 64/R tokens
# (16 on ring4; zigzag chunks of 8): (5, 0) stays inside a shard, 20 and (16, 3) span shards,
# 100 is wider than the sequence (covers every block). KV_HEADS < HEADS throughout (GQA), and
# ulysses4 replicates KV heads up to U.
CASES = [
    ("ring4", "contiguous", True, (5, 0), True, None, "ring", True),
    ("ring4", "zigzag", True, 20, False, "mix", "ring", False),
    ("ring4", "stripe", False, (3, 7), True, None, "ring", True),
    ("ring4", "zigzag", True, None, True, None, "ring", False),  # sinks without a window
    ("ring4", "zigzag", False, 100, True, "interleaved", "allgather", True),
    ("ring4", "stripe", True, (9, 0), True, "mix", "allgather", False),
    ("usp2x2", "zigzag", True, (12, 0), True, None, "ring", True),
    ("usp2x2", "contiguous", False, (2, 40), False, "interleaved", "allgather", True),
    ("ulysses4", "contiguous", False, (9, 4), True, "interleaved", "ring", True),
    ("double_ring2x2", "stripe", True, 10, True, None, "ring", False),
    ("double_ring2x2", "contiguous", False, (0, 17), True, "mix", "ring", True),
    ("double_ring_usp", "zigzag", True, (16, 3), True, "mix", "ring", True),
]


def _run(mesh_name, layout, causal, window, use_sinks, ids_kind, kv_exchange, use_lse, seed,
         block_backend="auto", dtype=jnp.float32) -> tuple[dict, dict]:
    """(got, truth) of one call: forward and pullback jitted together (one compilation), outputs
    and gradients brought back to original order."""
    axes = MESHES[mesh_name]
    ring = int(np.prod([n for a, n in axes.items() if a != "ulysses"]))
    perm = layout_permutation(SEQ, layout, ring, axes.get("ulysses", 1))
    inv = np.argsort(perm)
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    q, k, v, do, dlse, sinks = _inputs(seed)
    ids = _ids(ids_kind)
    sinks, dlse = (sinks if use_sinks else None), (dlse if use_lse else None)

    def attention(q, k, v, sinks):
        out = jax_impl.sequence_parallel_attention(
            q, k, v, mesh, causal=causal, layout=layout, kv_exchange=kv_exchange, return_lse=True, window=window,
            sinks=sinks, block_backend=block_backend, segment_ids=None if ids is None else jnp.asarray(ids[:, perm]))
        return out if use_lse else out[0]

    @jax.jit
    def forward_and_grads(args, cotangents):
        out, pullback = jax.vjp(attention, *args)
        return out, pullback(cotangents)

    args = [jnp.asarray(x[:, perm], dtype) for x in (q, k, v)]
    args.append(None if sinks is None else jnp.asarray(sinks, jnp.float32))
    cotangents = jnp.asarray(do[:, perm], dtype)
    if use_lse:
        cotangents = (cotangents, jnp.asarray(dlse[:, :, perm], jnp.float32))
    out, grads = forward_and_grads(args, cotangents)
    o, lse = out if use_lse else (out, None)
    got = dict(o=np.asarray(o, np.float32)[:, inv], dq=np.asarray(grads[0], np.float32)[:, inv],
               dk=np.asarray(grads[1], np.float32)[:, inv], dv=np.asarray(grads[2], np.float32)[:, inv])
    if lse is not None:
        got["lse"] = np.asarray(lse)[:, :, inv]
    if sinks is not None:
        got["dsinks"] = np.asarray(grads[3])
    truth = _truth(q, k, v, do, dlse, causal=causal, ids=ids, window=window, sinks=sinks)
    return got, truth


def _assert_close(got: dict, truth: dict, tol: float = 1e-5) -> None:
    for name in NAMES:
        if name in got:
            err = np.max(np.abs(got[name] - truth[name])) / np.max(np.abs(truth[name]))
            assert err < tol, (name, err)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c[:5])) for c in CASES])
def test_windows_and_sinks_match_float64_truth(case, seed, jax_devices):
    """o, lse, dq, dk, dv and dsinks of a windowed / sinked call equal the float64 truth (float32: 1e-5)."""
    got, truth = _run(*case, seed=seed)
    assert ("dsinks" in got) == case[4]
    _assert_close(got, truth)


register_backend(BlockBackend("untyped_reference", get_backend("reference").fwd, get_backend("reference").bwd,
                              typed_for_shard_map=False))


def test_sinks_gradient_is_summed_without_check_vma(seed, jax_devices):
    """A backend whose outputs carry no varying-axes type makes the API run shard_map with
    check_vma=False; the replicated sinks' cotangent must still be the sum over every device."""
    got, truth = _run("usp2x2", "zigzag", True, (12, 0), True, None, "ring", True, seed=seed,
                      block_backend="untyped_reference")
    _assert_close(got, truth)


def test_dense_control_takes_window_and_sinks(seed):
    """dense_attention (the dtype control) in float32 equals the float64 truth with a window,
    sinks and segment ids."""
    q, k, v, _, _, sinks = _inputs(seed)
    ids = _ids("mix")
    o, lse = jax_impl.dense_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), causal=True,
                                      segment_ids=jnp.asarray(ids), window=(7, 0), sinks=jnp.asarray(sinks, jnp.float32))
    truth = _truth(q, k, v, np.zeros_like(q), None, causal=True, ids=ids, window=(7, 0), sinks=sinks)
    _assert_close({"o": np.asarray(o), "lse": np.asarray(lse)}, truth)


# ---- blocks out of the window are never computed -------------------------------------------------

CALLS: list = []


def _record(kind: str, q, k, mask):
    def cb(device, qt, kt):
        CALLS.append((kind, int(device), int(qt), int(kt), mask))
    jax.debug.callback(cb, lax.axis_index("ring"), q.shape[1], k.shape[1])


def _counting_fwd(q, k, v, mask, scale, **arrays):
    _record("fwd", q, k, mask)
    return get_backend("reference").fwd(q, k, v, mask, scale, **arrays)


def _counting_bwd(do, q, k, v, o, lse, mask, scale, dlse=None, **arrays):
    _record("bwd", q, k, mask)
    return get_backend("reference").bwd(do, q, k, v, o, lse, mask, scale, dlse, **arrays)


register_backend(BlockBackend("counting_windows", _counting_fwd, _counting_bwd))


def _expected_blocks(layout: str, causal: bool, window: tuple[int, int], ids, ring: int) -> dict:
    """Brute force, from original positions alone: per device, the blocks of its schedule that hold
    a visible pair, as (q tokens, k tokens, documents masked, window masked): documents masked
    unless one document holds the whole block, window masked unless every pair of the block lies
    inside the window."""
    perm = layout_permutation(SEQ, layout, ring)
    shard, (left, right) = SEQ // ring, window
    if causal:  # no visible key is after its query: the right extent masks nothing (kernel_window)
        right = UNBOUNDED
    out = defaultdict(list)
    for r in range(ring):
        for visit in device_visits(ring_schedule(layout, causal, ring), r):
            if visit.block is None:
                continue
            qpos = perm[r * shard:(r + 1) * shard][slice(*visit.block.q_part.bounds(shard))][:, None]
            kpos = perm[visit.source * shard:(visit.source + 1) * shard][slice(*visit.block.kv_part.bounds(shard))][None, :]
            inside = (kpos >= qpos - left) & (kpos <= qpos + right)
            visible = inside & (kpos <= qpos) if causal else inside
            documents = False
            if ids is not None:
                visible = visible & (ids[0, qpos] == ids[0, kpos])
                documents = len(set(ids[0, qpos.ravel()]) | set(ids[0, kpos.ravel()])) > 1
            if visible.any():
                out[r].append((qpos.size, kpos.size, documents, not inside.all()))
    return out


# Monotone document ids and parts contiguous in original order (contiguous, zigzag): the run-time
# range tests are exact, so what ran must be exactly the blocks with a visible pair.
SKIP_CASES = [("contiguous", True, (5, 0), None), ("contiguous", False, (3, 18), None),
              ("zigzag", True, (20, 0), "monotone"), ("contiguous", False, (17, 2), "monotone")]


@pytest.mark.parametrize("layout,causal,window,ids_kind", SKIP_CASES)
def test_blocks_out_of_the_window_are_never_computed(layout, causal, window, ids_kind, jax_devices):
    """The kernel calls that ran (recorded at run time) are exactly the blocks holding a visible
    pair, forward and backward; a block the window covers runs without the window mask, one
    inside one document without the document mask."""
    ring = 4
    ids = np.repeat(np.arange(4), [6, 20, 30, 8])[None] if ids_kind else None
    perm = layout_permutation(SEQ, layout, ring)
    mesh = jax.make_mesh((ring,), ("ring",))
    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, SEQ, 2, 8)), jnp.float32)

    def loss(q):
        o = jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=causal, layout=layout, window=window,
                                                 block_backend="counting_windows",
                                                 segment_ids=None if ids is None else jnp.asarray(ids[:, perm]))
        return jnp.sum(o)

    CALLS.clear()
    jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    jax.effects_barrier()
    expected = _expected_blocks(layout, causal, window, ids, ring)
    planned = sum(v.block is not None for r in range(ring) for v in device_visits(ring_schedule(layout, causal, ring), r))
    assert sum(map(len, expected.values())) < planned  # the window does skip blocks
    for kind in ("fwd", "bwd"):
        for r in range(ring):
            ran = sorted((qt, kt, mask.documents, mask.window is not None)
                         for k, d, qt, kt, mask in CALLS if (k, d) == (kind, r))
            assert ran == sorted(expected[r]), (kind, r, ran, expected[r])


# ---- the replay ------------------------------------------------------------------------------------

def test_replay_with_window_and_sinks_equals_the_mesh(seed, jax_devices):
    """The one-device replay walks the same per-block decisions and enters the sinks as the mesh
    does: o, lse, dq, dk, dv and dsinks agree (USP: each device's sinks are its heads')."""
    layout, causal, window = "zigzag", True, (12, 0)
    axes = {"ring": 2, "ulysses": 2}
    perm = layout_permutation(SEQ, layout, 2, 2)
    q, k, v, do, dlse, sinks = _inputs(seed)
    q, k, v, do = (jnp.asarray(x[:, perm], jnp.float32) for x in (q, k, v, do))
    dlse, sinks = jnp.asarray(dlse[:, :, perm], jnp.float32), jnp.asarray(sinks, jnp.float32)
    ids = jnp.asarray(_ids("mix")[:, perm])
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))

    @jax.jit
    def mesh_run(q, k, v, sinks):
        out, pullback = jax.vjp(lambda *a: jax_impl.sequence_parallel_attention(
            *a[:3], mesh, causal=causal, layout=layout, return_lse=True, window=window, sinks=a[3],
            segment_ids=ids), q, k, v, sinks)
        return out, pullback((do, dlse))

    (o, lse), grads = mesh_run(q, k, v, sinks)
    kw = dict(strategy=replay.Strategy(ring=2, ulysses=2), causal=causal, layout=layout, segment_ids=ids,
              window=window, sinks=sinks)
    o_r, lse_r = replay.replay_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(o_r), np.asarray(o), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_r), np.asarray(lse), atol=1e-6)
    replayed = replay.replay_attention_grads(q, k, v, o_r, lse_r, do, dlse, **kw)
    assert len(replayed) == 4  # (dq, dk, dv, dsinks) with sinks
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), replayed, grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=name)


# ---- validation ------------------------------------------------------------------------------------

class _NoCollectives(Comm):
    """Fails the call if any K/V transfer is traced: validation must come first."""

    def shift(self, tree, hop, axes):
        raise AssertionError("a collective was traced before validation")

    def gather(self, x, axis_name):
        raise AssertionError("a collective was traced before validation")


BAD = [
    (dict(window=-1), ValueError, ">= 0"),
    (dict(window=(2, -3)), ValueError, ">= 0"),
    (dict(window=(1, 2, 3)), TypeError, "window must be"),
    (dict(window=True), TypeError, "window must be"),
    (dict(window=2.5), TypeError, "window must be"),
    (dict(sinks=np.zeros(HEADS + 1, np.float32)), ValueError, r"\[heads\]"),
    (dict(sinks=np.zeros((1, HEADS), np.float32)), ValueError, r"\[heads\]"),
    (dict(sinks=np.zeros(HEADS, np.int32)), TypeError, "floating dtype"),
]


@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
@pytest.mark.parametrize("bad,error,match", BAD)
def test_bad_window_or_sinks_refused_before_any_collective(bad, error, match, kv_exchange, jax_devices):
    mesh = jax.make_mesh((4,), ("ring",))
    q = jnp.zeros((1, SEQ, HEADS, DIM), jnp.float32)
    with using(_NoCollectives()), pytest.raises(error, match=match):
        jax_impl.sequence_parallel_attention(q, q, q, mesh, causal=True, kv_exchange=kv_exchange, **bad)


@pytest.mark.parametrize("bad,error,match", BAD)
def test_per_device_entry_points_and_replay_check_window_and_sinks(bad, error, match, jax_devices):
    """ring, all-gather and double-ring entry points (local shapes) and the replay refuse the same."""
    q = jnp.zeros((1, 16, HEADS, DIM), jnp.float32)
    for call in (lambda: jax_impl.ring_attention(q, q, q, None, **bad),
                 lambda: jax_impl.allgather_attention(q, q, q, None, **bad),
                 lambda: jax_impl.double_ring_attention(q, q, q, ("ring_outer", "ring_inner"), **bad),
                 lambda: replay.replay_attention(q, q, q, strategy=replay.Strategy(ring=2), **bad)):
        with pytest.raises(error, match=match):
            call()


def test_config_normalises_the_window():
    """An int w is (w, w); a list becomes a hashable tuple (the config keys compilations)."""
    assert AttentionConfig(False, "zigzag", 0.5, window=3).window == (3, 3)
    assert AttentionConfig(False, "zigzag", 0.5, window=[2, 0]).window == (2, 0)
    # causal: no visible key is after its query, so the right extent is stored unbounded
    assert AttentionConfig(True, "zigzag", 0.5, window=[2, 0]).window == (2, UNBOUNDED)
    hash(AttentionConfig(True, "zigzag", 0.5, window=[2, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        AttentionConfig(True, "zigzag", 0.5, window=(-1, 0))


# ---- the fused window path: BlockMask.offset and the band adapter, end to end on the CPU ---------

def _fa_window_mask(t: int, s: int, causal: bool, window):
    """FlashAttention's (bottom-right aligned) window on a [t, s] block as (mask, positions): key
    j visible to query i when (s - t) - left <= j - i <= (s - t) + right, -1 unbounded."""
    from seqplan.schedule import CAUSAL_MASK, FULL_MASK

    left, right = window
    if left < 0 and right < 0:
        return (CAUSAL_MASK if causal else FULL_MASK), {}
    bound = lambda x: UNBOUNDED if x < 0 else x
    positions = (jnp.arange(t, dtype=jnp.int32) + (s - t), jnp.arange(s, dtype=jnp.int32))
    return FULL_MASK.with_window((bound(left), bound(right))), {"positions": positions}


BAND_MASKS: list = []
BLOCK_SHAPES: list = []  # (rows, keys) of every windowed block the loop hands the backend


def _band_fwd_op(q, k, v, causal, scale, window=(-1, -1)):
    mask, arrays = _fa_window_mask(q.shape[1], k.shape[1], causal, window)
    BAND_MASKS.append(tuple(window))
    return get_backend("reference").fwd(q, k, v, mask, scale, **arrays)


def _band_bwd_op(do, q, k, v, o, lse, causal, scale, window=(-1, -1)):
    mask, arrays = _fa_window_mask(q.shape[1], k.shape[1], causal, window)
    return get_backend("reference").bwd(do, q, k, v, o, lse, mask, scale, None, **arrays)


def _register_band_backend():
    from jax_impl.kernels.fused import fused_backend

    fused = fused_backend("band_cpu", _band_fwd_op, _band_bwd_op, windowed=True)

    def fwd(q, k, v, mask, scale, **arrays):
        if mask.window is not None:
            BLOCK_SHAPES.append((q.shape[1], k.shape[1]))
        return fused.fwd(q, k, v, mask, scale, **arrays)

    register_backend(dataclasses.replace(fused, fwd=fwd))


@pytest.mark.parametrize("mesh_name, layout, causal, window, bands, cropped", [
    # hop truncation: the diagonal, the shard before (whole) and the one before that (rows 0-3 of 16)
    ("ring4", "contiguous", True, (20, 0), True, True),
    # shorter than a shard: the diagonal and the shard before's halo (rows 0-4, keys 11-15 of 16)
    ("ring4", "contiguous", True, (5, 0), True, True),
    ("ring4", "contiguous", False, (6, 9), True, True),   # two-sided: bands on both sides of the diagonal
    ("usp2x2", "contiguous", True, (12, 0), True, True),  # a ring of 2: the halo block, rows 0-11 of 32
    # zigzag: every windowed block has a part spanning both chunks of a shard (not one position
    # run): no band, the portable kernel runs it
    ("ring4", "zigzag", True, (5, 0), False, False),
])
def test_fused_window_band_matches_float64_truth(mesh_name, layout, causal, window, bands, cropped, seed,
                                                 jax_devices):
    """A windowed block reaches a fused kernel's own window only as a band with its static offset
    (the loop's per-offset variants, ``fused.py``'s crop and pad-back): with FlashAttention's
    window convention emulated on the CPU by the portable kernel, every output and gradient still
    equals the float64 truth, and band calls were made exactly where the parts are position runs.
    A visited block is cropped to its band before the kernel (``loop.crop_block``): some calls
    take fewer rows than a shard exactly where a band is narrower than its block."""
    _register_band_backend()
    BAND_MASKS.clear()
    BLOCK_SHAPES.clear()
    got, truth = _run(mesh_name, layout, causal, window, False, None, "ring", True, seed=seed,
                      block_backend="band_cpu")
    _assert_close(got, truth)
    assert any(w != (-1, -1) for w in BAND_MASKS) == bands, BAND_MASKS
    part = SEQ // (4 if mesh_name == "ring4" else 2) // (2 if layout == "zigzag" else 1)  # a block's rows
    assert any(rows < part for rows, _ in BLOCK_SHAPES) == cropped, BLOCK_SHAPES


@pytest.mark.parametrize("mesh_name, block_backend, use_sinks, ids_kind, halo", [
    ("ring4", "auto", False, None, (0, 5, 11, 16)), ("ring4", "band_cpu", False, "mix", (0, 5, 11, 16)),
    ("ring4", "auto", True, None, (0, 5, 11, 16)), ("usp2x2", "auto", False, "mix", (0, 5, 27, 32))])
def test_halo_accumulators_widen_only_the_halo_rows_bit_for_bit(mesh_name, block_backend, use_sinks, ids_kind, halo,
                                                                 seed, jax_devices, monkeypatch):
    """The window ring's halo schedule keeps its accumulators in the inputs' dtype with float32
    rows where the one visited block adds (``merge.Float32Rows``: o's and dq's first ``halo``
    queries, dK / dV's last ``halo`` keys): in bf16, o, lse and every gradient equal bit for bit
    the whole-shard float32 accumulators' (the loops called with ``rows=None``) — with the portable
    kernel (blocks not cropped: rows outside the float32 ones pass once through the base) and the
    fused band path (cropped to the band), with documents, and on USP's ring of 2. With sinks o comes whole in float32 (they
    enter every row): only the gradients are split. Compared as bits (sign of zero included)."""
    from jax_impl import loop, merge, ring

    if block_backend == "band_cpu":
        _register_band_backend()
    widened = []
    real_widen = merge.Float32Rows.widen.__func__
    monkeypatch.setattr(merge.Float32Rows, "widen",
                        classmethod(lambda cls, x, lo, hi, dtype: widened.append((lo, hi)) or real_widen(cls, x, lo, hi, dtype)))
    case = (mesh_name, "contiguous", True, (5, 0), use_sinks, ids_kind, "ring", True)
    got, _ = _run(*case, seed=seed, block_backend=block_backend, dtype=jnp.bfloat16)
    # o (without sinks) and dq: queries 0-4; dK / dV: keys 11-15 of a 16-token shard
    q_rows, kv_rows = halo[:2], halo[2:]
    assert sorted(set(widened)) == sorted({q_rows, kv_rows}), widened
    assert widened.count(q_rows) == (1 if use_sinks else 2) * widened.count(kv_rows) // 2, widened
    forward_visit, backward_visit = loop.forward_visit, ring.backward_visit
    monkeypatch.setattr(loop, "forward_visit", lambda *a, rows=None, **k: forward_visit(*a, **k))
    monkeypatch.setattr(ring, "backward_visit", lambda *a, rows=None, **k: backward_visit(*a, **k))
    widened.clear()
    whole, _ = _run(*case, seed=seed, block_backend=block_backend, dtype=jnp.bfloat16)
    assert not widened
    for name in got:  # bf16 and float32 values as float32 arrays: their bits
        np.testing.assert_array_equal(got[name].view(np.uint32), whole[name].view(np.uint32), err_msg=name)


@pytest.mark.parametrize("ring,ulysses", [(1, 1), (1, 4), (2, 2)], ids=["ring-r1", "ulysses-u4", "usp-r2xu2"])
def test_sinks_round_o_once_in_low_precision(ring, ulysses, seed, jax_devices):
    """bfloat16 with sinks: o is the float32 result rounded once to bf16 on every mesh, also where a
    device's own block is its only one (one ring step: R = 1, Ulysses). Found by the fuzz (seed
    1790552572): such a block returned o in bf16 before the sinks rescaled it, a second rounding on
    a quarter of o's elements that dq carried past the numerics policy (2.3e-2 against 1.9e-2).
    The flash ideal (``parity.core.inputs.flash_ideal``) is the float64 o rounded once; float32
    sums may round a tie the other way, so a few elements may differ, not a quarter."""
    from parity.core.cases import Case
    from parity.core.inputs import flash_ideal, make_inputs
    from parity.runners.jax_runner import JaxRunner

    case = Case(ring=ring, ulysses=ulysses, seq=32, heads=8, kv_heads=4, head_dim=8, layout="zigzag", causal=True,
                dtype="bfloat16", documents="interleaved", window=(5, 0), sinks=True)
    x = make_inputs(case, seed=seed)
    got, ideal = JaxRunner("reference").run_case(case, x), flash_ideal(case, x)
    off = np.mean(np.asarray(got["o"], np.float64) != np.asarray(ideal["o"], np.float64))
    assert off <= 0.02, f"{off:.1%} of o's elements are not the exact o rounded once"
