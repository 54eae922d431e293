"""Double ring attention (LoongTrain) as a ``jax.custom_vjp``: one ring of R = O·I shards laid
over two mesh axes, an outer ring (``"ring_outer"``, O devices: across nodes) of inner rings
(``"ring_inner"``, I devices: inside a node).

Device (o, i) holds shard r = o·I + i of the combined ring, so every layout and the step plan of
ring attention apply unchanged:

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

from functools import partial

import jax.numpy as jnp
from jax import lax

from .axes import RING_INNER, RING_OUTER
from .block import get_backend
from .comm import axis_size, diagonal_shift, ring_shift
from .layouts import step_plan
from .ring import _ring_loop, attention_with_vjp, grad_block, merge_block, _visit_block

DOUBLE_RING = (RING_OUTER, RING_INNER)


def double_ring_attention(q, k, v, axis_name: tuple[str, str] = DOUBLE_RING, *, causal: bool = False,
                          layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto"):
    """Double ring attention over the mesh axes ``axis_name = (outer, inner)``. Call inside
    ``shard_map``; inputs are this device's shard of the combined ring (index o·I + i) in
    layout order. Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R]."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _double_ring(q, k, v, tuple(axis_name), causal, layout, scale, block_backend)


def _sizes(axes) -> tuple[int, int]:
    return axis_size(axes[0]), axis_size(axes[1])


def _source_is_earlier(axes, j, s):
    """Thunk: does the shard visiting at round ``j``, inner step ``s`` come before this device's
    own shard in the combined ring? It is ((o - j) mod O, (i - s) mod I)."""
    n_out, n_in = _sizes(axes)

    def earlier():
        o, i = lax.axis_index(axes[0]), lax.axis_index(axes[1])
        return (o - j) % n_out * n_in + (i - s) % n_in < o * n_in + i

    return earlier


def _rounds(axes, kv0, state, visit, after_step=None):
    """Drive every (round j, inner step s) after the local (0, 0): ``visit(j, s, kv, state)``;
    ``after_step(state, shift)`` follows every step, (0, 0) included, with ``shift`` the hop to
    the next holder of the shard just visited (inner, or diagonal after a round's last step)."""
    outer, inner = axes
    n_out, n_in = _sizes(axes)
    after_step = after_step or (lambda st, shift: st)
    to_inner, to_diagonal = partial(ring_shift, axis_name=inner), partial(diagonal_shift, axis_names=axes)

    def one_round(j, kv_round, st, *, local: bool, prefetch: bool):
        kv_next_round = ring_shift(kv_round, outer) if prefetch else None  # hidden behind the round
        st = st if local else visit(j, 0, kv_round, st)
        if n_in == 1:
            return kv_next_round, after_step(st, to_diagonal)
        kv_first = to_inner(kv_round)
        st = _ring_loop(inner, kv_first, after_step(st, to_inner), partial(visit, j),
                        after_visit=lambda s: after_step(s, to_inner), after_last=lambda s: after_step(s, to_diagonal))
        return kv_next_round, st

    kv_round, state = one_round(0, kv0, state, local=True, prefetch=n_out > 1)
    if n_out > 2:
        def body(carry, j):
            return one_round(j, *carry, local=False, prefetch=True), None

        (kv_round, state), _ = lax.scan(body, (kv_round, state), jnp.arange(1, n_out - 1))
    if n_out > 1:
        _, state = one_round(n_out - 1, kv_round, state, local=False, prefetch=False)
    return state


def _to_bits(x):
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _from_bits(bits, like):
    return lax.bitcast_convert_type(bits, like.dtype)


def _forward(q, k, v, axes, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    o, lse = backend.fwd(q, k, v, plan.local.mask, scale)  # round 0, step 0: own K/V
    if _sizes(axes) == (1, 1):
        return o, lse, None

    def visit(j, s, kv, st):
        return _visit_block(plan, _source_is_earlier(axes, j, s),
                           lambda blk, st: merge_block(backend, scale, q, blk, kv, st), st)

    return (*_rounds(axes, (k, v), (o, lse), visit), None)


def _backward(q, k, v, o, lse, _, do, dlse, axes, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    dq, dk, dv = backend.bwd(do, q, k, v, o, lse, plan.local.mask, scale, dlse)
    if _sizes(axes) == (1, 1):
        return dq, dk, dv

    def visit(j, s, kv_bits, st):
        kv = tuple(_from_bits(x, like) for x, like in zip(kv_bits, (k, v)))
        return _visit_block(plan, _source_is_earlier(axes, j, s),
                           lambda blk, st: grad_block(backend, scale, (q, o, lse, do, dlse), blk, kv, st), st)

    def send_dkv(st, shift):  # the visited shard's dK/dV follow it to its next holder
        dq, dk_acc, dv_acc = st
        return (dq, *shift((dk_acc, dv_acc)))

    return _rounds(axes, (_to_bits(k), _to_bits(v)), (dq, dk, dv), visit, after_step=send_dkv)  # see module doc


_double_ring = attention_with_vjp(_forward, _backward)
