"""Double ring attention (LoongTrain) as a ``torch.autograd.Function``: one ring of R = O·I
shards laid over two process groups, an outer ring (O ranks: across nodes) of inner rings
(I ranks: inside a node).

Rank (o, i) holds shard r = o·I + i of the combined ring, so every layout and the step plan of
ring attention apply unchanged; the visiting order is :func:`schedule.double_ring_schedule`:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    segment_ids: [b, t/R] or None    sinks: [h] or None
                                                  ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward, round j = 0..O-1: the K/V that start round j on rank (o, i) are shard
((o - j) mod O, i). They are first sent one hop on the outer ring — they start the next round
there, and the transfer has the whole round of inner compute to hide behind — then rotate I-1
times on the inner ring, each hop started ahead of the block that uses the K/V in hand. R-1 K/V
hops in all: O·(I-1) inner, O-1 outer. Receive buffers are allocated once (two per ring).

Backward: the same K/V schedule (nothing saved from the forward: R-1 hops). float32 dK/dV
accumulators travel one hop behind their shard: an inner hop inside a round, and after the
round's last inner step a diagonal hop, (o, i) -> (o+1, i+1), which is where that shard starts
the next round — R hops in all, the last one bringing them home, as in the single ring.
Same schedule as jax_impl, step for step.
"""

from __future__ import annotations

from seqplan.schedule import double_ring_schedule
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import attention_with_vjp, walk_backward, walk_forward


def double_ring_attention(q, k, v, group=None, *, segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                          causal: bool = False, layout: str = "zigzag",
                          scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None):
    """Double ring attention over ``group = (outer_group, inner_group)`` (``None``: one rank).
    Inputs are this rank's shard of the combined ring (index o·I + i) in layout order;
    ``segment_ids`` (packed documents) this rank's local shard of the ids, [b, t/R] (see
    ``ring_attention``; gathered over the inner, then the outer group, so shard o·I + i lands at
    index o·I + i); ``window``, ``sinks``, ``softcap`` and ``token_index`` ([b, t/R] or None;
    gathered like the ids) as in ``ring_attention`` (``sinks.grad``: this rank's contribution).
    Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R].
    Differentiable through autograd."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    groups = tuple(group) if group is not None else (None, None)
    if len(groups) != 2:
        raise ValueError(f"the double ring needs group = (outer_group, inner_group), got {group!r}")
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None)
    config.backend()  # an unknown or refused kernel fails here, before any collective
    return _double_ring(q, k, v, groups, config, segment_ids, sinks, token_index)


def _schedule(groups, config: AttentionConfig):
    return double_ring_schedule(config.layout, config.schedule_causal, axis_size(groups[0]), axis_size(groups[1]))


def _forward(q, k, v, groups, config: AttentionConfig, masks):
    """(o, lse, kv_first): see ``loop.walk_forward``."""
    return walk_forward(q, k, v, groups, config, _schedule(groups, config), masks)


def _backward(q, k, v, o, lse, kv_first, do, dlse, groups, config: AttentionConfig, masks):
    return walk_backward(q, k, v, o, lse, kv_first, do, dlse, groups, config, _schedule(groups, config), masks)


_double_ring = attention_with_vjp(_forward, _backward)
