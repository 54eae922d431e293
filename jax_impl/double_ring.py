"""Double ring attention (LoongTrain) as a ``jax.custom_vjp``: one ring of R = O·I shards laid
over two mesh axes, an outer ring (``"ring_outer"``, O devices: across nodes) of inner rings
(``"ring_inner"``, I devices: inside a node).

Device (o, i) holds shard r = o·I + i of the combined ring, so every layout and the step plan of
ring attention apply unchanged; the visiting order is :func:`schedule.double_ring_schedule`:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward, round j = 0..O-1: the K/V that start round j on device (o, i) are shard
((o - j) mod O, i). They are first sent one hop on the outer ring — they start the next round
there, and the transfer has the whole round of inner compute to hide behind — then rotate I-1
times on the inner ring, each hop issued ahead of the block that uses the K/V in hand. R-1 K/V
hops in all: O·(I-1) inner, O-1 outer.

Backward: the same K/V schedule, with nothing saved from the forward (R-1 K/V hops). float32
dK/dV accumulators travel one hop behind their shard: an inner hop inside a round, and after
the round's last inner step a diagonal hop, (o, i) -> (o+1, i+1), which is where that shard
starts the next round — R hops in all, the last one bringing them home, as in the single ring.

The backward's K/V travel as raw bits (bitcast to same-width unsigned integers: free, same
bytes). Its hops outside loops would otherwise repeat the forward's exactly, and XLA merges
repeated collectives (CSE, through optimization barriers too), keeping the forward's received
shards alive until the backward: all-gather memory by accident, and not what torch_impl does.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from seqplan.axes import RING_INNER, RING_OUTER
from seqplan.schedule import double_ring_schedule
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import (
    attention_with_vjp,
    backward_visit,
    gather_segment_ids,
    gather_token_index,
    ring_index,
    walk,
    walk_forward,
)

DOUBLE_RING = (RING_OUTER, RING_INNER)


def double_ring_attention(q, k, v, axis_name: tuple[str, str] = DOUBLE_RING, *, causal: bool = False,
                          layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                          deterministic: bool | None = None, segment_ids=None, window=None, sinks=None,
                          softcap=None, token_index=None):
    """Double ring attention over the mesh axes ``axis_name = (outer, inner)``. Call inside
    ``shard_map``; inputs are this device's shard of the combined ring (index o·I + i) in
    layout order, ``segment_ids`` its ids [b, t/R] or None; ``window``, ``sinks``, ``softcap`` and
    ``token_index`` ([b, t/R] or None; gathered like the ids) as in ``ring_attention``. Returns
    ``(o, lse)``: o like q, lse float32 [b, h, t/R]."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    if len(tuple(axis_name)) != 2:
        raise ValueError(f"the double ring needs axis_name = (outer, inner), got {axis_name!r}")
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None)
    config.backend()  # an unknown or refused kernel fails here
    return _double_ring(q, k, v, segment_ids, token_index, sinks, tuple(axis_name), config)


def _schedule(axes, config: AttentionConfig):
    return double_ring_schedule(config.layout, config.schedule_causal, axis_size(axes[0]), axis_size(axes[1]))


def _to_bits(x):
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _from_bits(bits, like):
    return lax.bitcast_convert_type(bits, like.dtype)


def _forward(q, k, v, ids, index, axes, config: AttentionConfig):
    """(o, lse, (ids_all, index_all)): see ``loop.walk_forward`` (the double ring keeps no K/V for
    its backward)."""
    ids_all = gather_segment_ids(ids, axes, config.comm)
    index_all = gather_token_index(index, axes, config.comm)
    o, lse, _ = walk_forward(q, k, v, axes, config, _schedule(axes, config), ids_all, index_all)
    return o, lse, (ids_all, index_all)


def _backward(q, k, v, o, lse, extra, do, dlse, axes, config: AttentionConfig):
    schedule = _schedule(axes, config)
    ids_all, index_all = extra
    kv_of = lambda kv_bits, j, s: tuple(_from_bits(x, like) for x, like in zip(kv_bits, (k, v)))
    visit = backward_visit((q, o, lse, do, dlse), config, schedule, ring_index(axes), k.shape[1], ids_all, index_all,
                           own_kv=(k, v), kv_of=kv_of)

    def send_dkv(step, state):  # the visited shard's dK/dV follow it to its next holder
        if step.dkv_hop is None:
            return state
        dq, dk_acc, dv_acc = state
        return (dq, *config.comm.shift((dk_acc, dv_acc), step.dkv_hop, axes))

    # K/V travel as raw bits in the backward: see the module docstring.
    return walk(schedule, (_to_bits(k), _to_bits(v)), None, visit, comm=config.comm, axes=axes, after_step=send_dkv)


_double_ring = attention_with_vjp(_forward, _backward)
