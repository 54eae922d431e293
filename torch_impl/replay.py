"""Every virtual device's work of a strategy, replayed on ONE device, device after device.

The mirror of ``jax_impl/replay.py`` (read its docstring): for each virtual device of a mesh of
R·U, the real loops' own walk bodies (``loop.attend_visits`` / ``loop.grad_visits``: their
kernels, merges, casts and float32 accumulators) over :func:`schedule.device_visits` of the same
:class:`schedule.Schedule`; only the communication is replaced — K/V indexed from the resident
global tensors, dK/dV kept per source shard (``loop.ShardGrads``, as all-gather KV keeps them).
The contributions are summed in the order the real exchange sums them (ring and double ring: step
order; all-gather: device order) and cast as the real code casts them. Packed documents
(``segment_ids``, GLOBAL ids like the global q, unlike the real torch entry points' local shards):
each virtual device reads its ring shard's ids and the visited shard's, and the same ``loop``
functions decide per block to skip it, run it plain or with the document mask — so a skipped block
contributes nothing (a zero) here, as in the real loops. A ``window`` builds the same per-call
:class:`loop.ShardMasks` (every shard's original positions) the real loops build, so the same
blocks are skipped or windowed. ``sinks`` ([h], the full tensor) are merged into each virtual
device's final (o, lse) of its head block, as the real autograd Function does; the backward then
also returns dsinks, the SUM of every virtual device's contribution (what summing ``sinks.grad``
over a world's ranks gives).

Token indices (``token_index`` [b, T] ints, layout order, or None: the static layout's): the
causal and window masks compare them instead of the layout's positions — one window on them
(``seqplan.schedule.token_index_window``) over the non-causal schedule, every block decided from
each row's index range (``loop.ShardMasks``); how an explicit per-row layout such as
``seqplan.layouts.document_layout`` is replayed.

    q: [b, T, h, d], k, v: [b, T, hk, d], segment_ids [b, T] or None (layout order), sinks [h] or None,
    softcap None or a float, token_index [b, T] or None
                                                         ->  o [b, T, h, d], lse [b, h, T]
    device_forward -> (o [b, T/R, h/U, d], lse [b, h/U, T/R])
    device_backward -> (dq [b, T/R, h/U, d], {source shard: (dk, dv) [b, T/R, max(hk, U)/U, d] f32})
                       and with sinks, + (dsinks [h/U] float32: this device's contribution, its heads)
"""

from __future__ import annotations

from functools import partial

import torch

from seqplan.config import replay_config
from seqplan.schedule import device_visits, summation_order
from seqplan.strategy import DeviceGrads, Strategy, ring_shard
from seqplan.validation import (
    check_segment_ids,
    check_sinks,
    check_softcap,
    check_token_index,
    check_token_index_range,
    check_window,
    dtype_name,
    shape_and_dtype,
    validate,
)

from .allgather import prefix_backward, prefix_forward, prefix_plan
from .config import AttentionConfig
from .loop import ShardGrads, ShardMasks, as_dtype, attend_visits, finish_output, grad_visits, sinks_grad

F32 = torch.float32


# The call's config (seqplan.config.replay_config: for_call with this framework's hook)
_config = partial(replay_config, AttentionConfig)






def _masks(config: AttentionConfig, segment_ids, ring: int, seq: int, device, token_index=None) -> ShardMasks:
    """The call's :class:`loop.ShardMasks` from the GLOBAL [b, T] ids (int32 and split into ring
    shards [R, b, T/R], as the real loops gather them) and ``config.window``."""
    ids_all = None
    if segment_ids is not None:
        ids = segment_ids.to(torch.int32)
        ids_all = ids.reshape(ids.shape[0], ring, seq // ring).movedim(1, 0)
    index_all = None
    if token_index is not None:
        index_all = token_index.to(torch.int32).reshape(token_index.shape[0], ring, seq // ring).movedim(1, 0)
    return ShardMasks.build(config, ring, seq // ring, ids_all, device, index_all)


def device_forward(device: int, q, k, v, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                   segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """Virtual device ``device``'s forward on the global q, k, v (and global ``segment_ids``
    [b, T] or None, ``window``, the full ``sinks`` [h] or None): its (o, lse), o in q's dtype —
    ``loop.attend_visits`` over its visits with every shard resident."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    schedule = strategy.replay_schedule(config, q.shape[1])
    masks = _masks(config, segment_ids, strategy.ring, q.shape[1], q.device, token_index)
    r, u = divmod(device, strategy.ulysses)
    q_heads, kv_heads, _ = strategy.head_groups(q.shape[2], k.shape[2], u)
    q_d = ring_shard(q, r, strategy.ring, q_heads)
    plan = _prefix_plan(strategy, config, masks, r, q_d)
    with torch.no_grad():
        if plan is not None:  # all-gather-KV's one call against every key (allgather.prefix_plan)
            o, lse = prefix_forward(config, q_d, _packed_kv((k, v), kv_heads, q.dtype), plan)
        else:
            o, lse = attend_visits(q_d, config, schedule, masks, r, _resident(schedule, r, (k, v), strategy, kv_heads,
                                                                               q.dtype))
        return finish_output(o, lse, None if sinks is None else sinks[q_heads], q.dtype)


def _resident(schedule, r: int, kv, strategy: Strategy, kv_heads: slice, dtype):
    """(visit, K/V of its source shard) of device r's visits: every shard resident, nothing sent."""
    for visit in device_visits(schedule, r):
        yield visit, tuple(ring_shard(x, visit.source, strategy.ring, kv_heads).to(dtype) for x in kv)


def device_backward(device: int, q, k, v, o, lse, do, dlse=None, *, strategy: Strategy, causal: bool = False,
                    layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                    deterministic: bool = False, segment_ids=None, window=None, sinks=None, softcap=None,
                    token_index=None):
    """Virtual device ``device``'s backward, given the global o, lse (the forward's outputs), do
    and optional dlse: a ``seqplan.strategy.DeviceGrads`` — dq in q's dtype, {source shard: (dk, dv)
    contributions, float32} for every shard (zero where it computed no block: masked, or skipped for
    documents or the window) and, with ``sinks``, this device's dsinks [h/U] float32 (its heads,
    its rows), else None. ``loop.grad_visits`` over its visits with every shard resident and
    their dK / dV kept apart (``loop.ShardGrads``, as all-gather KV keeps them)."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    schedule = strategy.replay_schedule(config, q.shape[1])
    masks = _masks(config, segment_ids, strategy.ring, q.shape[1], q.device, token_index)
    r, u = divmod(device, strategy.ulysses)
    q_heads, kv_heads, _ = strategy.head_groups(q.shape[2], k.shape[2], u)
    q_d, o_d, do_d = (ring_shard(x, r, strategy.ring, q_heads) for x in (q, o, do))
    lse_d, dlse_d = (None if x is None else ring_shard(x, r, strategy.ring, q_heads, head_axis=1) for x in (lse, dlse))
    saved = (q_d, o_d, lse_d, do_d, dlse_d)
    plan = _prefix_plan(strategy, config, masks, r, q_d) if dlse is None else None
    with torch.no_grad():
        if plan is not None:  # all-gather-KV's one call: every shard's dK / dV from it
            dq, dk, dv = prefix_backward(config, (q_d, o_d, lse_d, do_d), _packed_kv((k, v), kv_heads, q.dtype), plan)
            dq, shards = dq.float(), lambda g: g.reshape(q.shape[0], strategy.ring, -1, *g.shape[1:])
            contributions = {src: (shards(dk)[:, src], shards(dv)[:, src]) for src in range(strategy.ring)}
        else:  # every shard's dK / dV kept apart (ShardGrads, as all-gather KV keeps them)
            start = lambda dk, dv, source: ShardGrads(strategy.ring, dk, dv, source)
            visits = _resident(schedule, r, (k, v), strategy, kv_heads, q.dtype)
            dq, dkv = grad_visits(saved, config, schedule, masks, r, visits, start)
            if schedule.size == 1:  # float32 like the per-shard sums (the step model counts these casts)
                dq, contributions = dq.float(), {r: tuple(x.float() for x in dkv)}
            else:
                contributions = {src: tuple(dkv.current(src)) for src in range(strategy.ring)}
        dsinks = None if sinks is None else sinks_grad(o_d, lse_d, do_d, dlse_d, sinks[q_heads])
    return DeviceGrads(as_dtype(dq, q.dtype), contributions, dsinks)


def one_call_plan(device: int, q, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                  scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                  segment_ids=None, window=None, softcap=None, token_index=None):
    """The ``seqplan.documents.PrefixRuns`` virtual device ``device`` runs as all-gather-KV's one
    varlen call (``allgather.prefix_plan``), or None when it walks the blocks — for reports."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    masks = _masks(config, segment_ids, strategy.ring, q.shape[1], q.device, token_index)
    r = device // strategy.ulysses
    return _prefix_plan(strategy, config, masks, r, ring_shard(q, r, strategy.ring))


def _prefix_plan(strategy: Strategy, config: AttentionConfig, masks: ShardMasks, r: int, q_d):
    """All-gather-KV's one-call plan of device ``r`` (``allgather.prefix_plan``; keys in the global
    [b, T] layout order), or None: any other exchange, or a call that walks the blocks."""
    if strategy.kv_exchange != "allgather" or strategy.ring == 1:
        return None
    return prefix_plan(config, masks, r, q_d, shard_major=False)


def _packed_kv(kv, heads: slice, dtype):
    """The global k, v [b, T, hk, d] of ``heads`` in ``dtype``, packed [b·T, hk', d] (the one call's keys)."""
    return tuple(y.reshape(-1, *y.shape[2:]) for y in (x[:, :, heads].to(dtype) for x in kv))


def _check(q, k, v, strategy: Strategy, layout: str, scale, segment_ids, window, sinks, softcap,
           token_index=None) -> None:
    validate(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), strategy.mesh_sizes(),
             layout=layout, kv_exchange=strategy.kv_exchange, scale=scale)
    check_segment_ids(None if segment_ids is None else segment_ids.shape,
                      None if segment_ids is None else dtype_name(segment_ids.dtype), q.shape)
    check_token_index(*shape_and_dtype(token_index), q.shape)
    if token_index is not None:
        check_token_index_range(int(token_index.min()), int(token_index.max()), q.shape[1])
    check_window(window)
    check_softcap(softcap)
    check_sinks(*shape_and_dtype(sinks), q.shape[2])


def replay_attention(q, k, v, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                     scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                     segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """(o, lse) of ``strategy`` on global q, k, v in layout order (``segment_ids``: packed
    documents, the global [b, T] ids in layout order, or None; ``window``; ``sinks`` [h] or
    None; ``softcap``), every virtual device's forward run in turn on the inputs' device."""
    _check(q, k, v, strategy, layout, scale, segment_ids, window, sinks, softcap, token_index)
    kw = dict(strategy=strategy, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
              deterministic=deterministic, segment_ids=segment_ids, window=window, sinks=sinks, softcap=softcap,
              token_index=token_index)
    outs = [device_forward(d, q, k, v, **kw) for d in range(strategy.devices)]
    rows = [outs[r * strategy.ulysses:(r + 1) * strategy.ulysses] for r in range(strategy.ring)]
    o = torch.cat([torch.cat([o_d for o_d, _ in row], dim=2) for row in rows], dim=1)
    lse = torch.cat([torch.cat([lse_d for _, lse_d in row], dim=1) for row in rows], dim=2)
    return o, lse


def replay_attention_grads(q, k, v, o, lse, do, dlse=None, *, strategy: Strategy, causal: bool = False,
                           layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                           deterministic: bool = False, segment_ids=None, window=None, sinks=None, softcap=None,
                           token_index=None):
    """(dq, dk, dv) of ``strategy`` for cotangents ``do`` (and ``dlse``, None: lse unused), given
    the forward's global o and lse (and the forward's global ``segment_ids`` [b, T], ``window``
    and ``sinks``, ``softcap``); dK/dV summed as the real exchange sums them. With ``sinks``: (dq, dk, dv,
    dsinks), dsinks [h] in sinks' dtype the sum of every virtual device's contribution (device
    order) — the full gradient, what summing each rank's ``sinks.grad`` over a world gives."""
    _check(q, k, v, strategy, layout, scale, segment_ids, window, sinks, softcap, token_index)
    kw = dict(strategy=strategy, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
              deterministic=deterministic, segment_ids=segment_ids, window=window, sinks=sinks, softcap=softcap,
              token_index=token_index)
    n_ring, n_uly = strategy.ring, strategy.ulysses
    outs = [device_backward(d, q, k, v, o, lse, do, dlse, **kw) for d in range(strategy.devices)]
    dq = torch.cat([torch.cat([outs[r * n_uly + u].dq for u in range(n_uly)], dim=2) for r in range(n_ring)], dim=1)
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    schedule = strategy.replay_schedule(config, q.shape[1])
    replicated = strategy.head_groups(q.shape[2], k.shape[2], 0)[2]
    grads = []
    for which in (0, 1):  # dk, dv
        shards = []
        for s in range(n_ring):
            groups = []
            for u in range(n_uly):
                parts = [outs[r * n_uly + u].contributions.get(s) for r in summation_order(schedule, s)]
                parts = [p[which] for p in parts if p is not None]
                total = parts[0].clone()
                for part in parts[1:]:
                    total.add_(part)
                # The real attention hands back dK/dV in the K/V dtype it was given: float32 for
                # Ulysses-replicated heads (summed below), the caller's dtype otherwise.
                groups.append(total if replicated else total.to(k.dtype))
            shards.append(torch.cat(groups, dim=2))  # [b, T/R, hk·reps or hk, d]
        full = torch.cat(shards, dim=1)
        if replicated:  # each KV head's replicas, summed in float32 (ulysses.gather_kv_heads)
            b, t, n, d = full.shape
            full = full.reshape(b, t, k.shape[2], n // k.shape[2], d).sum(3).to(k.dtype)
        grads.append(full)
    if sinks is None:
        return dq, grads[0], grads[1]
    dsinks = torch.zeros(sinks.shape, dtype=F32, device=sinks.device)
    for d, out in enumerate(outs):
        dsinks[strategy.head_groups(q.shape[2], k.shape[2], d % n_uly)[0]] += out.dsinks
    return dq, grads[0], grads[1], dsinks.to(sinks.dtype)
