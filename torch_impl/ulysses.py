"""Ulysses (DeepSpeed-Ulysses) attention: trade the sequence split for a head split.

Per rank of a Ulysses process group of size U:

    q: [b, t/U, h, d] --all-to-all--> [b, t, h/U, d] --attend--> o --all-to-all--> [b, t/U, h, d]

When kv_heads < U, each KV head is replicated U // kv_heads times first, so that every rank
receives exactly the KV head its query heads read. Gradients flow through the all-to-alls
(``comm._AllToAll`` is its own transpose) and through the replication (its transpose sums).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from .comm import axis_size, heads_to_seq, seq_to_heads
from .ring import ring_attention


def replicate_kv_heads(x, ulysses_size: int):
    """[b, s, hk, d] -> [b, s, max(hk, U), d]: repeat each KV head when hk < U (U % hk == 0)."""
    kv_heads = x.shape[2]
    if kv_heads >= ulysses_size:
        return x
    return x.repeat_interleave(ulysses_size // kv_heads, dim=2)


def ulysses_attention(q, k, v, group=None, *, causal: bool = False, scale: float | None = None,
                      block_backend: str = "auto", attend: Callable | None = None,
                      return_lse: bool = True):
    """Ulysses attention over process group ``group``. ``attend(q, k, v, *, causal, scale,
    block_backend)`` computes attention on the gathered sequence (default: one rank's attention;
    USP passes ring attention over the ring group). Returns ``(o, lse)``: o like q, lse
    [b, h, t/U] float32 (``None`` when ``return_lse`` is False: its all-to-all is skipped).
    """
    n = axis_size(group)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    attend = attend or partial(ring_attention, group=None, layout="contiguous")
    k, v = replicate_kv_heads(k, n), replicate_kv_heads(v, n)
    q_h, k_h, v_h = (seq_to_heads(x, group) for x in (q, k, v))  # [b, t, h/U, d]
    o_h, lse_h = attend(q_h, k_h, v_h, causal=causal, scale=scale, block_backend=block_backend)
    if not return_lse:  # skip the LSE all-to-all nobody reads (XLA drops it in JAX too)
        return heads_to_seq(o_h, group), None
    # lse_h: [b, h/U, t] -> [b, h, t/U]: split the sequence, gather the heads.
    lse = heads_to_seq(lse_h.transpose(1, 2).unsqueeze(-1), group)[..., 0]
    return heads_to_seq(o_h, group), lse.transpose(1, 2)
