"""Ring attention (contiguous / zigzag / stripe layouts) as a ``torch.autograd.Function``.

Per rank of a ring process group of size R, rank r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

It walks :func:`schedule.ring_schedule`, step for step as jax_impl does. Forward: K/V rotate R-1
times with batched isend/irecv to the next rank; each hop is started before the block that uses
the K/V in hand, so the transfer overlaps the compute; receive buffers are allocated once and
reused (double-buffered). Backward: K/V rotate again, starting from the K/V the forward received
for step 1 (saved for backward, so R-2 hops); float32 dK/dV accumulators travel with them, one
hop behind, and a final hop brings them home (R hops); dQ stays local.
"""

from __future__ import annotations

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import DKVTrail, KVWalk, add_grads, attention_with_vjp, grad_block, merge_block
from .schedule import ring_schedule
from .validation import dtype_name, validate_local


def ring_attention(q, k, v, group=None, *, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None):
    """Ring attention over process group ``group`` (``None``: one rank, plain attention).

    Inputs are this rank's ring shard in layout order (shapes in the module docstring; k/v may be
    float32 where q is not). Returns ``(o, lse)``: o like q, lse float32 [b, h, t/R].
    Differentiable through torch.autograd (o and lse). ``deterministic``: see
    ``config.default_deterministic``.
    """
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic)
    config.backend()  # an unknown or refused kernel fails here, before any collective
    return _ring(q, k, v, (None, group), config)


def _schedule(groups, config: AttentionConfig):
    return ring_schedule(config.layout, config.causal, axis_size(groups[1]))


def _forward(q, k, v, groups, config: AttentionConfig):
    """Returns (o, lse, kv_first): kv_first, the K/V received for step 1, is kept for the
    backward, which then starts at step 1 without re-sending it (R-2 K/V hops, not R-1)."""
    backend, schedule = config.backend(), _schedule(groups, config)
    k, v = k.contiguous(), v.contiguous()  # they are sent as they are
    walk = KVWalk(schedule, config.comm, groups, (k, v), keep_first=schedule.backward_reuses_first_kv)
    for visit, kv in walk:
        if visit.step.local:  # own K/V, never empty
            o, lse = backend.fwd(q, *kv, visit.block.mask, config.scale)
            o = o.float() if schedule.size > 1 else o  # the float32 accumulator (kernels may return the input dtype)
        else:
            merge_block(backend, config.scale, q, visit.block, kv, (o, lse))
    return o, lse, walk.first


def _backward(q, k, v, o, lse, kv_first, do, dlse, groups, config: AttentionConfig):
    backend, schedule = config.backend(), _schedule(groups, config)
    saved = (q, o, lse, do, dlse)
    for visit, kv in KVWalk(schedule, config.comm, groups, (k.contiguous(), v.contiguous()), first=kv_first):
        if visit.step.local:
            dq, dk, dv = backend.bwd(do, q, *kv, o, lse, visit.block.mask, config.scale, dlse)
            if schedule.size == 1:
                return dq, dk, dv
            dq = dq.float()  # the float32 accumulators (kernels may return bf16)
            trail = DKVTrail(config.comm, groups, dk.float(), dv.float())
        else:
            grads = grad_block(backend, config.scale, saved, visit.block, kv)
            add_grads(visit.block, grads, dq, trail.current())  # once the shard's dK/dV have arrived
        trail.send(visit.step.dkv_hop)  # dK/dV of the shard just visited move on with it
    dk, dv = trail.current()  # after R hops, this shard's own
    return dq, dk, dv


_ring = attention_with_vjp(_forward, _backward)
