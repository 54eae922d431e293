"""The stable LSE merge of two attention partials, written once for every algorithm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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


@jax.tree_util.register_pytree_node_class
class Float32Rows:
    """An accumulator kept as its first block's kernel wrote it (``base`` [b, t, ...], rows on axis
    1) with float32 rows [lo, lo + n) (``wide``) where later blocks merge or add — torch's
    ``Float32Rows`` (the same :meth:`rows`, :meth:`full`, :meth:`result`), with its float32 rows
    fixed when the program is traced (a scan carry's shape) and written by :meth:`put`.

    The loops use it where one visited block at most meets each row (the window ring's halo
    schedule: its block touches the first ``halo`` queries and the last ``halo`` keys): widening the
    whole shard for that block costs a convert in and out of every accumulator. Exact there: rows
    outside [lo, lo + n) are read widened and written back in the base's dtype (:meth:`put`), which
    for a single block is what the final cast gave; the rows inside stay float32 until
    :meth:`result`."""

    def __init__(self, base, wide, lo: int):
        self.base, self.wide, self.lo = base, wide, lo

    @classmethod
    def widen(cls, x, lo: int, hi: int, dtype) -> Float32Rows:
        """A kernel's output ``x``: rows [lo, hi) in float32 as it computed them, the rest in ``dtype``."""
        return cls(x.astype(dtype), lax.slice_in_dim(x, lo, hi, axis=1).astype(jnp.float32), lo)

    def tree_flatten(self):
        return (self.base, self.wide), self.lo

    @classmethod
    def tree_unflatten(cls, lo, children):
        return cls(*children, lo)

    @property
    def hi(self) -> int:
        return self.lo + self.wide.shape[1]

    def rows(self, which):
        """Rows ``which.bounds(t)`` (a ``Part`` or ``Span``) in float32."""
        a, b = which.bounds(self.base.shape[1])
        if self.lo <= a and b <= self.hi:
            return lax.slice_in_dim(self.wide, a - self.lo, b - self.lo, axis=1)
        return lax.slice_in_dim(self.full(), a, b, axis=1)

    def put(self, which, value) -> Float32Rows:
        """These rows set to ``value`` (float32): inside [lo, hi) kept in float32, outside in the base's dtype."""
        a, b = which.bounds(self.base.shape[1])
        base = self.base
        if a < self.lo or b > self.hi:
            base = lax.dynamic_update_slice_in_dim(base, value.astype(base.dtype), a, axis=1)
        i0, i1 = max(a, self.lo), min(b, self.hi)
        wide = self.wide
        if i0 < i1:
            wide = lax.dynamic_update_slice_in_dim(wide, lax.slice_in_dim(value, i0 - a, i1 - a, axis=1), i0 - self.lo,
                                                   axis=1)
        return Float32Rows(base, wide, self.lo)

    def full(self):
        """Every row in float32 (:meth:`rows`' read of rows outside the float32 ones)."""
        return lax.dynamic_update_slice_in_dim(self.base.astype(jnp.float32), self.wide, self.lo, axis=1)

    def result(self, dtype):
        """The accumulated array in ``dtype``: the float32 rows cast once, the others as the kernel wrote them."""
        return lax.dynamic_update_slice_in_dim(self.base.astype(dtype), self.wide.astype(dtype), self.lo, axis=1)
