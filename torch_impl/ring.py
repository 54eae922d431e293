"""Ring attention (contiguous / zigzag / stripe layouts) as a ``torch.autograd.Function``.

Per rank of a ring process group of size R, rank r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward: K/V rotate R-1 times with batched isend/irecv to the next rank; each hop is started
before the block that uses the K/V in hand, so the transfer overlaps the compute; receive
buffers are allocated once and reused (double-buffered). Backward: K/V rotate again, starting
from the K/V the forward received for step 1 (saved for backward, so R-2 hops); float32 dK/dV
accumulators travel with them, one hop behind, and a final hop brings them home (R hops); dQ
stays local. Same step plan as jax_impl (``layouts.step_plan``), step for step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .block import get_backend
from .comm import RingShift, axis_size
from .layouts import Block, Part, StepPlan, step_plan
from .merge import merge_partials_into

F32 = torch.float32


def ring_attention(q, k, v, group=None, *, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto"):
    """Ring attention over process group ``group`` (``None``: one rank, plain attention).

    Inputs are this rank's ring shard in layout order. Returns ``(o, lse)``: o like q, lse
    float32 [b, h, t/R]. Differentiable through torch.autograd (o and lse).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _ring(q, k, v, group, causal, layout, scale, block_backend)


def _part(x, part: Part, dim: int):
    lo, hi = part.bounds(x.shape[dim])
    return x if part is Part.ALL else x.narrow(dim, lo, hi - lo)


def _block_for_step(plan: StepPlan, step: int, rank: int) -> Block | None:
    """K/V at step i come from ring shard (r - i) mod R: an earlier shard iff i <= r."""
    return plan.from_earlier if step <= rank else plan.from_later


def merge_block(backend, scale, q, block: Block | None, kv, state) -> None:
    """Merge ``q[block.q_part]`` attending to the visiting ``kv`` into ``state = (o, lse)`` in place."""
    if block is None:
        return
    (k_cur, v_cur), (o, lse) = kv, state
    o_b, lse_b = backend.fwd(_part(q, block.q_part, 1), _part(k_cur, block.kv_part, 1),
                             _part(v_cur, block.kv_part, 1), block.mask, scale)
    merge_partials_into(_part(o, block.q_part, 1), _part(lse, block.q_part, 2), o_b, lse_b)


def grad_block(backend, scale, saved, block: Block | None, kv):
    """(dq, dk, dv) of one block against the visiting ``kv`` (None for a skipped block);
    ``saved = (q, o, lse, do, dlse)`` of this rank."""
    if block is None:
        return None
    (q, o, lse, do, dlse), (k_cur, v_cur) = saved, kv
    qp, kp = block.q_part, block.kv_part
    return backend.bwd(_part(do, qp, 1), _part(q, qp, 1), _part(k_cur, kp, 1), _part(v_cur, kp, 1),
                       _part(o, qp, 1), _part(lse, qp, 2), block.mask, scale,
                       None if dlse is None else _part(dlse, qp, 2))


def _add_grads(block: Block | None, grads, dq, dkv) -> None:
    """dq[q_part] += dq_b; dk, dv (of the visiting shard)[kv_part] += dk_b, dv_b — in place."""
    if grads is None:
        return
    dq_b, dk_b, dv_b = grads
    _part(dq, block.q_part, 1).add_(dq_b)
    _part(dkv[0], block.kv_part, 1).add_(dk_b)
    _part(dkv[1], block.kv_part, 1).add_(dv_b)


def _buffer(x):
    """A contiguous receive buffer like ``x`` (``empty_like`` would copy x's strides)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _ring_loop(group, kv_first, shift: RingShift, visit, after_visit=None):
    """Drive steps 1..R-1 from ``kv_first`` (the K/V of step 1, possibly still arriving through
    ``shift``): hop K/V ahead of each step's compute into two buffers allocated once and
    swapped; ``after_visit(step)`` may exchange what depends on the step (the backward's dK/dV).
    ``kv_first`` itself is never overwritten: the backward starts from it again."""
    n = axis_size(group)
    # Steps 1..n-2 each receive the next K/V; alternate between (at most) two buffers.
    buffers = [tuple(_buffer(x) for x in kv_first) for _ in range(min(n - 2, 2))]
    current = kv_first
    for step in range(1, n):
        shift.wait()
        incoming = buffers[(step - 1) % 2] if step < n - 1 else None
        if incoming is not None:
            shift.start(current, incoming)
        visit(step, *current)
        if after_visit is not None:
            after_visit(step)
        if incoming is not None:
            current = incoming
    shift.wait()


def _forward(q, k, v, group, causal, layout, scale, backend_name):
    """Returns (o, lse, kv_first): kv_first, the K/V received for step 1, is kept for the
    backward, which then starts at step 1 without re-sending it (R-2 K/V hops, not R-1)."""
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    k, v = k.contiguous(), v.contiguous()  # they are sent as they are
    n = axis_size(group)
    if n > 1:
        shift = RingShift(group)
        kv_first = (_buffer(k), _buffer(v))
        shift.start((k, v), kv_first)  # in flight while step 0 computes
    o, lse = backend.fwd(q, k, v, plan.local.mask, scale)  # step 0: own K/V, never empty
    if n == 1:
        return o, lse, None
    o = o.float()  # the float32 accumulator (kernels may return the input dtype)
    rank = dist.get_group_rank(group, dist.get_rank())

    def visit(step, k_cur, v_cur):
        merge_block(backend, scale, q, _block_for_step(plan, step, rank), (k_cur, v_cur), (o, lse))

    _ring_loop(group, kv_first, shift, visit)
    return o, lse, kv_first


def _backward(q, k, v, o, lse, kv_first, do, dlse, group, causal, layout, scale, backend_name):
    backend, plan = get_backend(backend_name), step_plan(layout, causal)
    dq, dk, dv = backend.bwd(do, q, k, v, o, lse, plan.local.mask, scale, dlse)
    if axis_size(group) == 1:
        return dq, dk, dv
    dq, dk, dv = dq.float(), dk.float(), dv.float()  # the float32 accumulators (kernels may return bf16)
    rank = dist.get_group_rank(group, dist.get_rank())
    dkv_shift = RingShift(group)
    acc, spare = (dk.contiguous(), dv.contiguous()), (_buffer(dk), _buffer(dv))
    dkv_shift.start(acc, spare)  # the accumulator of my shard leaves with my K/V
    acc, spare = spare, acc

    def visit(step, k_cur, v_cur):
        block = _block_for_step(plan, step, rank)
        grads = grad_block(backend, scale, (q, o, lse, do, dlse), block, (k_cur, v_cur))
        dkv_shift.wait()  # the visiting shard's dK/dV accumulator has arrived in ``acc``
        _add_grads(block, grads, dq, acc)

    def send_dkv(step):
        nonlocal acc, spare
        dkv_shift.start(acc, spare)
        acc, spare = spare, acc

    _ring_loop(group, kv_first, RingShift(group), visit, after_visit=send_dkv)
    dkv_shift.wait()  # after R hops, ``acc`` holds this shard's own dK/dV
    return dq, acc[0], acc[1]


class _Attention(torch.autograd.Function):
    """Autograd for a (forward, backward) pair; see :func:`attention_with_vjp`."""

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, group, causal, layout, scale, backend_name):
        # An unused output's gradient arrives as None rather than zeros, so the kernels know
        # there is no lse cotangent without inspecting a tensor (a device sync on GPUs).
        ctx.set_materialize_grads(False)
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        ctx.kv_dtype = k.dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        o, lse, extra = forward(q, k, v, group, causal, layout, scale, backend_name)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, *(extra or ()))
        ctx.config = (group, causal, layout, scale, backend_name)
        ctx.backward_fn = backward
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, *extra = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = ctx.backward_fn(q, k, v, o, lse, tuple(extra) or None, do, dlse, *ctx.config)
        return None, None, dq.to(q.dtype), dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None, None, None


def attention_with_vjp(forward, backward):
    """A differentiable ``(q, k, v, group, causal, layout, scale, backend_name) -> (o, lse)``
    from ``forward(q, k, v, *config) -> (o, lse, extra)`` and ``backward(q, k, v, o, lse, extra,
    do, dlse, *config) -> (dq, dk, dv)``: ``extra`` (K/V the forward received) is saved for the
    backward. Shared by ring attention and all-gather-KV attention."""
    return lambda *args: _Attention.apply(forward, backward, *args)


_ring = attention_with_vjp(_forward, _backward)
