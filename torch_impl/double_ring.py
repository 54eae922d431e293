"""Double ring attention (LoongTrain) as a ``torch.autograd.Function``: one ring of R = O·I
shards laid over two process groups, an outer ring (O ranks: across nodes) of inner rings
(I ranks: inside a node).

Rank (o, i) holds shard r = o·I + i of the combined ring, so every layout and the step plan of
ring attention apply unchanged:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

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

import torch.distributed as dist

from .block import get_backend
from .comm import RingShift, axis_size
from .layouts import StepPlan, step_plan
from .ring import _add_grads, _buffer, attention_with_vjp, grad_block, merge_block


def double_ring_attention(q, k, v, group=None, *, causal: bool = False, layout: str = "zigzag",
                          scale: float | None = None, block_backend: str = "auto"):
    """Double ring attention over ``group = (outer_group, inner_group)`` (``None``: one rank).
    Inputs are this rank's shard of the combined ring (index o·I + i) in layout order.
    Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R]. Differentiable through autograd."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _double_ring(q, k, v, tuple(group) if group is not None else (None, None), causal, layout, scale,
                        block_backend)


class _Topology:
    """This rank's place in the double ring and the three shifts it uses."""

    def __init__(self, groups):
        self.outer_group, self.inner_group = groups
        self.n_out, self.n_in = axis_size(self.outer_group), axis_size(self.inner_group)
        self.size = self.n_out * self.n_in
        if self.size == 1:
            return
        self.o = dist.get_group_rank(self.outer_group, dist.get_rank()) if self.n_out > 1 else 0
        self.i = dist.get_group_rank(self.inner_group, dist.get_rank()) if self.n_in > 1 else 0
        self.outer = RingShift(self.outer_group) if self.n_out > 1 else None
        self.inner = RingShift(self.inner_group) if self.n_in > 1 else None

    def diagonal(self) -> RingShift:
        if self.n_out == 1:
            return RingShift(self.inner_group)
        if self.n_in == 1:
            return RingShift(self.outer_group)
        return RingShift.diagonal(self.outer_group, self.inner_group)

    def block(self, plan: StepPlan, j: int, s: int):
        """The block for round ``j``, inner step ``s``: the visiting shard is
        ((o - j) mod O, (i - s) mod I), earlier in the combined ring or later."""
        src = (self.o - j) % self.n_out * self.n_in + (self.i - s) % self.n_in
        return plan.from_earlier if src < self.o * self.n_in + self.i else plan.from_later


def _rounds(topo: _Topology, kv0, visit, after_step=None) -> None:
    """Drive every (round j, inner step s) after the local (0, 0): ``visit(j, s, k, v)``;
    ``after_step(j, s, last_in_round)`` follows every step, (0, 0) included."""
    n_out, n_in = topo.n_out, topo.n_in
    round_buffers = [tuple(_buffer(x) for x in kv0) for _ in range(min(n_out - 1, 2))]
    inner_buffers = [tuple(_buffer(x) for x in kv0) for _ in range(min(n_in - 1, 2))]
    kv_round = kv0
    for j in range(n_out):
        next_round = round_buffers[j % 2] if j < n_out - 1 else None
        if next_round is not None:
            topo.outer.start(kv_round, next_round)  # hidden behind the whole round
        kv = kv_round
        for s in range(n_in):
            incoming = inner_buffers[s % 2] if s < n_in - 1 else None
            if incoming is not None:
                topo.inner.start(kv, incoming)
            if (j, s) != (0, 0):
                visit(j, s, *kv)
            if after_step is not None:
                after_step(j, s, s == n_in - 1)
            if incoming is not None:
                topo.inner.wait()
                kv = incoming
        if next_round is not None:
            topo.outer.wait()
            kv_round = next_round


def _forward(q, k, v, groups, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    k, v = k.contiguous(), v.contiguous()  # they are sent as they are
    o, lse = backend.fwd(q, k, v, plan.local.mask, scale)  # round 0, step 0: own K/V
    topo = _Topology(groups)
    if topo.size == 1:
        return o, lse, None
    o = o.float()  # the float32 accumulator (kernels may return the input dtype)

    def visit(j, s, k_cur, v_cur):
        merge_block(backend, scale, q, topo.block(plan, j, s), (k_cur, v_cur), (o, lse))

    _rounds(topo, (k, v), visit)
    return o, lse, None


def _backward(q, k, v, o, lse, _, do, dlse, groups, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    dq, dk, dv = backend.bwd(do, q, k, v, o, lse, plan.local.mask, scale, dlse)
    topo = _Topology(groups)
    if topo.size == 1:
        return dq, dk, dv
    dq, dk, dv = dq.float(), dk.float(), dv.float()  # the float32 accumulators (kernels may return bf16)
    to_inner, to_diagonal = RingShift(topo.inner_group) if topo.n_in > 1 else None, topo.diagonal()
    acc, spare = [dk.contiguous(), dv.contiguous()], [_buffer(dk), _buffer(dv)]
    in_flight: list[RingShift] = []

    def visit(j, s, k_cur, v_cur):
        block = topo.block(plan, j, s)
        grads = grad_block(backend, scale, (q, o, lse, do, dlse), block, (k_cur, v_cur))
        in_flight.pop().wait()  # the visiting shard's dK/dV accumulator has arrived in ``acc``
        _add_grads(block, grads, dq, acc)

    def send_dkv(j, s, last_in_round):  # the visited shard's dK/dV follow it to its next holder
        nonlocal acc, spare
        shift = to_diagonal if last_in_round else to_inner
        shift.start(acc, spare)
        in_flight.append(shift)
        acc, spare = spare, acc

    k, v = k.contiguous(), v.contiguous()
    _rounds(topo, (k, v), visit, after_step=send_dkv)
    in_flight.pop().wait()  # after R hops, ``acc`` holds this shard's own dK/dV
    return dq, acc[0], acc[1]


_double_ring = attention_with_vjp(_forward, _backward)
