"""The portable block kernels (backend ``"reference"``): einsum with float32 accumulation at
full precision, any device, any dtype. The default on CPU and for float32, and the fallback of
the fused kernels' backward when a caller passes an lse cotangent.

Shapes: q, do, o [b, t, h, d]; k, v [b, s, hk, d]; lse, dlse [b, h, t] float32; with a
document mask, ``segments = (q_ids [b, t], kv_ids [b, s])``; with a window,
``positions = (q_pos [t], kv_pos [s])`` (int32 original token positions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqplan.schedule import BlockMask, MaskKind

from ..block import BlockBackend, register_backend

F32 = jnp.float32
# f32 matmuls at full precision: on GPUs XLA's default may use TF32, which breaks the 1e-5 policy.
_PRECISION = jax.lax.Precision.HIGHEST


def mask_matrix(mask: BlockMask, t: int, s: int, segments=None, positions=None):
    """Visible (query, key) pairs in local indices, broadcastable to scores [b, hk, g, t, s]:
    [t, s] bool, [b, 1, 1, t, s] with documents, or None when every pair is visible."""
    if mask.documents != (segments is not None):
        raise ValueError(f"segments must be given exactly when the mask has documents (mask {mask}, "
                         f"segments {'given' if segments is not None else 'None'})")
    if (mask.window is not None) != (positions is not None):
        raise ValueError(f"positions must be given exactly when the mask has a window (mask {mask}, "
                         f"positions {'given' if positions is not None else 'None'})")
    visible = None
    if mask.kind is not MaskKind.FULL:
        if t != s:
            raise ValueError(f"a {mask.kind.value} mask needs a square block, got {t}x{s}")
        visible = jnp.tril(jnp.ones((t, s), dtype=bool), k=0 if mask.kind is MaskKind.CAUSAL else -1)
    if positions is not None:
        (left, right), (q_pos, kv_pos) = mask.window, positions
        q_pos, kv_pos = q_pos[:, None], kv_pos[None, :]
        near = (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)  # [t, s]
        visible = near if visible is None else visible & near
    if segments is not None:
        q_ids, kv_ids = segments
        same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]  # [b, 1, 1, t, s]
        visible = same if visible is None else same & visible[None, None, None]
    return visible


def _scores(q, k, scale):
    """q: [b, t, h, d], k: [b, s, hk, d] -> scores [b, hk, g, t, s] float32 (g = h // hk)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, t, hk, h // hk, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32, precision=_PRECISION)
    return s * jnp.asarray(scale, F32)


def reference_block_fwd(q, k, v, mask: BlockMask, scale: float, segments=None, positions=None):
    """Portable forward. A query row with no visible key gets o = 0 and lse = -inf (stripe's
    strict mask on row 0, a query whose document or window has no key in the block), which the
    LSE merge treats as an empty partial."""
    b, t, h, d = q.shape
    s = _scores(q, k, scale)
    visible = mask_matrix(mask, t, k.shape[1], segments, positions)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(s - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    has_key = denom > 0
    lse = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, denom, 1.0)), -jnp.inf)
    p = p / jnp.where(has_key, denom, 1.0)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32), precision=_PRECISION)
    return o.reshape(b, t, h, d), lse[..., 0].reshape(b, h, t)


def reference_block_bwd(do, q, k, v, o, lse, mask: BlockMask, scale: float, dlse=None, segments=None,
                        positions=None):
    """Portable backward with the global ``o`` and ``lse``:
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse), dQ = scale·dS K, dK = scale·dSᵀ Q, dV = Pᵀ dO."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    s = _scores(q, k, scale)
    lse_g = lse.reshape(b, hk, g, t)[..., None]
    p = jnp.exp(s - lse_g)
    visible = mask_matrix(mask, t, k.shape[1], segments, positions)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    do_g = do.astype(F32).reshape(b, t, hk, g, d)
    delta = jnp.einsum("btkgd,btkgd->bkgt", do_g, o.astype(F32).reshape(b, t, hk, g, d), precision=_PRECISION)
    if dlse is not None:
        delta = delta - dlse.astype(F32).reshape(b, hk, g, t)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do_g, precision=_PRECISION)
    dp = jnp.einsum("btkgd,bskd->bkgts", do_g, v.astype(F32), precision=_PRECISION)
    ds = p * (dp - delta[..., None]) * jnp.asarray(scale, F32)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(F32), precision=_PRECISION).reshape(b, t, h, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(F32).reshape(b, t, hk, g, d), precision=_PRECISION)
    return dq, dk, dv


register_backend(BlockBackend("reference", reference_block_fwd, reference_block_bwd))
