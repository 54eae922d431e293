"""The machinery ring, all-gather-KV and double-ring attention share: walking a
:class:`schedule.Schedule` inside ``shard_map``, one block's forward merge and backward
gradients, and the ``custom_vjp`` that joins a forward and a backward.

Shapes (per device): q, o, dq [b, t, h, d]; k, v, dk, dv [b, t, hk, d]; lse [b, h, t] float32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .comm import Comm, axis_size
from .config import AttentionConfig
from .merge import merge_partials
from .schedule import Block, Part, Schedule, Step, runs


def ring_index(axes):
    """This device's index on the ring over ``axes`` (an axis name, ``(outer, inner)`` — o·I + i
    — or ``None``: 0). Traced."""
    if axes is None:
        return 0
    if isinstance(axes, tuple):
        return lax.axis_index(axes[0]) * axis_size(axes[1]) + lax.axis_index(axes[1])
    return lax.axis_index(axes)


def _repeat(body: Callable, carry: tuple, positions: range) -> tuple:
    """``carry = body(*carry, p)`` for p in ``positions``: inline for one, else one ``lax.scan``."""
    if len(positions) == 1:
        return body(*carry, positions.start)
    carry, _ = lax.scan(lambda c, p: (body(*c, p), None), carry, jnp.arange(positions.start, positions.stop))
    return carry


def walk(schedule: Schedule, kv, state, visit: Callable, *, comm: Comm, axes, after_step: Callable | None = None,
         kv_first=None):
    """Run every step of ``schedule`` on this device, K/V moving as it says, and return ``state``.

    ``visit(step, j, s, kv, state) -> state`` computes step (j, s) against the K/V in hand;
    ``step`` gives the static kind (``step.local``: the first), ``j`` and ``s`` may be traced.
    Hops go through ``comm.shift(tree, hop, axes)``; ``after_step(step, state) -> state`` follows every step
    (the backward sends the visited shard's dK/dV by ``step.dkv_hop``). ``kv_first``: the K/V of
    step 1, already received (the single ring's backward), so the first hop is not sent again.
    Consecutive steps (and rounds) of one kind run as one ``lax.scan`` whose body is traced
    once, so the program's size does not grow with the ring's."""

    def shift(hop, tree):
        return comm.shift(tree, hop, axes)

    def one_step(step: Step, j, kv, state, s):
        if step.local and kv_first is not None:
            kv_next = kv_first
        else:
            kv_next = shift(step.kv_hop, kv) if step.kv_hop is not None else None  # overlaps the compute
        state = visit(step, j, s, kv, state)
        if after_step is not None:
            state = after_step(step, state)
        return kv_next, state

    def one_round(rnd, kv_round, state, j):
        kv_next_round = shift(rnd.kv_hop, kv_round) if rnd.kv_hop is not None else None  # hidden by the round
        kv = kv_round
        for step, positions in runs(rnd.steps):
            kv, state = _repeat(partial(one_step, step, j), (kv, state), positions)
        return kv_next_round, state

    for rnd, positions in runs(schedule.rounds):
        kv, state = _repeat(partial(one_round, rnd), (kv, state), positions)
    return state


def visit_block(schedule: Schedule, device, j, s, on_block: Callable, state):
    """``on_block(block, state)`` for the block ``device`` computes at (j, s) — not the local
    step. Whether the source shard is earlier than ``device``'s is the only per-device choice,
    taken with ``lax.cond`` on a traced bool (a skipped block costs nothing)."""
    plan = schedule.plan

    def branch(block: Block | None):
        return (lambda st: st) if block is None else (lambda st: on_block(block, st))

    if plan.uniform:
        return branch(plan.from_earlier)(state)
    return lax.cond(schedule.is_earlier(device, j, s), branch(plan.from_earlier), branch(plan.from_later), state)


def _part(x, which: Part, axis: int):
    """``x[which]`` along ``axis`` (static bounds)."""
    lo, hi = which.bounds(x.shape[axis])
    return x if which is Part.ALL else lax.slice_in_dim(x, lo, hi, axis=axis)


def _add_part(acc, update, which: Part, axis: int):
    """acc[which] += update along ``axis`` (static bounds)."""
    if which is Part.ALL:
        return acc + update
    lo, _ = which.bounds(acc.shape[axis])
    return lax.dynamic_update_slice_in_dim(acc, _part(acc, which, axis) + update, lo, axis=axis)


def merge_block(backend, scale, q, block: Block, kv, state):
    """Merge ``q[block.q_part]`` attending to the visiting ``kv`` into ``state = (o, lse)``."""
    k_cur, v_cur = kv
    o, lse = state
    o_b, lse_b = backend.fwd(_part(q, block.q_part, 1), _part(k_cur, block.kv_part, 1),
                             _part(v_cur, block.kv_part, 1), block.mask, scale)
    o_p, lse_p = merge_partials(_part(o, block.q_part, 1), _part(lse, block.q_part, 2), o_b, lse_b)
    lo, _ = block.q_part.bounds(q.shape[1])
    if block.q_part is Part.ALL:
        return o_p, lse_p
    return (lax.dynamic_update_slice_in_dim(o, o_p, lo, axis=1),
            lax.dynamic_update_slice_in_dim(lse, lse_p, lo, axis=2))


def grad_block(backend, scale, saved, block: Block, kv, state):
    """Add one block's gradients to ``state = (dq, dk_acc, dv_acc)`` (dk/dv of the visiting
    ``kv``); ``saved = (q, o, lse, do, dlse)`` of this device."""
    q, o, lse, do, dlse = saved
    k_cur, v_cur = kv
    dq, dk_acc, dv_acc = state
    qp, kp = block.q_part, block.kv_part
    dq_b, dk_b, dv_b = backend.bwd(
        _part(do, qp, 1), _part(q, qp, 1), _part(k_cur, kp, 1), _part(v_cur, kp, 1),
        _part(o, qp, 1), _part(lse, qp, 2), block.mask, scale, None if dlse is None else _part(dlse, qp, 2))
    return _add_part(dq, dq_b, qp, 1), _add_part(dk_acc, dk_b, kp, 1), _add_part(dv_acc, dv_b, kp, 1)


def walk_forward(q, k, v, axes, config: AttentionConfig, schedule: Schedule):
    """One device's forward over ``schedule`` (ring or double ring): its own block, then every
    visiting K/V merged by LSE. Returns (o, lse, kv_first): kv_first, the K/V of step 1 (in
    flight while step 0 computes), is kept for the backward when the schedule's backward reuses
    it (the single ring: R-2 backward K/V hops, not R-1), else None."""
    backend, me = config.backend(), ring_index(axes)
    kv_first = (config.comm.shift((k, v), schedule.steps[0].kv_hop, axes)
                if schedule.backward_reuses_first_kv else None)

    def visit(step, j, s, kv, state):
        if step.local:  # own K/V, never empty
            return backend.fwd(q, *kv, schedule.plan.local.mask, config.scale)
        return visit_block(schedule, me, j, s, lambda blk, st: merge_block(backend, config.scale, q, blk, kv, st),
                           state)

    o, lse = walk(schedule, (k, v), None, visit, comm=config.comm, axes=axes, kv_first=kv_first)
    return o, lse, kv_first


def attention_with_vjp(forward: Callable, backward: Callable) -> Callable:
    """A differentiable ``(q, k, v, axes, config: AttentionConfig) -> (o, lse)`` from
    ``forward(q, k, v, axes, config) -> (o, lse, extra)`` and ``backward(q, k, v, o, lse, extra,
    do, dlse, axes, config) -> (dq, dk, dv)``; ``extra`` (K/V the forward received) is saved for
    the backward. ``axes`` and ``config`` are static (never arrays)."""

    @partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def attention(q, k, v, axes, config: AttentionConfig):
        o, lse, _ = forward(q, k.astype(q.dtype), v.astype(q.dtype), axes, config)
        return o.astype(q.dtype), lse

    def attention_fwd(q, k, v, axes, config):
        q, k, v = (x.value for x in (q, k, v))  # symbolic_zeros=True wraps the primals
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        kv_dtype_of = jnp.zeros((0,), k.dtype)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        o, lse, extra = forward(q, k, v, axes, config)
        o = o.astype(q.dtype)
        return (o, lse), (q, k, v, o, lse, extra, kv_dtype_of)

    def attention_bwd(axes, config, residuals, cotangents):
        q, k, v, o, lse, extra, kv_dtype_of = residuals
        do, dlse = cotangents
        # An unused output's cotangent stays symbolic: dlse arrives as None (as in torch_impl),
        # so the block kernels know there is none — fused kernels take no lse cotangent.
        do = jnp.zeros_like(o) if isinstance(do, SymbolicZero) else do
        dlse = None if isinstance(dlse, SymbolicZero) else dlse
        dq, dk, dv = backward(q, k, v, o, lse, extra, do, dlse, axes, config)
        return dq.astype(q.dtype), dk.astype(kv_dtype_of.dtype), dv.astype(kv_dtype_of.dtype)

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention
