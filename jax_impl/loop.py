"""The machinery ring, all-gather-KV and double-ring attention share: walking a
:class:`schedule.Schedule` inside ``shard_map``, one block's forward merge and backward
gradients, and the ``custom_vjp`` that joins a forward and a backward.

Shapes (per device): q, o, dq [b, t, h, d]; k, v, dk, dv [b, t, hk, d]; lse [b, h, t] float32.

Packed documents: ``segments = (q_ids [b, t], kv_ids [b, t])`` — the segment ids of this
device's queries and of the visiting K/V shard — or ``None``. Every block then runs under the
run-time decision of :func:`schedule.document_flags` (one ``lax.switch`` on a traced index, so
nothing recompiles per batch): skipped, its static mask alone, or the document mask too. The
ids of every ring shard are all-gathered once per call (:func:`gather_segment_ids`), not sent with K/V.
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
from .schedule import Block, BlockMask, Part, Schedule, Step, document_flags, runs


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


def gather_segment_ids(ids, axes, comm: Comm):
    """Every ring shard's segment ids, [b, t] -> [b, R·t] (shard r at rows r·t), by all-gathers
    of the int32 ids: one over a ring axis; on a double ring one over the inner axis, then one
    over the outer (r = o·I + i), as torch_impl gathers over its two groups. ``None`` stays ``None``."""
    if ids is None:
        return None
    ids = ids.astype(jnp.int32)
    if axes is None:
        return ids
    for axis in (axes[1], axes[0]) if isinstance(axes, tuple) else (axes,):
        ids = comm.gather(ids, axis)
    return ids


def shard_ids(ids_all, src, t: int):
    """Ring shard ``src`` (traced or int) of gathered ids [b, R·t] -> [b, t]."""
    return lax.dynamic_slice_in_dim(ids_all, src * t, t, axis=1)


def under_documents(block: Block, segments, run: Callable, state, *, may_skip: bool = True):
    """``run(mask, block_segments, state)`` under the block's run-time document decision
    (module docstring): skipped (``state`` returned; only when ``may_skip``: a device's own
    block always holds each query's own key), ``block.mask`` alone with no ids, or the mask
    with documents and the ids of the block's parts. ``segments`` None: ``run(block.mask, None,
    state)``."""
    if segments is None:
        return run(block.mask, None, state)
    q_ids, kv_ids = _part(segments[0], block.q_part, 1), _part(segments[1], block.kv_part, 1)
    shared, one_document = document_flags(q_ids.min(1), q_ids.max(1), kv_ids.min(1), kv_ids.max(1))
    branches = [lambda st: run(block.mask, None, st),
                lambda st: run(block.mask.with_documents(), (q_ids, kv_ids), st)]
    index = jnp.where(one_document, 0, 1)
    if may_skip:
        branches.insert(0, lambda st: st)
        index = jnp.where(shared, index + 1, 0)
    return lax.switch(index, branches, state)


def _segments_kw(segments) -> dict:
    """Keyword arguments of a kernel call: segments only when the block has them (kernels
    written before documents take none)."""
    return {} if segments is None else {"segments": segments}


def local_forward(backend, scale, q, kv, mask: BlockMask, segments=None):
    """(o, lse) of a device's own block (step 0): queries against their own shard's K/V."""
    def run(m, segs, _):
        return backend.fwd(q, *kv, m, scale, **_segments_kw(segs))

    return under_documents(Block(Part.ALL, Part.ALL, mask), segments, run, None, may_skip=False)


def local_backward(backend, scale, saved, kv, mask: BlockMask, segments=None):
    """(dq, dk, dv) of a device's own block; ``saved = (q, o, lse, do, dlse)``."""
    q, o, lse, do, dlse = saved

    def run(m, segs, _):
        return backend.bwd(do, q, *kv, o, lse, m, scale, dlse, **_segments_kw(segs))

    return under_documents(Block(Part.ALL, Part.ALL, mask), segments, run, None, may_skip=False)


def merge_block(backend, scale, q, block: Block, kv, state, segments=None):
    """Merge ``q[block.q_part]`` attending to the visiting ``kv`` into ``state = (o, lse)``
    (``segments``: see the module docstring)."""
    k_cur, v_cur = kv

    def run(mask, segs, state):
        o, lse = state
        o_b, lse_b = backend.fwd(_part(q, block.q_part, 1), _part(k_cur, block.kv_part, 1),
                                 _part(v_cur, block.kv_part, 1), mask, scale, **_segments_kw(segs))
        o_p, lse_p = merge_partials(_part(o, block.q_part, 1), _part(lse, block.q_part, 2), o_b, lse_b)
        lo, _ = block.q_part.bounds(q.shape[1])
        if block.q_part is Part.ALL:
            return o_p, lse_p
        return (lax.dynamic_update_slice_in_dim(o, o_p, lo, axis=1),
                lax.dynamic_update_slice_in_dim(lse, lse_p, lo, axis=2))

    return under_documents(block, segments, run, state)


def grad_block(backend, scale, saved, block: Block, kv, state, segments=None):
    """Add one block's gradients to ``state = (dq, dk_acc, dv_acc)`` (dk/dv of the visiting
    ``kv``); ``saved = (q, o, lse, do, dlse)`` of this device."""
    q, o, lse, do, dlse = saved
    k_cur, v_cur = kv
    qp, kp = block.q_part, block.kv_part

    def run(mask, segs, state):
        dq, dk_acc, dv_acc = state
        dq_b, dk_b, dv_b = backend.bwd(
            _part(do, qp, 1), _part(q, qp, 1), _part(k_cur, kp, 1), _part(v_cur, kp, 1),
            _part(o, qp, 1), _part(lse, qp, 2), mask, scale, None if dlse is None else _part(dlse, qp, 2),
            **_segments_kw(segs))
        return _add_part(dq, dq_b, qp, 1), _add_part(dk_acc, dk_b, kp, 1), _add_part(dv_acc, dv_b, kp, 1)

    return under_documents(block, segments, run, state)


def visit_segments(schedule: Schedule, ids_all, device, j, s, t: int):
    """``segments`` of ``device``'s visit (j, s): (its own ids, the visited shard's), from the
    gathered ids [b, R·t] (``None``: no documents)."""
    if ids_all is None:
        return None
    return shard_ids(ids_all, device, t), shard_ids(ids_all, schedule.source(device, j, s), t)


def walk_forward(q, k, v, axes, config: AttentionConfig, schedule: Schedule, ids_all=None):
    """One device's forward over ``schedule`` (ring or double ring): its own block, then every
    visiting K/V merged by LSE. ``ids_all``: every shard's segment ids (:func:`gather_segment_ids`) or
    None. Returns (o, lse, kv_first): kv_first, the K/V of step 1 (in flight while step 0
    computes), is kept for the backward when the schedule's backward reuses it (the single ring:
    R-2 backward K/V hops, not R-1), else None."""
    backend, me, t = config.backend(), ring_index(axes), k.shape[1]
    kv_first = (config.comm.shift((k, v), schedule.steps[0].kv_hop, axes)
                if schedule.backward_reuses_first_kv else None)

    def visit(step, j, s, kv, state):
        segments = visit_segments(schedule, ids_all, me, j, s, t)
        if step.local:  # own K/V, never empty
            return local_forward(backend, config.scale, q, kv, schedule.plan.local.mask, segments)
        return visit_block(schedule, me, j, s,
                           lambda blk, st: merge_block(backend, config.scale, q, blk, kv, st, segments), state)

    o, lse = walk(schedule, (k, v), None, visit, comm=config.comm, axes=axes, kv_first=kv_first)
    return o, lse, kv_first


def attention_with_vjp(forward: Callable, backward: Callable) -> Callable:
    """A differentiable ``(q, k, v, ids, axes, config: AttentionConfig) -> (o, lse)`` from
    ``forward(q, k, v, ids, axes, config) -> (o, lse, extra)`` and ``backward(q, k, v, o, lse,
    extra, do, dlse, axes, config) -> (dq, dk, dv)``; ``extra`` (K/V the forward received, the
    gathered segment ids) is saved for the backward. ``ids``: this device's segment ids [b, t] or
    None — an ordinary argument (a traced array cannot be static) with no cotangent. ``axes``
    and ``config`` are static (never arrays)."""

    @partial(jax.custom_vjp, nondiff_argnums=(4, 5))
    def attention(q, k, v, ids, axes, config: AttentionConfig):
        o, lse, _ = forward(q, k.astype(q.dtype), v.astype(q.dtype), ids, axes, config)
        return o.astype(q.dtype), lse

    def attention_fwd(q, k, v, ids, axes, config):
        q, k, v = (x.value for x in (q, k, v))  # symbolic_zeros=True wraps the primals
        ids = None if ids is None else ids.value
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        kv_dtype_of = jnp.zeros((0,), k.dtype)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        o, lse, extra = forward(q, k, v, ids, axes, config)
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
        return dq.astype(q.dtype), dk.astype(kv_dtype_of.dtype), dv.astype(kv_dtype_of.dtype), None

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention
