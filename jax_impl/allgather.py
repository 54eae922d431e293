"""All-gather-KV attention (``kv_exchange="allgather"``: llama3-style context parallelism,
MaxText's default) as a ``jax.custom_vjp``, over the same ring axis, layouts and step plan as
ring attention.

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

from .axes import RING
from .block import get_backend
from .comm import axis_size, gather_shards, scatter_shard_sums
from .layouts import step_plan
from .ring import _visit, attention_with_vjp, grad_block, merge_block

F32 = jnp.float32


def allgather_attention(q, k, v, axis_name: str | None = RING, *, causal: bool = False, layout: str = "zigzag",
                        scale: float | None = None, block_backend: str = "auto"):
    """All-gather-KV attention over mesh axis ``axis_name`` (``None``: one device). Call inside
    ``shard_map``; inputs are this device's ring shard in layout order. Returns ``(o, lse)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _allgather(q, k, v, axis_name, causal, layout, scale, block_backend)


def _shard(x_all, src, t: int):
    """Ring shard ``src`` of a gathered [b, R·t, ...] array."""
    return lax.dynamic_slice_in_dim(x_all, src * t, t, axis=1)


def _steps(axis_name, n: int, t: int, kv_all, state, on_block, plan):
    """Visit steps 1..R-1 (shard (r - i) mod R) with ``on_block(block, kv, state)``."""
    r = lax.axis_index(axis_name)

    def body(st, step):
        src = (r - step) % n
        kv = tuple(_shard(x, src, t) for x in kv_all)
        return _visit(plan, step, axis_name, lambda blk, s: on_block(blk, kv, s, src), st), None

    state, _ = lax.scan(body, state, jnp.arange(1, n))
    return state


def _forward(q, k, v, axis_name, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    n = axis_size(axis_name)
    kv_all = (gather_shards(k, axis_name), gather_shards(v, axis_name)) if n > 1 else None
    o, lse = backend.fwd(q, k, v, plan.local.mask, scale)  # step 0: own K/V
    if n == 1:
        return o, lse, None
    o, lse = _steps(axis_name, n, k.shape[1], kv_all, (o, lse),
                    lambda blk, kv, st, src: merge_block(backend, scale, q, blk, kv, st), plan)
    return o, lse, kv_all


def _backward(q, k, v, o, lse, kv_all, do, dlse, axis_name, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    dq, dk, dv = backend.bwd(do, q, k, v, o, lse, plan.local.mask, scale, dlse)
    n = axis_size(axis_name)
    if n == 1:
        return dq, dk, dv
    t, r = k.shape[1], lax.axis_index(axis_name)
    dkv_all = tuple(lax.dynamic_update_slice_in_dim(jnp.zeros(x.shape, F32), g.astype(F32), r * t, axis=1)
                    for x, g in zip(kv_all, (dk, dv)))

    def on_block(blk, kv, st, src):
        dq, dk_all, dv_all = st
        dq, dk_s, dv_s = grad_block(backend, scale, (q, o, lse, do, dlse), blk, kv,
                                    (dq, _shard(dk_all, src, t), _shard(dv_all, src, t)))
        return (dq, lax.dynamic_update_slice_in_dim(dk_all, dk_s, src * t, axis=1),
                lax.dynamic_update_slice_in_dim(dv_all, dv_s, src * t, axis=1))

    dq, dk_all, dv_all = _steps(axis_name, n, t, kv_all, (dq, *dkv_all), on_block, plan)
    dk, dv = scatter_shard_sums(dk_all, axis_name), scatter_shard_sums(dv_all, axis_name)
    return dq, dk, dv


_allgather = attention_with_vjp(_forward, _backward)
