"""A drop-in sequence-parallel attention layer (``torch.nn``): q/k/v/o projections, RoPE by each
token's *original* position, GQA, and ringbridge's attention over a ``DeviceMesh``.

    x: [b, t/(R·U), D]   positions, token_index: [b, t/(R·U)] ints   segment_ids: [b, t/(R·U)] or None
        ->   [b, t/(R·U), D]

With a mesh every argument is this rank's local shard in layout order (as
``torch_impl.sequence_parallel_attention`` takes them); the positions are the tokens' original
positions (a packed document's positions restart at its start), so RoPE — and therefore the model —
never sees the layout. With ``mesh=None`` the layer is the plain non-parallel layer on the whole
sequence in original order (``dense_attention``), or runs ``attention`` when one is given.
The mirror is ``jax_impl/layers.py`` (flax), same names, same parameters, same steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from seqplan.config import AttentionLayerConfig

from .api import sequence_parallel_attention
from .dense import dense_attention

# The name of the attention itself (after the projections and RoPE, before wo) in a profile; the
# JAX mirror names the same region of its compiled program.
CORE_SCOPE = "core_attention"


def apply_rope(x, positions, theta: float):
    """x: [b, t, h, d] rotated by ``positions`` [b, t] (rotate-half: pairs (i, i + d/2) turn by
    position · theta^(-2i/d)); computed in float32 (float64 for float64 x), returned in x's dtype."""
    d = x.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** -(torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)
    angles = positions.to(dtype)[..., None] * inv_freq  # [b, t, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # [b, t, 1, d]
    wide = x.to(dtype)
    rotated = torch.cat([-wide[..., d // 2:], wide[..., : d // 2]], dim=-1)
    return (wide * angles.cos() + rotated * angles.sin()).to(x.dtype)


class SequenceParallelAttention(nn.Module):
    """Attention with projections ``wq`` [H·d ← D], ``wk``, ``wv`` [Hk·d ← D], ``wo`` [D ← H·d]
    (``nn.Linear`` without bias: weight = Wᵀ of the math orientation) and, with ``config.sinks``,
    the parameter ``sinks`` [H].

    mesh:      the attention ``DeviceMesh`` (its dimension names choose the algorithm), or None.
    attention: with ``mesh=None``, a callable ``(q, k, v, *, causal, segment_ids, window, sinks) -> o``
               to use instead of the dense path (e.g. a strategy's replay on one GPU)."""

    def __init__(self, config: AttentionLayerConfig, mesh=None, *, attention: Callable | None = None,
                 device=None, dtype=None):
        super().__init__()
        c = self.config = config
        self.mesh, self.attention = mesh, attention
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.wq = nn.Linear(c.d_model, c.heads * c.head_dim, **kw)
        self.wk = nn.Linear(c.d_model, c.kv_heads * c.head_dim, **kw)
        self.wv = nn.Linear(c.d_model, c.kv_heads * c.head_dim, **kw)
        self.wo = nn.Linear(c.heads * c.head_dim, c.d_model, **kw)
        self.sinks = nn.Parameter(torch.zeros(c.heads, device=device, dtype=dtype)) if c.sinks else None

    def forward(self, x, positions, segment_ids=None, token_index=None):
        """``positions``: RoPE positions (restarting at each packed document); ``token_index``: with a
        mesh, each token's original index when the layout is per row (the per-document zigzag:
        ``seqplan.layouts.document_layout``) — it drives the causal mask and the window, as in
        ``sequence_parallel_attention``; None: the static ``config.layout``'s."""
        c = self.config
        if token_index is not None and self.mesh is None:
            raise ValueError("token_index needs a mesh: without one the layer attends over the whole "
                             "sequence in original order")
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, c.heads, c.head_dim), positions, c.rope_theta)
        k = apply_rope(self.wk(x).view(b, t, c.kv_heads, c.head_dim), positions, c.rope_theta)
        v = self.wv(x).view(b, t, c.kv_heads, c.head_dim)
        options = {"causal": c.causal, "segment_ids": segment_ids, "window": c.window, "sinks": self.sinks}
        with torch.profiler.record_function(CORE_SCOPE):  # names the attention's own kernels in a profile
            if self.mesh is not None:
                o = sequence_parallel_attention(q, k, v, self.mesh, layout=c.layout, kv_exchange=c.kv_exchange,
                                                block_backend=c.block_backend, token_index=token_index,
                                                shared_tokens=c.shared_tokens, **options)
            elif self.attention is not None:
                o = self.attention(q, k, v, **options)
            else:
                o, _ = dense_attention(q, k, v, **options)
        return self.wo(o.reshape(b, t, c.heads * c.head_dim))
