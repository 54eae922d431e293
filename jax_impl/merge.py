"""The stable LSE merge of two attention partials, written once for every algorithm."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_partials(o, lse, o_b, lse_b):
    """Fold partial ``(o_b, lse_b)`` into ``(o, lse)``, in float32.

        o   ← o − σ(lse_b − lse)·(o − o_b)
        lse ← lse − log σ(lse − lse_b)

    o, o_b: [b, t, h, d]; lse, lse_b: [b, h, t]. An empty partial (lse_b = −inf) leaves (o, lse)
    unchanged; (o, lse) itself must be non-empty (the local diagonal block always is).
    """
    o, o_b = o.astype(jnp.float32), o_b.astype(jnp.float32)
    lse, lse_b = lse.astype(jnp.float32), lse_b.astype(jnp.float32)
    weight = jax.nn.sigmoid(lse_b - lse)  # [b, h, t]
    o = o - jnp.swapaxes(weight, 1, 2)[..., None] * (o - o_b)
    lse = lse - jax.nn.log_sigmoid(lse - lse_b)
    return o, lse
