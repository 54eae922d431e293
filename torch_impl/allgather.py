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

**Shared prefix** (``shared_tokens = P``, ``seqplan.shared``): when every token whose document
spans shards sits within its shard's first P positions (the per-document hybrid; checked on the
gathered ids, the same ``ValueError`` on every rank), only those K/V are gathered — R·P tokens,
issued asynchronously before the call's plans are made (P is static: the gather runs while the
host plans) and while the rank's queries [P, t) attend to its own keys (documents held
whole: no transfer) — then its queries [0, P) attend to the gathered prefixes; each part is one
varlen call on the one-call kernel (the portable kernel where there is none, or with an lse
cotangent), no merge (every query's keys lie in one part). The backward reduce-scatters the
prefixes' dK / dV only, computing that part first so the reduce-scatter runs while the local part
computes (issued after it, nothing would be left to hide it behind).
"""

from __future__ import annotations

from functools import partial

import torch

import seqplan.registry
from seqplan.documents import PREFIX_KEY_FACTOR, PrefixRuns, shard_prefix_runs
from seqplan.layouts import ring_positions
from seqplan.schedule import allgather_schedule, device_visits
from seqplan.shared import PART_MASK, SplitRuns, check_shared_call, check_shared_tokens, shared_extent, split_runs
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .block import device_kind_of, resolve_backend
from .comm import axis_size
from .config import AttentionConfig, make_config
from .kernels import fa4, varlen
from .kernels.reference import reference_block_bwd, reference_block_fwd
from .loop import ShardGrads, ShardMasks, attend_visits, attention_with_vjp, grad_visits, ring_index

F32 = torch.float32


def allgather_attention(q, k, v, group=None, *, segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                        causal: bool = False, layout: str = "zigzag",
                        scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None,
                        shared_tokens: int | None = None):
    """All-gather-KV attention over process group ``group`` (``None``: one rank). Inputs are this
    rank's ring shard in layout order; ``segment_ids`` (packed documents) this rank's local shard
    of the ids, [b, t/R] (see ``ring_attention``: gathered once, blocks without a shared
    document skipped); ``window``, ``sinks``, ``softcap`` and ``token_index`` ([b, t/R] or None) as in
    ``ring_attention`` (``sinks.grad``: this rank's contribution); ``shared_tokens``: gather only
    each shard's first ``shared_tokens`` K/V (module docstring; causal packed documents, no window
    or softcap). Returns ``(o, lse)``; differentiable through autograd."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None, shared_tokens=shared_tokens)
    check_shared_call(config, segment_ids is not None)
    config.backend()  # an unknown or refused kernel fails here, before any collective
    return _allgather(q, k, v, (None, group), config, segment_ids, sinks, token_index)


def _visits(groups, config: AttentionConfig):
    schedule = allgather_schedule(config.layout, config.schedule_causal, axis_size(groups[1]))
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
    return masks.plan(shard_prefix_runs, ids, positions, device=device, shard_major=shard_major,
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
    (schedule, visits), me = _visits(groups, config), ring_index(groups)
    if config.shared_tokens is not None and schedule.size > 1:  # only the shared prefixes travel
        prefixes = _gather_prefixes(config, k, v, groups)  # while this host plans
        return _split_forward(q, k, v, groups, config, masks, _split_plan(config, masks, me), prefixes)
    plan = prefix_plan(config, masks, me, q, shard_major=True) if schedule.size > 1 else None
    if plan is not None:  # one call against every key
        k_all, v_all = (config.comm.gather(x, groups[1]) for x in (k, v))
        packed = lambda x: x.reshape(-1, *x.shape[-2:])
        o, lse = prefix_forward(config, q, (packed(k_all), packed(v_all)), plan)
        return o, lse, (k_all, v_all)
    if schedule.size == 1:
        o, lse = attend_visits(q, config, schedule, masks, me, ((visit, (k, v)) for visit in visits))
        return o, lse, None
    (k_all, k_work), (v_all, v_work) = (config.comm.gather(x, groups[1], async_op=True) for x in (k, v))

    def gathered():  # own K/V first, while the K/V gather
        for visit in visits:
            if visit.step.local:
                yield visit, (k, v)
                k_work.wait()
                v_work.wait()
            else:
                yield visit, (k_all[visit.source], v_all[visit.source])

    o, lse = attend_visits(q, config, schedule, masks, me, gathered())
    return o, lse, (k_all, v_all)


def _backward(q, k, v, o, lse, kv_all, do, dlse, groups, config: AttentionConfig, masks: ShardMasks):
    (schedule, visits), me = _visits(groups, config), ring_index(groups)
    if config.shared_tokens is not None and schedule.size > 1:
        return _split_backward(q, k, v, o, lse, kv_all, do, dlse, groups, config, masks, _split_plan(config, masks, me))
    plan = prefix_plan(config, masks, me, q, shard_major=True) if schedule.size > 1 and dlse is None else None
    if plan is not None:
        packed = lambda x: x.reshape(-1, *x.shape[-2:])
        dq, dk_all, dv_all = prefix_backward(config, (q, o, lse, do), tuple(packed(x) for x in kv_all), plan)
        shards = lambda g: g.reshape(kv_all[0].shape)
        return dq, config.comm.scatter(shards(dk_all), groups[1]), config.comm.scatter(shards(dv_all), groups[1])
    resident = ((visit, (k, v) if visit.step.local else (kv_all[0][visit.source], kv_all[1][visit.source]))
                for visit in visits)
    start = lambda dk, dv, source: ShardGrads(schedule.size, dk, dv, source)
    dq, dkv = grad_visits((q, o, lse, do, dlse), config, schedule, masks, me, resident, start)
    if schedule.size == 1:
        return dq, *dkv
    return dq, config.comm.scatter(dkv.dk, groups[1]), config.comm.scatter(dkv.dv, groups[1])


_allgather = attention_with_vjp(_forward, _backward)


# ---- the shared prefix (module docstring; seqplan.shared) ----------------------------------------

def _split_plan(config: AttentionConfig, masks: ShardMasks, device: int) -> SplitRuns:
    """Ring shard ``device``'s two parts of a call with ``shared_tokens`` (``seqplan.shared.split_runs``,
    remembered by content). Refuses a ``shared_tokens`` the gathered ids break
    (``seqplan.shared.check_shared_tokens``: every rank sees the same ids)."""
    p, positions = config.shared_tokens, masks.positions if config.token_index else None
    if p > masks.ids_host.shape[2] or masks.plan(shared_extent, masks.ids_host) > p:
        check_shared_tokens(masks.ids_host, p)  # raises, naming the token
    return masks.plan(split_runs, masks.ids_host, positions, device=device, shared_tokens=p, layout=config.layout)


def _part_masks(config: AttentionConfig, masks: ShardMasks, device: int, p: int, t: int, shared: bool):
    """The portable kernel's (segments, positions) of one part — ``shared``: queries [0, p) against
    every shard's first ``p`` keys [b, R·p]; else queries [p, t) against the shard's own keys —
    each a (query, key) pair of int32 tensors. Built only when a part falls back to that kernel."""
    ids_all = masks.ids_all
    positions = masks.device_positions if config.token_index else None
    if positions is None:
        ring, b = ids_all.shape[:2]
        positions = torch.from_numpy(ring_positions(config.layout, ring, t)).to(ids_all.device)
        positions = positions[:, None, :].expand(ring, b, t).to(torch.int32)
    if shared:
        prefixes = lambda x: x[:, :, :p].transpose(0, 1).reshape(x.shape[1], -1)
        return (ids_all[device][:, :p], prefixes(ids_all)), (positions[device][:, :p], prefixes(positions))
    return (ids_all[device][:, p:], ids_all[device]), (positions[device][:, p:], positions[device])


def _kv_rows(kv_all, p: int):
    """Gathered prefixes [R, b, p, hk, d] -> [b, R·p, hk, d] (both parts' kernels take keys by row)."""
    return kv_all.transpose(0, 1).reshape(kv_all.shape[1], -1, *kv_all.shape[3:])


def _part_forward(config: AttentionConfig, q, kv, runs, part_masks):
    """(o, lse) of one part: ONE varlen call on the one-call kernel (``kv`` packed as ``runs``
    indexes them), else the portable kernel on ``kv`` unpacked ([b, s, hk, d]) under
    ``part_masks()`` (:func:`_part_masks`)."""
    kernel = _one_call_kernel(config, q, True)
    if kernel is not None and runs is not None:
        packed = tuple(x.reshape(-1, *x.shape[-2:]) for x in kv)
        return kernel.prefix_forward(q, *packed, runs, config.scale)
    return reference_block_fwd(q, *kv, PART_MASK, config.scale, *part_masks())


def _part_backward(config: AttentionConfig, saved, kv, runs, part_masks):
    """(dq, dk, dv) of one part, dk / dv float32 shaped as ``kv``; ``saved = (q, o, lse, do, dlse)``
    of the part's queries (the varlen backward takes no lse cotangent: the portable kernel then)."""
    q, o, lse, do, dlse = saved
    kernel = _one_call_kernel(config, q, True)
    if kernel is not None and runs is not None and dlse is None:
        packed = tuple(x.reshape(-1, *x.shape[-2:]) for x in kv)
        dq, dk, dv = kernel.prefix_backward(do, q, *packed, o, lse, runs, config.scale)
    else:
        dq, dk, dv = reference_block_bwd(do, q, *kv, o, lse, PART_MASK, config.scale, dlse, *part_masks())
    return dq, dk.float().reshape(kv[0].shape), dv.float().reshape(kv[1].shape)


def _gather_prefixes(config: AttentionConfig, k, v, groups):
    """Every shard's first ``p = config.shared_tokens`` K / V, gathered asynchronously: ((k_all, work), (v_all, work)), or
    None (``p`` 0, or past the shard: :func:`_split_plan` refuses that). Issued before the call's
    plans — it needs only ``shared_tokens``, which is static — so the gather runs while the host
    plans and the local part computes: the host was the short mix's step on 4x H200 (the GPU idle
    1.8–2.2 ms before this gather, docs/gpu/documents-2026-11-29-evening-h200x4.md)."""
    p = config.shared_tokens
    if not 0 < p <= k.shape[1]:
        return None
    return tuple(config.comm.gather(x[:, :p], groups[1], async_op=True) for x in (k, v))


def _split_forward(q, k, v, groups, config: AttentionConfig, masks: ShardMasks, split: SplitRuns, prefixes):
    me, p, t = ring_index(groups), split.shared_tokens, q.shape[1]
    shared_masks, local_masks = (partial(_part_masks, config, masks, me, p, t, shared) for shared in (True, False))
    parts = []
    if p < t:
        parts.append(_part_forward(config, q[:, p:].contiguous(), (k, v), split.local, local_masks))
    if not p:
        return *parts[0], ()
    (k_all, k_work), (v_all, v_work) = prefixes
    k_work.wait()
    v_work.wait()
    shared_kv = (_kv_rows(k_all, p), _kv_rows(v_all, p))
    parts.insert(0, _part_forward(config, q[:, :p].contiguous(), shared_kv, split.shared, shared_masks))
    o = torch.cat([o_part.to(q.dtype) for o_part, _ in parts], 1)
    return o, torch.cat([lse_part.float() for _, lse_part in parts], 2), (k_all, v_all)


def _split_backward(q, k, v, o, lse, kv_prefixes, do, dlse, groups, config: AttentionConfig, masks: ShardMasks,
                    split: SplitRuns):
    me, p, t = ring_index(groups), split.shared_tokens, q.shape[1]
    shared_masks, local_masks = (partial(_part_masks, config, masks, me, p, t, shared) for shared in (True, False))
    part = lambda x, lo, hi, dim=1: None if x is None else x.narrow(dim, lo, hi - lo).contiguous()
    saved = lambda lo, hi: (part(q, lo, hi), part(o, lo, hi), part(lse, lo, hi, 2), part(do, lo, hi),
                            part(dlse, lo, hi, 2))
    dq_parts, homes = [], ()
    if p:  # the prefixes' part first: their dK / dV travel home while the local part computes
        kv = tuple(_kv_rows(x, p) for x in kv_prefixes)
        dq_shared, dk_rows, dv_rows = _part_backward(config, saved(0, p), kv, split.shared, shared_masks)
        dq_parts.append(dq_shared)
        shards = lambda g: g.reshape(g.shape[0], -1, p, *g.shape[2:]).transpose(0, 1).contiguous()  # [R, b, p, ..]
        homes = tuple(config.comm.scatter(shards(g), groups[1], async_op=True) for g in (dk_rows, dv_rows))
    if p < t:  # every local key's gradient (float32); the prefixes' sums are added below
        dq_local, dk, dv = _part_backward(config, saved(p, t), (k, v), split.local, local_masks)
        dq_parts.append(dq_local)
    else:
        dk, dv = (torch.zeros(x.shape, dtype=F32, device=x.device) for x in (k, v))
    for d_local, (home, work) in zip((dk, dv), homes):
        work.wait()
        d_local[:, :p] += home
    # dq in the wider of its parts' dtypes (a fused part's is q's, the portable kernel's float32):
    # the caller casts it to q's dtype, so the result is the same bits as a float32 buffer's
    wide = F32 if any(d.dtype == F32 for d in dq_parts) else q.dtype
    return torch.cat([d.to(wide) for d in dq_parts], 1), dk, dv
