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

**One call** (:func:`prefix_plan`): a causal call with packed documents or token indices whose
blocks go to a varlen family with a one-call kernel (:data:`ONE_CALL_KERNELS`: ``aten_varlen``,
``fa4``) does not walk the blocks at all. With every key in hand, the rank's
queries against the whole sequence are one batch of causal runs — each query run against its
document's key prefix, gathered (``seqplan.documents.prefix_runs``) — so the forward is ONE
varlen call (FA2 or FA4) and the backward one more, the gathered keys' dK / dV scattered back into the
float32 [R, b, t] accumulators before the reduce-scatter. No merge, no per-block launch: the
whole-sequence varlen kernel's cost on the rank's share of the pairs. A backward with an lse
cotangent (the varlen backward takes none) walks the blocks as before.
"""

from __future__ import annotations

import torch

import seqplan.registry
from seqplan.documents import PREFIX_KEY_FACTOR, PrefixRuns, cached_plan, shard_prefix_runs
from seqplan.schedule import allgather_schedule, device_visits
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .block import device_kind_of, resolve_backend
from .comm import axis_size
from .config import AttentionConfig, make_config
from .kernels import fa4, varlen
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


PREFIX_MAX_KEYS = PREFIX_KEY_FACTOR  # seqplan's bound on the gathered keys, under this module's former name


# The block backends whose varlen kernel family also runs the one call (module docstring).
ONE_CALL_KERNELS = {"aten_varlen": varlen, "fa4": fa4}


def _one_call_kernel(config: AttentionConfig, q, documents: bool):
    """The kernel module that runs the one call — the one the call's document blocks resolve to
    (``seqplan.registry.one_call_backend``) — or None. Given a plan, ``documents=True`` is exact:
    the one-call mask always has documents (``schedule.one_call_mask``); the flag only gates
    eligibility, which the plan already passed."""
    name = seqplan.registry.one_call_backend(config, documents, device_kind=device_kind_of(q), dtype=q.dtype,
                                             resolve_backend=resolve_backend)
    kernel = ONE_CALL_KERNELS.get(name)
    return kernel if kernel is not None and kernel.one_call_takes(q) else None


def prefix_eligible(config: AttentionConfig, q, documents: bool) -> bool:
    """Whether the call may run as one varlen call per device (module docstring): static, its
    document blocks resolving to a backend of :data:`ONE_CALL_KERNELS` (``aten_varlen``, ``fa4``)
    on ``q``'s device and dtype whose kernel takes ``q`` (``one_call_takes``: its dtypes and head dims)."""
    return _one_call_kernel(config, q, documents) is not None


def prefix_plan(config: AttentionConfig, masks: ShardMasks | None, device: int, q, *,
                shard_major: bool) -> PrefixRuns | None:
    """The one-call plan of ring shard ``device``'s queries ``q`` [b, t, h, d] against every
    shard's keys (module docstring), or None (walk the blocks): the call is eligible
    (:func:`prefix_eligible`) and the plan exists (``seqplan.documents.prefix_runs``, remembered
    by content) within ``seqplan.documents.PREFIX_KEY_FACTOR`` times the keys. ``plan.key_index`` indexes the packed
    keys [R·b·t] of the gathered [R, b, t] (``shard_major``: the all-gather's order) or [b·R·t]
    (the global [b, T] in layout order: the replay)."""
    if masks is None or not prefix_eligible(config, q, masks.ids_host is not None):
        return None
    ids, positions = masks.ids_host, masks.positions if config.token_index else None  # None: the layout's
    ring, b, t = ids.shape if ids is not None else positions.shape
    return cached_plan(shard_prefix_runs, ids, positions, device=device, shard_major=shard_major,
                       layout=config.layout, max_keys=PREFIX_KEY_FACTOR * b * ring * t)


def prefix_forward(config: AttentionConfig, q, kv_packed, plan: PrefixRuns):
    """The device's (o, lse) as ONE varlen call against its gathered key prefixes:
    ``kv_packed`` = (k, v) [n, hk, d], every key of the sequence packed as ``plan`` indexes them."""
    return _one_call_kernel(config, q, True).prefix_forward(q, *kv_packed, plan, config.scale)


def prefix_backward(config: AttentionConfig, saved, kv_packed, plan: PrefixRuns):
    """The backward of :func:`prefix_forward` given ``saved = (q, o, lse, do)`` (the GLOBAL o, lse):
    (dq, dk, dv) with dk, dv float32 [n, hk, d] — every key's gradient from this device's rows."""
    q, o, lse, do = saved
    return _one_call_kernel(config, q, True).prefix_backward(do, q, *kv_packed, o, lse, plan, config.scale)


def _forward(q, k, v, groups, config: AttentionConfig, masks: ShardMasks):
    backend, (schedule, visits), me = config.backend(), _visits(groups, config), ring_index(groups)
    plan = prefix_plan(config, masks, me, q, shard_major=True) if schedule.size > 1 else None
    if plan is not None:  # one call against every key
        k_all, v_all = (config.comm.gather(x, groups[1]) for x in (k, v))
        packed = lambda x: x.reshape(-1, *x.shape[-2:])
        o, lse = prefix_forward(config, q, (packed(k_all), packed(v_all)), plan)
        return o, lse, (k_all, v_all)
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
    plan = prefix_plan(config, masks, me, q, shard_major=True) if schedule.size > 1 and dlse is None else None
    if plan is not None:
        packed = lambda x: x.reshape(-1, *x.shape[-2:])
        dq, dk_all, dv_all = prefix_backward(config, (q, o, lse, do), tuple(packed(x) for x in kv_all), plan)
        shards = lambda g: g.reshape(kv_all[0].shape)
        return dq, config.comm.scatter(shards(dk_all), groups[1]), config.comm.scatter(shards(dv_all), groups[1])
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
