"""All-gather-KV attention (``kv_exchange="allgather"``: llama3-style context parallelism,
MaxText's default) as a ``torch.autograd.Function``, over the same ring group, layouts and
visiting order as ring attention (:func:`schedule.allgather_schedule`).

Per rank of a ring process group of size R, rank r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    segment_ids: [b, t/R] or None    sinks: [h] or None
                                                  ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward: one all-gather of K and of V (issued asynchronously, so it runs while the rank's own
block computes), then the blocks of the step plan against each shard in turn (step i visits
shard (r - i) mod R, as the ring does), merged by LSE. Backward: float32 dK/dV for every shard,
one reduce-scatter of each brings every shard's sum home. Memory: the gathered K/V (R shards)
are saved for the backward — the price of no transfer inside the loop.
"""

from __future__ import annotations

import torch

from seqplan.schedule import allgather_schedule, device_visits
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .comm import axis_size
from .config import AttentionConfig, make_config
from .loop import ShardMasks, add_grads, attend_block, attention_with_vjp, grad_block, merge_block, ring_index

F32 = torch.float32


def allgather_attention(q, k, v, group=None, *, segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                        causal: bool = False, layout: str = "zigzag",
                        scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None):
    """All-gather-KV attention over process group ``group`` (``None``: one rank). Inputs are this
    rank's ring shard in layout order; ``segment_ids`` (packed documents) this rank's local shard
    of the ids, [b, t/R] (see ``ring_attention``: gathered once, blocks without a shared
    document skipped); ``window``, ``sinks``, ``softcap`` and ``token_index`` ([b, t/R] or None) as in
    ``ring_attention`` (``sinks.grad``: this rank's contribution). Returns ``(o, lse)``; differentiable through autograd."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None)
    config.backend()  # an unknown or refused kernel fails here, before any collective
    return _allgather(q, k, v, (None, group), config, segment_ids, sinks, token_index)


def _visits(groups, config: AttentionConfig):
    schedule = allgather_schedule(config.layout, config.causal, axis_size(groups[1]))
    return schedule, device_visits(schedule, ring_index(groups))


def _forward(q, k, v, groups, config: AttentionConfig, masks: ShardMasks):
    backend, (schedule, visits), me = config.backend(), _visits(groups, config), ring_index(groups)
    if schedule.size > 1:
        (k_all, k_work), (v_all, v_work) = (config.comm.gather(x, groups[1], async_op=True) for x in (k, v))
    for visit in visits:
        visit_masks = masks.visit(me, visit.source)
        if visit.step.local:  # own K/V, while K/V gather
            o, lse = attend_block(backend, config.scale, q, visit.block, (k, v), visit_masks)
            if schedule.size == 1:
                return o, lse, None
            o = o.float()  # the float32 accumulator (kernels may return the input dtype)
            k_work.wait()
            v_work.wait()
        else:
            merge_block(backend, config.scale, q, visit.block, (k_all[visit.source], v_all[visit.source]), (o, lse),
                        visit_masks)
    return o, lse, (k_all, v_all)


def _backward(q, k, v, o, lse, kv_all, do, dlse, groups, config: AttentionConfig, masks: ShardMasks):
    backend, (schedule, visits), me = config.backend(), _visits(groups, config), ring_index(groups)
    saved = (q, o, lse, do, dlse)
    for visit in visits:
        src = visit.source
        visit_masks = masks.visit(me, src)
        if visit.step.local:
            dq, dk, dv = grad_block(backend, config.scale, saved, visit.block, (k, v), visit_masks)
            if schedule.size == 1:
                return dq, dk, dv
            dq = dq.float()  # the float32 accumulator (kernels may return bf16)
            dk_all, dv_all = (torch.zeros(x.shape, dtype=F32, device=x.device) for x in kv_all)
            dk_all[src], dv_all[src] = dk, dv
        else:
            grads = grad_block(backend, config.scale, saved, visit.block, (kv_all[0][src], kv_all[1][src]), visit_masks)
            add_grads(visit.block, grads, dq, (dk_all[src], dv_all[src]))
    return dq, config.comm.scatter(dk_all, groups[1]), config.comm.scatter(dv_all, groups[1])


_allgather = attention_with_vjp(_forward, _backward)
