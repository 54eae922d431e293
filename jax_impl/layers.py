"""A drop-in sequence-parallel attention layer (flax linen): q/k/v/o projections, RoPE by each
token's *original* position, GQA, and ringbridge's attention over a named mesh.

    x: [b, t, D]   positions, token_index: [b, t] ints   segment_ids: [b, t] or None   ->   [b, t, D]

Three ways to call it (the fields ``mesh`` and ``per_device``):
- ``mesh`` given, ``per_device=False``: global arrays in layout order, any sharding — the layer
  calls ``sequence_parallel_attention`` (which shards them over the mesh itself);
- ``mesh`` given, ``per_device=True``: inside ``jax.shard_map`` over ``mesh``, every argument is
  this device's shard [b/D, t/(R·U), ...] — the layer calls ``local_attention`` (torch_impl's
  layer always works this way);
- ``mesh=None``: the plain non-parallel layer on the whole sequence in original order
  (``dense_attention``, or ``attention`` when given).
The positions are the tokens' original positions (a packed document's restart at its start), so
RoPE — and the model — never see the layout. flax is imported here and nowhere else in jax_impl.
The mirror is ``torch_impl/layers.py``: same names, same parameters, same steps.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqplan.config import AttentionLayerConfig

from .api import local_attention, sequence_parallel_attention
from .dense import dense_attention

# The name scope of the attention itself (after the projections and RoPE, before wo): the
# step-time model's HLO count (parity.accounting.hlo_cost) tells its kernels apart by it.
CORE_SCOPE = "core_attention"


def apply_rope(x, positions, theta: float):
    """x: [b, t, h, d] rotated by ``positions`` [b, t] (rotate-half: pairs (i, i + d/2) turn by
    position · theta^(-2i/d)); computed in float32 (float64 for float64 x), returned in x's dtype."""
    d = x.shape[-1]
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    inv_freq = theta ** -(jnp.arange(0, d, 2, dtype=dtype) / d)
    angles = positions.astype(dtype)[..., None] * inv_freq[None, None, :]  # [b, t, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [b, t, 1, d]
    wide = x.astype(dtype)
    rotated = jnp.concatenate([-wide[..., d // 2:], wide[..., : d // 2]], axis=-1)
    return (wide * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class SequenceParallelAttention(nn.Module):
    """Attention with parameters ``wq`` [D, H·d], ``wk``, ``wv`` [D, Hk·d], ``wo`` [H·d, D] (math
    orientation, y = x @ W) and, with ``config.sinks``, ``sinks`` [H]; computes in x's dtype.

    mesh:       the jax Mesh (its axis names choose the algorithm), or None.
    per_device: inside ``jax.shard_map`` over ``mesh`` on this device's shards (module docstring).
    attention:  with ``mesh=None``, a callable ``(q, k, v, *, causal, segment_ids, window, sinks) -> o``
                used instead of the dense path (e.g. a strategy's replay on one GPU)."""

    config: AttentionLayerConfig
    mesh: jax.sharding.Mesh | None = None
    per_device: bool = False
    attention: Callable | None = None
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, token_index=None):
        """``positions``: RoPE positions (restarting at each packed document); ``token_index``: with a
        mesh, each token's original index when the layout is per row (the per-document zigzag:
        ``seqplan.layouts.document_layout``) — it drives the causal mask and the window, as in
        ``sequence_parallel_attention``; None: the static ``config.layout``'s."""
        c = self.config
        if token_index is not None and self.mesh is None:
            raise ValueError("token_index needs a mesh: without one the layer attends over the whole "
                             "sequence in original order")
        b, t, _ = x.shape
        init = nn.initializers.lecun_normal()
        wq = self.param("wq", init, (c.d_model, c.heads * c.head_dim), self.param_dtype)
        wk = self.param("wk", init, (c.d_model, c.kv_heads * c.head_dim), self.param_dtype)
        wv = self.param("wv", init, (c.d_model, c.kv_heads * c.head_dim), self.param_dtype)
        wo = self.param("wo", init, (c.heads * c.head_dim, c.d_model), self.param_dtype)
        sinks = self.param("sinks", nn.initializers.zeros, (c.heads,), self.param_dtype) if c.sinks else None
        q = apply_rope((x @ wq.astype(x.dtype)).reshape(b, t, c.heads, c.head_dim), positions, c.rope_theta)
        k = apply_rope((x @ wk.astype(x.dtype)).reshape(b, t, c.kv_heads, c.head_dim), positions, c.rope_theta)
        v = (x @ wv.astype(x.dtype)).reshape(b, t, c.kv_heads, c.head_dim)
        options = {"causal": c.causal, "segment_ids": segment_ids, "window": c.window, "sinks": sinks}
        with jax.named_scope(CORE_SCOPE):  # names the attention's own kernels in the compiled program
            if self.mesh is not None:
                attend = local_attention if self.per_device else sequence_parallel_attention
                o = attend(q, k, v, self.mesh, layout=c.layout, kv_exchange=c.kv_exchange,
                           block_backend=c.block_backend, token_index=token_index,
                           shared_tokens=c.shared_tokens, **options)
            elif self.attention is not None:
                o = self.attention(q, k, v, **options)
            else:
                o, _ = dense_attention(q, k, v, **options)
        return o.reshape(b, t, c.heads * c.head_dim) @ wo.astype(x.dtype)
