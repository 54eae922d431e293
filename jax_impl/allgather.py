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

import dataclasses

import jax.numpy as jnp
from jax import lax

import seqplan.registry
from seqplan.axes import RING
from seqplan.layouts import ring_positions
from seqplan.schedule import allgather_schedule
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .block import device_kind_of, resolve_backend
from .comm import axis_size
from .config import AttentionConfig, make_config
from .kernels.fa3_varlen import varlen_bwd, varlen_fwd
from .kernels.runs import VarlenRuns, prefix_dispatch
from .kernels.runs import prefix_plans as prefix_plans_of
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


def prefix_eligible(config: AttentionConfig, q, documents: bool) -> bool:
    """Whether the call may run as one varlen call per device (module docstring): static, its
    document blocks resolving to ``fa3_varlen`` on ``q``'s device kind and dtype
    (``seqplan.registry.prefix_eligible``)."""
    return seqplan.registry.prefix_eligible(config, documents, device_kind=device_kind_of(q), dtype=q.dtype,
                                            resolve_backend=resolve_backend, one_call_backends=("fa3_varlen",))


def _positions(config: AttentionConfig, index_all, b: int, ring: int, t: int):
    """Every token's index [b, R·t]: the call's token indices, or the static layout's positions."""
    if index_all is not None:
        return index_all.astype(jnp.int32)
    return jnp.broadcast_to(jnp.asarray(ring_positions(config.layout, ring, t).reshape(-1)), (b, ring * t))


def prefix_plan(config: AttentionConfig, q, ids_all, index_all, me) -> list[VarlenRuns]:
    """Device ``me``'s one-call plan — one per static run-slot count (``kernels/runs.prefix_plans``),
    the device picks among them — of its queries ``q`` [b, t, ...]
    against every key, from every shard's ids and token indices [b, R·t] (ids None: one document
    per row; token indices None: the static layout's positions — one of the two is given)."""
    b, t = q.shape[:2]
    ring = (ids_all if ids_all is not None else index_all).shape[1] // t
    positions = _positions(config, index_all, b, ring, t)
    mine = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, me * t, t, axis=1)
    return prefix_plans_of(mine(ids_all), ids_all, mine(positions), positions)


def prefix_forward(config: AttentionConfig, q, kv_all, plans, fallback):
    """The device's (o, lse) as ONE varlen call against its gathered key prefixes (``plans``:
    :func:`prefix_plan`), or ``fallback()`` where the runs do not fit (module docstring).
    ``kv_all``: (k, v) [b, R·t, hk, d] in layout order."""
    return prefix_dispatch(plans, lambda runs: varlen_fwd(q, *kv_all, True, config.scale, runs), fallback,
                           keys=kv_all[0].shape[1])


def prefix_backward(config: AttentionConfig, saved, kv_all, plans, fallback):
    """The backward of :func:`prefix_forward` given ``saved = (q, o, lse, do)`` (the GLOBAL o, lse):
    (dq, dk, dv) with dk, dv float32 [b, R·t, hk, d] — every key's gradient from this device's rows."""
    q, o, lse, do = saved
    kernel = lambda runs: varlen_bwd(do, q, *kv_all, o, lse, True, config.scale, runs)
    return prefix_dispatch(plans, kernel, fallback, keys=kv_all[0].shape[1], lengths=True)


def portable_config(config: AttentionConfig) -> AttentionConfig:
    """The one call's fallback walks the blocks on the portable kernel (module docstring)."""
    return dataclasses.replace(config, block_backend="reference")


def _forward(q, k, v, ids, index, axis_name, config: AttentionConfig):
    schedule = _schedule(axis_name, config)
    kv_all = tuple(config.comm.gather(x, axis_name) for x in (k, v)) if schedule.size > 1 else None
    ids_all = gather_segment_ids(ids, axis_name, config.comm)
    index_all = gather_token_index(index, axis_name, config.comm)
    walk_blocks = lambda cfg: _walk_forward(q, k, v, kv_all, ids_all, index_all, axis_name, cfg)
    plans = None
    if schedule.size > 1 and prefix_eligible(config, q, ids_all is not None):
        plans = prefix_plan(config, q, ids_all, index_all, ring_index(axis_name))  # kept for the backward
        o, lse = prefix_forward(config, q, kv_all, plans, lambda: walk_blocks(portable_config(config)))
    else:
        o, lse = walk_blocks(config)
    return o, lse, (kv_all, ids_all, index_all, plans)


def _walk_forward(q, k, v, kv_all, ids_all, index_all, axis_name, config: AttentionConfig):
    """(o, lse) of this device's blocks against every gathered shard, merged by LSE."""
    backend, schedule, me = config.backend(), _schedule(axis_name, config), ring_index(axis_name)
    t = k.shape[1]

    def visit(step, j, s, _, state):
        masks = visit_masks(schedule, config, ids_all, me, j, s, t, index_all)
        if step.local:  # own K/V
            return local_forward(backend, config.scale, q, (k, v), schedule.plan.local.mask,
                                 out_dtype=alone_dtype(schedule, q.dtype), **masks)
        kv = tuple(_shard(x, schedule.source(me, j, s), t) for x in kv_all)
        return visit_block(schedule, me, j, s,
                           lambda blk, st: merge_block(backend, config.scale, q, blk, kv, st, **masks), state)

    return walk(schedule, None, None, visit, comm=config.comm, axes=axis_name)


def _backward(q, k, v, o, lse, extra, do, dlse, axis_name, config: AttentionConfig):
    schedule, kv_all, plans = _schedule(axis_name, config), extra[0], extra[3]
    walk_blocks = lambda cfg: _walk_backward(q, k, v, o, lse, extra[:3], do, dlse, axis_name, cfg)
    if plans is not None and dlse is None:
        dq, dk_all, dv_all = prefix_backward(config, (q, o, lse, do), kv_all, plans,
                                             lambda: walk_blocks(portable_config(config)))
    else:
        dq, dk_all, dv_all = walk_blocks(config)
    if schedule.size == 1:
        return dq, dk_all, dv_all
    return dq, config.comm.scatter(dk_all, axis_name), config.comm.scatter(dv_all, axis_name)


def _walk_backward(q, k, v, o, lse, extra, do, dlse, axis_name, config: AttentionConfig):
    """(dq, dk, dv) of this device's blocks: dk, dv float32 [b, R·t, hk, d] (one shard's own when R = 1)."""
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

    return walk(schedule, None, None, visit, comm=config.comm, axes=axis_name)


_allgather = attention_with_vjp(_forward, _backward)
