"""Ring attention (contiguous / zigzag / stripe layouts) as a ``jax.custom_vjp``.

Per device, inside ``shard_map`` over a ring axis of size R, device r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward: K/V rotate R-1 times with ``lax.ppermute``; each hop is issued before the block that
uses the K/V in hand, so the transfer overlaps the compute. Partials merge by LSE (float32).
Backward: K/V rotate again, starting from the K/V the forward received for step 1 (kept as a
residual, so R-2 hops); float32 dK/dV accumulators travel with them, one hop behind, and a final
hop brings them home (R hops); dQ stays local. Which block is computed at each step comes
from :func:`layouts.step_plan`, so causal work is balanced and a fully masked block is skipped.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .axes import RING
from .block import get_backend
from .comm import axis_size, ring_shift
from .layouts import Block, Part, StepPlan, step_plan
from .merge import merge_partials

F32 = jnp.float32


def ring_attention(q, k, v, axis_name: str | None = RING, *, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto"):
    """Ring attention over mesh axis ``axis_name`` (``None``: one device, plain attention).

    Call inside ``shard_map``; inputs are this device's ring shard in layout order.
    Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R].
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _ring(q, k, v, axis_name, causal, layout, scale, block_backend)


def _part(x, part: Part, axis: int):
    lo, hi = part.bounds(x.shape[axis])
    return x if part is Part.ALL else lax.slice_in_dim(x, lo, hi, axis=axis)


def _add_part(acc, update, part: Part, axis: int):
    """acc[part] += update along ``axis`` (static bounds)."""
    if part is Part.ALL:
        return acc + update
    lo, _ = part.bounds(acc.shape[axis])
    return lax.dynamic_update_slice_in_dim(acc, _part(acc, part, axis) + update, lo, axis=axis)


def _visit_block(plan: StepPlan, earlier, on_block, state):
    """Apply ``on_block(block, state)`` for the block of visiting K/V from an ``earlier`` ring
    shard (a traced bool) or a later one: the only per-device choice, taken with ``lax.cond``
    (a skipped block costs nothing). ``earlier`` is a thunk, called only when layouts differ."""

    def branch(block: Block | None):
        return (lambda st: st) if block is None else (lambda st: on_block(block, st))

    if plan.uniform:
        return branch(plan.from_earlier)(state)
    return lax.cond(earlier(), branch(plan.from_earlier), branch(plan.from_later), state)


def _visit(plan: StepPlan, step, axis_name: str, on_block, state):
    """:func:`_visit_block` at ring ``step``: K/V at step i come from ring shard (r - i) mod R,
    an earlier shard iff i <= r."""
    return _visit_block(plan, lambda: step <= lax.axis_index(axis_name), on_block, state)


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


def _ring_loop(axis_name: str, kv_first, state, visit, after_visit=None, after_last=None):
    """Drive steps 1..R-1 from ``kv_first`` (the K/V of step 1): hop K/V ahead of each step's
    compute; ``after_visit`` may emit a collective that depends on the step's result (the
    backward's dK/dV hop); ``after_last`` (default ``after_visit``) replaces it after step R-1."""
    n = axis_size(axis_name)
    after_visit = after_visit or (lambda st: st)
    after_last = after_last or after_visit
    kv = kv_first

    def body(carry, step):
        kv, st = carry
        kv_next = ring_shift(kv, axis_name)
        return (kv_next, after_visit(visit(step, kv, st))), None

    if n > 2:
        (kv, state), _ = lax.scan(body, (kv, state), jnp.arange(1, n - 1))
    return after_last(visit(n - 1, kv, state))


def _forward(q, k, v, axis_name, causal, layout, scale, backend_name):
    """Returns (o, lse, kv_first): kv_first, the K/V received for step 1, is kept for the
    backward, which then starts at step 1 without re-sending it (R-2 K/V hops, not R-1)."""
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    if axis_size(axis_name) > 1:
        kv_first = ring_shift((k, v), axis_name)  # in flight while step 0 computes
    o, lse = backend.fwd(q, k, v, plan.local.mask, scale)  # step 0: own K/V, never empty
    if axis_size(axis_name) == 1:
        return o, lse, None

    def visit(step, kv, st):
        return _visit(plan, step, axis_name, lambda blk, s: merge_block(backend, scale, q, blk, kv, s), st)

    return (*_ring_loop(axis_name, kv_first, (o, lse), visit), kv_first)


def _backward(q, k, v, o, lse, kv_first, do, dlse, axis_name, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    dq, dk, dv = backend.bwd(do, q, k, v, o, lse, plan.local.mask, scale, dlse)
    if axis_size(axis_name) == 1:
        return dq, dk, dv

    def visit(step, kv, st):
        return _visit(plan, step, axis_name,
                      lambda blk, s: grad_block(backend, scale, (q, o, lse, do, dlse), blk, kv, s), st)

    def send_dkv(st):  # dK/dV of the shard just visited move on with it; R hops bring them home
        dq, dk_acc, dv_acc = st
        return (dq, *ring_shift((dk_acc, dv_acc), axis_name))

    return _ring_loop(axis_name, kv_first, send_dkv((dq, dk, dv)), visit, after_visit=send_dkv)


def attention_with_vjp(forward, backward):
    """A differentiable ``(q, k, v, axis_name, causal, layout, scale, backend_name) -> (o, lse)``
    from ``forward(q, k, v, *config) -> (o, lse, extra)`` and ``backward(q, k, v, o, lse, extra,
    do, dlse, *config) -> (dq, dk, dv)``: ``extra`` (K/V the forward received) is saved for the
    backward. Shared by ring attention and all-gather-KV attention."""

    @partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
    def attention(q, k, v, axis_name, causal, layout, scale, backend_name):
        o, lse, _ = forward(q, k.astype(q.dtype), v.astype(q.dtype), axis_name, causal, layout, scale, backend_name)
        return o.astype(q.dtype), lse

    def attention_fwd(q, k, v, axis_name, causal, layout, scale, backend_name):
        q, k, v = (x.value for x in (q, k, v))  # symbolic_zeros=True wraps the primals
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        kv_dtype_of = jnp.zeros((0,), k.dtype)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        o, lse, extra = forward(q, k, v, axis_name, causal, layout, scale, backend_name)
        o = o.astype(q.dtype)
        return (o, lse), (q, k, v, o, lse, extra, kv_dtype_of)

    def attention_bwd(axis_name, causal, layout, scale, backend_name, residuals, cotangents):
        q, k, v, o, lse, extra, kv_dtype_of = residuals
        do, dlse = cotangents
        # An unused output's cotangent stays symbolic: dlse arrives as None (as in torch_impl),
        # so the block kernels know there is none — fused kernels take no lse cotangent.
        do = jnp.zeros_like(o) if isinstance(do, SymbolicZero) else do
        dlse = None if isinstance(dlse, SymbolicZero) else dlse
        dq, dk, dv = backward(q, k, v, o, lse, extra, do, dlse, axis_name, causal, layout, scale, backend_name)
        return dq.astype(q.dtype), dk.astype(kv_dtype_of.dtype), dv.astype(kv_dtype_of.dtype)

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention


_ring = attention_with_vjp(_forward, _backward)
