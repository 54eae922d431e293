"""Tier 1 — the portable block kernels walk the keys in chunks (an online softmax forward, a
per-chunk backward) so a masked block never holds its [t, s] scores. Why this tier exists: the
chunked path must equal the whole-block math for every mask kind × documents × window (and
soft-capped logits, forward and backward), with
chunks that do not divide the block (padded keys) and rows that see no key at all — and a block
of real length must compile to temporaries far below its float32 scores (issue 35's memory rule)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from seqplan.schedule import BlockMask, MaskKind

B, T, H, HK, D = 2, 13, 4, 2, 8
WINDOWS = (None, (3, 0), (2, 4))


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, T, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, T, HK, D)) for _ in range(2))
    # documents: short runs, a length-1 document, and ids that differ between the two rows
    ids = np.array([[0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4], [5, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 8, 8]], np.int32)
    positions = np.arange(T, dtype=np.int32) * 2 + 1  # original positions with gaps (a zigzag-like shard)
    return q, k, v, do, ids, positions


def _truth(q, k, v, do, mask: BlockMask, scale, ids, positions, softcap=None):
    """float64, the whole [t, s] block at once: (o, lse, dq, dk, dv); with ``softcap`` every
    scaled logit x is softcap·tanh(x / softcap) and dS gains the slope 1 − tanh²."""
    g = H // HK
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kk) * scale
    slope = 1.0
    if softcap is not None:
        slope = 1.0 - np.tanh(s / softcap) ** 2
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = np.ones((T, T), bool)
    if mask.kind is MaskKind.CAUSAL:
        visible = j <= i
    elif mask.kind is MaskKind.STRICT:
        visible = j < i
    if mask.window is not None:
        left, right = mask.window
        off = positions[None, :] - positions[:, None]
        visible = visible & (off >= -left) & (off <= right)
    visible = np.broadcast_to(visible, (B, 1, T, T))
    if mask.documents:
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    p = np.where(den > 0, e / np.where(den > 0, den, 1), 0.0)
    lse = np.where(den[..., 0] > 0, (m + np.log(np.where(den > 0, den, 1)))[..., 0], -np.inf)
    o = np.einsum("bhts,bshd->bthd", p, vv)
    dp = np.einsum("bthd,bshd->bhts", do, vv)
    delta = np.einsum("bthd,bthd->bht", do, o)[..., None]
    ds = p * (dp - delta) * slope * scale
    dq = np.einsum("bhts,bshd->bthd", ds, kk)
    dk = np.einsum("bhts,bthd->bshd", ds, q).reshape(B, T, HK, g, D).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, do).reshape(B, T, HK, g, D).sum(3)
    return o, lse, dq, dk, dv


# every mask kind × documents × window, chunked in 5s (padded keys, several chunks); the whole-block
# path (one chunk) for each mask kind with documents and a window, the rest of it is every other test
CASES = [(kind, documents, window, 5) for kind, documents, window in itertools.product(MaskKind, (False, True), WINDOWS)]
CASES += [(kind, True, (2, 4), None) for kind in MaskKind]
CASES = [(*c, None) for c in CASES]
# logit soft-capping (a cap of 0.7 bends most of these logits): every mask kind, chunked and whole,
# with documents and a window (masked pairs stay masked after the cap)
CASES += [(kind, True, (2, 4), chunk, 0.7) for kind in MaskKind for chunk in (5, None)]
CASES += [(MaskKind.FULL, False, None, 5, 3.0)]


def _check(got, want, name):
    got = np.asarray(got, np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=name)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("kind, documents, window, chunk, softcap", CASES)
def test_jax_chunked_kernel_equals_the_whole_block(kind, documents, window, chunk, softcap, seed):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    q, k, v, do, ids, positions = _inputs(seed)
    mask, scale = BlockMask(kind, documents=documents, window=window), D**-0.5
    extra = {}
    if documents:
        extra["segments"] = (jnp.asarray(ids), jnp.asarray(ids))
    if window is not None:
        extra["positions"] = (jnp.asarray(positions), jnp.asarray(positions))
    if softcap is not None:
        extra["softcap"] = softcap
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    o, lse = reference_block_fwd(f32(q), f32(k), f32(v), mask, scale, chunk=chunk, **extra)
    grads = reference_block_bwd(f32(do), f32(q), f32(k), f32(v), o, lse, mask, scale, chunk=chunk, **extra)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads),
                               _truth(q, k, v, do, mask, scale, ids, positions, softcap)):
        _check(got, want, name)


@pytest.mark.parametrize("kind, documents, window, chunk, softcap", CASES)
def test_torch_chunked_kernel_equals_the_whole_block(kind, documents, window, chunk, softcap, seed):
    torch = pytest.importorskip("torch")

    from torch_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    q, k, v, do, ids, positions = _inputs(seed)
    mask, scale = BlockMask(kind, documents=documents, window=window), D**-0.5
    extra = {}
    if documents:
        extra["segments"] = (torch.from_numpy(ids), torch.from_numpy(ids))
    if window is not None:
        extra["positions"] = (torch.from_numpy(positions), torch.from_numpy(positions))
    if softcap is not None:
        extra["softcap"] = softcap
    f32 = lambda x: torch.from_numpy(x).float()
    o, lse = reference_block_fwd(f32(q), f32(k), f32(v), mask, scale, chunk=chunk, **extra)
    grads = reference_block_bwd(f32(do), f32(q), f32(k), f32(v), o, lse, mask, scale, chunk=chunk, **extra)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads),
                               _truth(q, k, v, do, mask, scale, ids, positions, softcap)):
        _check(got.numpy(), want, name)


def test_key_chunk_bounds_the_scores():
    from seqplan import chunks

    assert chunks.key_chunk(1024, 1024) == 1024  # small blocks: one chunk, the plain softmax
    for t, s in ((16384, 16384), (131072, 131072), (4096, 100000)):
        c = chunks.key_chunk(t, s)
        assert c * t <= max(chunks.SCORE_ELEMENTS, chunks.MIN_KEY_CHUNK * t) and c & (c - 1) == 0, (t, s, c)


def test_jax_masked_block_compiles_to_a_sixteenth_of_its_scores():
    """One document-masked causal block at t = s = 16384, 8 heads, forward + backward: XLA's
    compiled temporaries ≤ 1/16 of that block's float32 scores (8 GiB). Compiled, not run."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_impl.kernels.reference import reference_block_bwd, reference_block_fwd

    b, t, h, d = 1, 16384, 8, 64
    mask = BlockMask(MaskKind.CAUSAL, documents=True)

    def step(q, k, v, do, ids):
        o, lse = reference_block_fwd(q, k, v, mask, d**-0.5, segments=(ids, ids))
        return reference_block_bwd(do, q, k, v, o, lse, mask, d**-0.5, segments=(ids, ids))

    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    compiled = jax.jit(step).lower(x, x, x, x, ids).compile()
    scores = b * h * t * t * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= scores / 16, f"temporaries {temp / 2**20:.0f} MiB > 1/16 of the scores' {scores / 2**20:.0f} MiB"
