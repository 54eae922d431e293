"""The portable block kernels (backend ``"reference"``): einsum with float32 accumulation at
full precision, any device, any dtype. The default on CPU and for float32, and the fallback of
the fused kernels' backward when a caller passes an lse cotangent.

Blockwise: the keys are walked in chunks of ``c`` (``seqplan.chunks.key_chunk``; a ``lax.scan`` when there is
more than one) with an online softmax in the forward and the scores recomputed per chunk in the
backward, so a block's temporaries are O(t · c), never the [t, s] scores: a packed-documents block
of 16k × 16k tokens fits where its float32 scores (8 GiB at 8 heads) would not. A block small
enough (t · s ≤ ``SCORE_ELEMENTS``) is one chunk: the plain softmax.

Shapes: q, do, o [b, t, h, d]; k, v [b, s, hk, d]; lse, dlse [b, h, t] float32; with a
document mask, ``segments = (q_ids [b, t], kv_ids [b, s])``; with a window,
``positions = (q_pos [t], kv_pos [s])`` (int32 original token positions), or per batch row
``(q_pos [b, t], kv_pos [b, s])`` — explicit token indices (the ``token_index`` argument), whose
causal mask is the window ``(UNBOUNDED, 0)`` on them (``seqplan.schedule.token_index_window``).

Soft-capping (``softcap``, a float, Gemma 2): every scaled logit x = scale·q·k becomes
softcap · tanh(x / softcap) before the mask and the softmax, in the forward and in the backward's
recomputed scores; the backward multiplies dS by the cap's slope 1 − tanh²(x / softcap) before
the scale. The LSE and its merge are unchanged (capping is per logit). This is the one JAX
kernel that soft-caps (``supports`` says so; the fused ones do not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqplan.chunks import key_chunk
from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend

F32 = jnp.float32
# f32 matmuls at full precision: on GPUs XLA's default may use TF32, which breaks the 1e-5 policy.
_PRECISION = jax.lax.Precision.HIGHEST


def check_mask_arrays(mask: BlockMask, t: int, s: int, segments, positions, b: int | None = None) -> None:
    """ValueError unless ``segments`` is given exactly with documents, ``positions`` exactly with a
    window, and a causal / strict block is square."""
    if mask.documents != (segments is not None):
        raise ValueError(f"segments must be given exactly when the mask has documents (mask {mask}, "
                         f"segments {'given' if segments is not None else 'None'})")
    if (mask.window is not None) != (positions is not None):
        raise ValueError(f"positions must be given exactly when the mask has a window (mask {mask}, "
                         f"positions {'given' if positions is not None else 'None'})")
    def fits(shape, n):
        return shape == (n,) or (len(shape) == 2 and shape[1] == n and b in (None, shape[0]))

    if positions is not None and not (fits(tuple(positions[0].shape), t) and fits(tuple(positions[1].shape), s)
                                      and len(positions[0].shape) == len(positions[1].shape)):
        raise ValueError(f"positions must be [t] and [s], or per row (token indices) [b, t] and [b, s], for a "
                         f"{t}x{s} block, got {tuple(positions[0].shape)} and {tuple(positions[1].shape)}")
    if mask.kind is not MaskKind.FULL and t != s:
        raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")


def chunk_visible(mask: BlockMask, t: int, s: int, kv_index, q_ids=None, kv_ids=None, q_pos=None, kv_pos=None):
    """Visible (query, key) pairs of the queries against one chunk of keys ``kv_index`` [c] (their
    indices in the block; indices ≥ s are padding, never visible), broadcastable to the scores
    [b, hk, g, t, c]: [t, c] bool, [b, 1, 1, t, c] with documents (``kv_ids`` [b, c], the chunk's),
    or None when every pair is visible. A window reads ``q_pos`` [t] and the chunk's ``kv_pos`` [c]
    (per-row token indices: [b, t] and [b, c], giving [b, 1, 1, t, c])."""
    c = kv_index.shape[0]
    visible = None
    if mask.kind is not MaskKind.FULL:
        q_index = jnp.arange(t)[:, None]
        visible = kv_index[None, :] <= q_index if mask.kind is MaskKind.CAUSAL else kv_index[None, :] < q_index
    elif c * -(-s // c) != s:  # padded keys only exist when c does not divide s
        visible = jnp.broadcast_to(kv_index[None, :] < s, (t, c))
    if q_pos is not None:
        (left, right), qp, kp = mask.window, q_pos[..., :, None], kv_pos[..., None, :]
        near = (kp >= qp - left) & (kp <= qp + right)  # [t, c], or [b, t, c] for per-row token indices
        if near.ndim == 3:
            near = near[:, None, None]  # [b, 1, 1, t, c]
            visible = near if visible is None else near & visible[None, None, None]
        else:
            visible = near if visible is None else visible & near
    if q_ids is not None:
        same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]  # [b, 1, 1, t, c]
        visible = same if visible is None else same & (visible if visible.ndim == 5 else visible[None, None, None])
    return visible


def mask_matrix(mask: BlockMask, t: int, s: int, segments=None, positions=None):
    """Visible (query, key) pairs of the whole block, broadcastable to scores [b, hk, g, t, s]:
    [t, s] bool, [b, 1, 1, t, s] with documents, or None when every pair is visible (for tests
    and small blocks; the kernels below build it chunk by chunk)."""
    check_mask_arrays(mask, t, s, segments, positions)
    q_ids, kv_ids = segments if segments is not None else (None, None)
    q_pos, kv_pos = positions if positions is not None else (None, None)
    return chunk_visible(mask, t, s, jnp.arange(s), q_ids, kv_ids, q_pos, kv_pos)


def _scores(q, k, scale):
    """q: [b, t, h, d], k: [b, s, hk, d] -> scores [b, hk, g, t, s] float32 (g = h // hk)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, h // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32, precision=_PRECISION)
    return s * jnp.asarray(scale, F32)


def _capped(scores, softcap):
    """(softcap · tanh(scores / softcap), its slope 1 − tanh²) — or (scores, None) without a cap."""
    if softcap is None:
        return scores, None
    th = jnp.tanh(scores / jnp.asarray(softcap, F32))
    return th * jnp.asarray(softcap, F32), 1.0 - th * th


def _key_chunks(c: int, k, v, segments, positions):
    """The keys' side split into n chunks of c (zero-padded to n · c), each leading with n:
    (kv_index [n, c], k, v [n, b, c, hk, d], kv_ids [n, b, c] or None, kv_pos [n, c] or None)."""
    s = k.shape[1]
    n = -(-s // c)
    pad = n * c - s

    def split(x, axis):
        x = jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)]) if pad else x
        x = x.reshape(*x.shape[:axis], n, c, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    kv_ids = None if segments is None else split(segments[1], 1)
    kv_pos = None if positions is None else split(positions[1], positions[1].ndim - 1)
    return jnp.arange(n * c).reshape(n, c), split(k, 1), split(v, 1), kv_ids, kv_pos


def _whole(k, v, segments, positions):
    """The keys' side as one chunk (what :func:`_key_chunks` gives for one chunk, without a split)."""
    return (jnp.arange(k.shape[1]), k, v, None if segments is None else segments[1],
            None if positions is None else positions[1])


def reference_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None, softcap=None, *,
                        chunk: int | None = None):
    """Portable forward, an online softmax over key chunks (``chunk``: default ``seqplan.chunks.key_chunk``).
    A query row with no visible key gets o = 0 and lse = -inf (stripe's strict mask on row 0, a
    query whose document or window has no key in the block), which the LSE merge treats as an
    empty partial."""
    b, t, h, d = q.shape
    s = k.shape[1]
    check_mask_arrays(mask, t, s, segments, positions, b)
    q_ids = None if segments is None else segments[0]
    q_pos = None if positions is None else positions[0]
    c = chunk or key_chunk(t, s)

    def chunk_stats(x):
        """A chunk's masked softmax pieces: its row max m, exp(scores - m) and their row sum."""
        kv_index, k_c, v_c, kv_ids, kv_pos = x
        sc, _ = _capped(_scores(q, k_c, scale), softcap)
        visible = chunk_visible(mask, t, s, kv_index, q_ids, kv_ids, q_pos, kv_pos)
        if visible is not None:
            sc = jnp.where(visible, sc, -jnp.inf)
        m = jnp.max(sc, axis=-1)  # [b, hk, g, t]; -inf on a row that sees nothing in this chunk
        p = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
        return m, p, jnp.einsum("bkgts,bskd->bkgtd", p, v_c.astype(F32), precision=_PRECISION)

    def step(carry, x):  # the online softmax: rescale what was summed so far to the new row max
        m, total, acc = carry  # running max, sum and numerator: [b, hk, g, t], [..], [b, hk, g, t, d]
        m_c, p, pv = chunk_stats(x)
        m_new = jnp.maximum(m, m_c)
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        old, new = jnp.exp(m - safe), jnp.exp(jnp.where(jnp.isfinite(m_c), m_c, 0.0) - safe)  # 0 for -inf
        return (m_new, total * old + jnp.sum(p, axis=-1) * new, acc * old[..., None] + pv * new[..., None]), None

    if c >= s:  # a small block: one chunk, the plain softmax (no split, no loop: the least to compile)
        m, p, acc = chunk_stats(_whole(k, v, segments, positions))
        total = jnp.sum(p, axis=-1)
    else:  # the first chunk starts the sums
        xs = _key_chunks(c, k, v, segments, positions)
        m, p, acc = chunk_stats(jax.tree_util.tree_map(lambda x: x[0], xs))
        total = jnp.sum(p, axis=-1)
        (m, total, acc), _ = jax.lax.scan(step, (m, total, acc), jax.tree_util.tree_map(lambda x: x[1:], xs))
    has_key = total > 0
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(has_key, m_safe + jnp.log(jnp.where(has_key, total, 1.0)), -jnp.inf)
    o = acc / jnp.where(has_key, total, 1.0)[..., None]
    return jnp.moveaxis(o, 3, 1).reshape(b, t, h, d), lse.reshape(b, h, t)


def reference_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None,
                        positions=None, softcap=None, *, chunk: int | None = None):
    """Portable backward with the global ``o`` and ``lse``, per key chunk:
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse) (∘ the cap's slope with ``softcap``), dQ = scale·dS K
    (summed over chunks), dK = scale·dSᵀ Q, dV = Pᵀ dO (each chunk's own rows)."""
    b, t, h, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    g = h // hk
    check_mask_arrays(mask, t, s, segments, positions, b)
    q_ids = None if segments is None else segments[0]
    q_pos = None if positions is None else positions[0]
    lse_g = lse.reshape(b, hk, g, t)[..., None]
    do_g = do.astype(F32).reshape(b, t, hk, g, d)
    q_g = q.astype(F32).reshape(b, t, hk, g, d)
    delta = jnp.einsum("btkgd,btkgd->bkgt", do_g, o.astype(F32).reshape(b, t, hk, g, d), precision=_PRECISION)
    if dlse is not None:
        delta = delta - dlse.astype(F32).reshape(b, hk, g, t)
    c = chunk or key_chunk(t, s)
    def step(dq, x):
        kv_index, k_c, v_c, kv_ids, kv_pos = x
        sc, slope = _capped(_scores(q, k_c, scale), softcap)
        p = jnp.exp(sc - lse_g)
        visible = chunk_visible(mask, t, s, kv_index, q_ids, kv_ids, q_pos, kv_pos)
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        dv_c = jnp.einsum("bkgts,btkgd->bskd", p, do_g, precision=_PRECISION)
        dp = jnp.einsum("btkgd,bskd->bkgts", do_g, v_c.astype(F32), precision=_PRECISION)
        ds = p * (dp - delta[..., None])
        ds = (ds if slope is None else ds * slope) * jnp.asarray(scale, F32)
        dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, k_c.astype(F32), precision=_PRECISION)
        dk_c = jnp.einsum("bkgts,btkgd->bskd", ds, q_g, precision=_PRECISION)
        return dq, (dk_c, dv_c)

    # dq's sum starts from zeros typed like q (inside shard_map, a scan carry must keep the
    # varying axes its body gives it: plain zeros are unvarying, and the chunked backward failed)
    dq0 = jnp.zeros_like(q_g)
    if c >= s:  # a small block: one chunk, no split, no loop
        dq, (dk, dv) = step(dq0, _whole(k, v, segments, positions))
        return dq.reshape(b, t, h, d), dk, dv
    dq, (dk, dv) = jax.lax.scan(step, dq0, _key_chunks(c, k, v, segments, positions))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1, hk, d)[:, :s]  # [n, b, c, hk, d] -> [b, s, hk, d]
    return dq.reshape(b, t, h, d), unchunk(dk), unchunk(dv)


register_backend(BlockBackend("reference", reference_block_fwd, reference_block_bwd,
                              supports=lambda mask, dtype, softcap=False: True))  # every mask, dtype, softcap
