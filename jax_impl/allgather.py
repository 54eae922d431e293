"""All-gather-KV attention (``kv_exchange="allgather"``: llama3-style context parallelism,
MaxText's default) as a ``jax.custom_vjp``, over the same ring axis, layouts and visiting order
as ring attention (:func:`schedule.allgather_schedule`).

Per device, inside ``shard_map`` over a ring axis of size R, device r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward: one ``all_gather`` of K and of V ([b, t, hk, d] each, ring-shard order), then the
blocks of the step plan against each shard in turn (step i visits shard (r - i) mod R, as the
ring does), merged by LSE. Backward: float32 dK/dV for the whole gathered sequence, one
``psum_scatter`` (reduce-scatter) of each brings every shard's sum home. Memory: the gathered
K/V (R shards) are kept for the backward — the price of no transfer in the loop; the ring keeps
one shard in flight instead but needs R-1 dependent hops.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from seqplan.axes import RING
from seqplan.schedule import allgather_schedule
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import (
    alone_dtype,
    attention_with_vjp,
    gather_segment_ids,
    gather_token_index,
    grad_block,
    local_backward,
    local_forward,
    merge_block,
    ring_index,
    visit_block,
    visit_masks,
    walk,
)

F32 = jnp.float32


def allgather_attention(q, k, v, axis_name: str | None = RING, *, causal: bool = False, layout: str = "zigzag",
                        scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None,
                        segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """All-gather-KV attention over mesh axis ``axis_name`` (``None``: one device). Call inside
    ``shard_map``; inputs are this device's ring shard in layout order, ``segment_ids`` its ids
    [b, t/R] or None; ``window``, ``sinks``, ``softcap`` and ``token_index`` ([b, t/R] or None) as in
    ``ring_attention``. Returns ``(o, lse)``."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None)
    config.backend()  # an unknown or refused kernel fails here
    return _allgather(q, k, v, segment_ids, token_index, sinks, axis_name, config)


def _shard(x_all, src, t: int):
    """Ring shard ``src`` of a gathered [b, R·t, ...] array."""
    return lax.dynamic_slice_in_dim(x_all, src * t, t, axis=1)


def _schedule(axis_name, config: AttentionConfig):
    return allgather_schedule(config.layout, config.causal, axis_size(axis_name))


def _forward(q, k, v, ids, index, axis_name, config: AttentionConfig):
    backend, schedule, me = config.backend(), _schedule(axis_name, config), ring_index(axis_name)
    t = k.shape[1]
    kv_all = tuple(config.comm.gather(x, axis_name) for x in (k, v)) if schedule.size > 1 else None
    ids_all = gather_segment_ids(ids, axis_name, config.comm)
    index_all = gather_token_index(index, axis_name, config.comm)

    def visit(step, j, s, _, state):
        masks = visit_masks(schedule, config, ids_all, me, j, s, t, index_all)
        if step.local:  # own K/V
            return local_forward(backend, config.scale, q, (k, v), schedule.plan.local.mask,
                                 out_dtype=alone_dtype(schedule, q.dtype), **masks)
        kv = tuple(_shard(x, schedule.source(me, j, s), t) for x in kv_all)
        return visit_block(schedule, me, j, s,
                           lambda blk, st: merge_block(backend, config.scale, q, blk, kv, st, **masks), state)

    o, lse = walk(schedule, None, None, visit, comm=config.comm, axes=axis_name)
    return o, lse, (kv_all, ids_all, index_all)


def _backward(q, k, v, o, lse, extra, do, dlse, axis_name, config: AttentionConfig):
    backend, schedule, me = config.backend(), _schedule(axis_name, config), ring_index(axis_name)
    (kv_all, ids_all, index_all), t, saved = extra, k.shape[1], (q, o, lse, do, dlse)

    def visit(step, j, s, _, state):
        masks = visit_masks(schedule, config, ids_all, me, j, s, t, index_all)
        if step.local:
            dq, dk, dv = local_backward(backend, config.scale, saved, (k, v), schedule.plan.local.mask,
                                        dq_dtype=alone_dtype(schedule, q.dtype), **masks)
            if schedule.size == 1:
                return dq, dk, dv
            return (dq, *(lax.dynamic_update_slice_in_dim(jnp.zeros(x.shape, F32), g.astype(F32), me * t, axis=1)
                          for x, g in zip(kv_all, (dk, dv))))
        src = schedule.source(me, j, s)
        kv = tuple(_shard(x, src, t) for x in kv_all)

        def on_block(blk, st):
            dq, dk_all, dv_all = st
            dq, dk_s, dv_s = grad_block(backend, config.scale, saved, blk, kv,
                                        (dq, _shard(dk_all, src, t), _shard(dv_all, src, t)), **masks)
            return (dq, lax.dynamic_update_slice_in_dim(dk_all, dk_s, src * t, axis=1),
                    lax.dynamic_update_slice_in_dim(dv_all, dv_s, src * t, axis=1))

        return visit_block(schedule, me, j, s, on_block, state)

    dq, dk_all, dv_all = walk(schedule, None, None, visit, comm=config.comm, axes=axis_name)
    if schedule.size == 1:
        return dq, dk_all, dv_all
    return dq, config.comm.scatter(dk_all, axis_name), config.comm.scatter(dv_all, axis_name)


_allgather = attention_with_vjp(_forward, _backward)
