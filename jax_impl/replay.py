"""Every virtual device's work of a strategy, replayed on ONE device, device after device.

What a mesh of R·U devices would compute, computed on the one device the inputs live on: for each
virtual device, the block kernels, ``loop.merge_block`` / ``loop.grad_block``, casts and float32
accumulators of the real loops, walking :func:`schedule.device_visits` of the same
:class:`schedule.Schedule` the real loops walk (no re-derivation of which block meets which K/V);
only the communication is replaced — by indexing into the resident global arrays. It is the
check (and, one device at a time, the benchmark) of the per-device path when fewer devices are
present than the mesh needs, and it catches a kernel that is wrong only for some block kinds.

**Devices.** Virtual device ``device = r·U + u`` (ring coordinate r — o·I + i on a double ring —
and Ulysses coordinate u), as in ``api.py``. Its work is the attention of ring shard r (T/R
tokens of the layout-ordered sequence) for query-head group u (h/U heads) against every ring
shard's K/V of its KV-head group (with KV heads replicated up to U when kv_heads < U, as Ulysses
does). Ring, all-gather KV and the double ring are U = 1; Ulysses is R = 1; USP is both.

**Communication, replaced.** K/V hops and all-gathers: slicing ring shard ``visit.source`` of the
global K/V. dK/dV: each device returns its float32 contribution to every shard it visited; the
shard's total is summed in the order the real accumulator meets them (ring and double ring: in
step order, as it travels; all-gather: in device order, its reduce-scatter) and cast as the real
code casts (Ulysses-replicated heads: summed over replicas in float32, then cast).

    q: [b, T, h, d], k, v: [b, T, hk, d], segment_ids [b, T] or None (layout order),
    window None | w | (left, right), sinks [h] or None, softcap None | float, token_index [b, T] or None
                                                         ->  o [b, T, h, d], lse [b, h, T]
    device_forward -> (o [b, T/R, h/U, d], lse [b, h/U, T/R])
    device_backward -> (dq [b, T/R, h/U, d], {source shard: (dk, dv) [b, T/R, max(hk, U)/U, d] f32})
                       and, with sinks, a third item: dsinks [h/U] f32 of its rows and heads
    replay_attention_grads -> (dq, dk, dv), and with sinks (dq, dk, dv, dsinks [h] like sinks)

Token indices (``token_index`` [b, T] ints, layout order, or None: the static layout's): the
causal and window masks compare them instead of the layout's positions — one window on them
(``seqplan.schedule.token_index_window``) over the non-causal schedule, every block decided at run
time from each row's index range (``loop.under_masks``); how an explicit per-row layout such as
``seqplan.layouts.document_layout`` is replayed.

Windows: each visit's block decision (skip / with or without the window) is taken by the same
``loop`` functions from the same static positions (``loop.visit_masks``). Sinks enter after a
device's last merge (``loop.add_sinks``), and its share of their gradient is ``loop.sinks_grad``
over its rows; the replay sums the shares in device order (the mesh: shard_map's transpose).

:func:`device_forward` / :func:`device_backward` are one device's work alone (jit them with the
device static to time it); :func:`replay_attention` / :func:`replay_attention_grads` run all of
them and assemble global outputs in layout order.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from seqplan.config import replay_config
from seqplan.schedule import Schedule, device_visits, summation_order
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

from .allgather import portable_config, prefix_backward, prefix_eligible, prefix_forward, prefix_plan
from .config import AttentionConfig
from .loop import GradDtypes, add_sinks, grad_block, local_backward, local_forward, merge_block, sinks_grad, visit_masks

F32 = jnp.float32


# The call's config (seqplan.config.replay_config: for_call with this framework's hook)
_config = partial(replay_config, AttentionConfig)






def _steps(group):
    """The (round, inner step) of each visit of a group, int32 [n, 2]: the scan's input."""
    return jnp.asarray([(v.step.round, v.step.inner) for v in group], jnp.int32)


def _scanned_visit(at, schedule: Schedule, config: AttentionConfig, r: int, kv, ring: int, kv_heads, dtype, ids,
                   token_index):
    """(K/V shard, mask keywords) of device r's visit at the traced ``at = (round, inner)``."""
    source = schedule.source(r, at[0], at[1])
    shard = tuple(_dynamic_shard(x, source, ring, kv_heads).astype(dtype) for x in kv)
    return shard, _masks(config, schedule, ids, r, (at[0], at[1]), kv[0].shape[1], token_index)


def _visit(visit, schedule: Schedule, config: AttentionConfig, r: int, kv, ring: int, kv_heads, dtype, ids,
           token_index):
    """(K/V shard, mask keywords) of device r's visit ``visit`` (static: :func:`_scanned_visit`'s twin)."""
    shard = tuple(ring_shard(x, visit.source, ring, kv_heads).astype(dtype) for x in kv)
    return shard, _masks(config, schedule, ids, r, (visit.step.round, visit.step.inner), kv[0].shape[1], token_index)


def _masks(config: AttentionConfig, schedule: Schedule, ids, r: int, step, seq: int, token_index=None) -> dict:
    """The run-time mask keywords of device r's visit at ``step = (round, inner)`` (ints or traced):
    the real loops' ``loop.visit_masks``,
    given the global ids [b, T] (layout order: what the real loops gather) or None, and the global
    token indices [b, T] or None."""
    ids = None if ids is None else ids.astype(jnp.int32)
    index = None if token_index is None else token_index.astype(jnp.int32)
    return visit_masks(schedule, config, ids, r, *step, seq // schedule.size, index)


def _dynamic_shard(x, r, size: int, heads: slice | None = None):
    """:func:`_shard` for a traced shard index ``r`` (K/V: axis 1, heads on axis 2)."""
    t = x.shape[1] // size
    x = lax.dynamic_slice_in_dim(x, r * t, t, axis=1)
    return x if heads is None else x[:, :, heads]


def _visit_groups(visits, scanned: bool):
    """The visits in order, consecutive visits of one block off the device's own shard grouped
    when ``scanned`` (then each group of two or more runs as one ``lax.scan``, as the real loops
    run a ring's steps: the block's kernels are compiled once, not once per visit), else each
    visit alone."""
    groups: list[list] = []
    for visit in visits:
        joins = (scanned and groups and not visit.step.local and visit.block is not None
                 and not groups[-1][0].step.local and groups[-1][0].block == visit.block)
        if joins:
            groups[-1].append(visit)
        else:
            groups.append([visit])
    return groups


def _alone_dtype(visits, dtype):
    """``loop.alone_dtype`` of one device's visits: ``dtype`` when its own block is its only one."""
    return dtype if all(v.step.local or v.block is None for v in visits) else F32


def device_forward(device: int, q, k, v, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                   segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """Virtual device ``device``'s forward on the global q, k, v (and segment ids, window, sinks
    [h], softcap): its (o, lse), o in q's dtype, lse with the sinks of its heads (shapes in the module
    docstring)."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    backend = config.backend()
    schedule = strategy.replay_schedule(config, q.shape[1])
    r, u = divmod(device, strategy.ulysses)
    q_heads, kv_heads, _ = strategy.head_groups(q.shape[2], k.shape[2], u)
    q_d = ring_shard(q, r, strategy.ring, q_heads)
    visits = device_visits(schedule, r)
    o_dtype = _alone_dtype(visits, q.dtype)

    def walk(backend):
        o = lse = None
        for group in _visit_groups(visits, scanned=token_index is not None):
            if len(group) > 1:  # one block over several visiting shards: one scanned body
                def step(state, at, block=group[0].block):
                    kv, masks = _scanned_visit(at, schedule, config, r, (k, v), strategy.ring, kv_heads, q.dtype,
                                               segment_ids, token_index)
                    return merge_block(backend, config.scale, q_d, block, kv, state, **masks), None

                (o, lse), _ = lax.scan(step, (o, lse), _steps(group))
                continue
            visit = group[0]
            kv, masks = _visit(visit, schedule, config, r, (k, v), strategy.ring, kv_heads, q.dtype, segment_ids,
                               token_index)
            if visit.step.local:
                o, lse = local_forward(backend, config.scale, q_d, kv, visit.block.mask, out_dtype=o_dtype, **masks)
            elif visit.block is not None:
                o, lse = merge_block(backend, config.scale, q_d, visit.block, kv, (o, lse), **masks)
        return o, lse

    if _one_call(strategy, config, q_d, segment_ids):  # all-gather-KV's one varlen call (allgather.prefix_forward)
        plans = prefix_plan(config, q_d, _int32(segment_ids), _int32(token_index), r)
        o, lse = prefix_forward(config, q_d, _kv_heads((k, v), kv_heads, q.dtype), plans,
                                lambda: walk(portable_config(config).backend()))
    else:
        o, lse = walk(backend)
    o, lse = add_sinks(o, lse, None if sinks is None else sinks[q_heads])
    return o.astype(q.dtype), lse


def device_backward(device: int, q, k, v, o, lse, do, dlse=None, *, strategy: Strategy, causal: bool = False,
                    layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                    deterministic: bool = False, segment_ids=None, window=None, sinks=None, softcap=None,
                    token_index=None):
    """Virtual device ``device``'s backward, given the global o, lse (the forward's outputs), do
    and optional dlse: a ``seqplan.strategy.DeviceGrads`` — dq in q's dtype, {source shard: (dk, dv)
    contributions, float32 — q's dtype where the device's own block is its only one} and, with
    ``sinks``, its rows' share of dsinks for its heads ([h/U] float32), else None."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    backend = config.backend()
    schedule = strategy.replay_schedule(config, q.shape[1])
    r, u = divmod(device, strategy.ulysses)
    q_heads, kv_heads, _ = strategy.head_groups(q.shape[2], k.shape[2], u)
    mine = [ring_shard(x, r, strategy.ring, q_heads) for x in (q, o, do)]
    lse_d, dlse_d = (None if x is None else ring_shard(x, r, strategy.ring, q_heads, head_axis=1) for x in (lse, dlse))
    saved = (mine[0], mine[1], lse_d, mine[2], dlse_d)
    visits = device_visits(schedule, r)
    alone = _alone_dtype(visits, q.dtype)  # replicated KV heads: their copies' dK / dV are summed below in float32
    grad_dtypes = GradDtypes(alone, F32 if strategy.head_groups(q.shape[2], k.shape[2], u)[2] else alone)

    def walk(backend):
        dq, contributions = None, {}
        for group in _visit_groups(visits, scanned=token_index is not None):
            if len(group) > 1:  # one block over several visiting shards: one scanned body
                def step(dq, at, block=group[0].block):
                    kv, masks = _scanned_visit(at, schedule, config, r, (k, v), strategy.ring, kv_heads, q.dtype,
                                               segment_ids, token_index)
                    zeros = jnp.zeros(kv[0].shape, F32)
                    dq, dk, dv = grad_block(backend, config.scale, saved, block, kv, (dq, zeros, zeros), **masks)
                    return dq, (dk, dv)

                dq, (dks, dvs) = lax.scan(step, dq, _steps(group))
                for n, visit in enumerate(group):
                    contributions[visit.source] = (dks[n], dvs[n])
                continue
            visit = group[0]
            kv, masks = _visit(visit, schedule, config, r, (k, v), strategy.ring, kv_heads, q.dtype, segment_ids,
                               token_index)
            if visit.step.local:
                dq, dk, dv = local_backward(backend, config.scale, saved, kv, visit.block.mask, grad_dtypes=grad_dtypes,
                                            **masks)
                contributions[visit.source] = (dk, dv)
            elif visit.block is not None:
                zeros = jnp.zeros(kv[0].shape, F32)
                dq, dk, dv = grad_block(backend, config.scale, saved, visit.block, kv, (dq, zeros, zeros), **masks)
                contributions[visit.source] = (dk, dv)
        return dq, contributions

    if dlse is None and _one_call(strategy, config, mine[0], segment_ids):  # every shard's dK / dV from one call
        def walked():  # the fallback, as one [b, T] pair of float32 accumulators like the one call's
            dq, parts = walk(portable_config(config).backend())
            t = q.shape[1] // strategy.ring
            whole = [jnp.zeros((k.shape[0], q.shape[1], *parts[r][0].shape[2:]), F32) for _ in range(2)]
            for src, grads in parts.items():
                whole = [lax.dynamic_update_slice_in_dim(w, g.astype(F32), src * t, axis=1) for w, g in zip(whole, grads)]
            return dq, *whole

        # a program of its own here, so the plans are made again (the real backward keeps the forward's)
        plans = prefix_plan(config, mine[0], _int32(segment_ids), _int32(token_index), r)
        dq, dk, dv = prefix_backward(config, tuple(saved[:4]), _kv_heads((k, v), kv_heads, q.dtype), plans, walked)
        t = q.shape[1] // strategy.ring
        contributions = {src: (dk[:, src * t:(src + 1) * t], dv[:, src * t:(src + 1) * t])
                         for src in range(strategy.ring)}
    else:
        dq, contributions = walk(backend)
    dsinks = None if sinks is None else sinks_grad(mine[1], lse_d, mine[2], dlse_d, sinks[q_heads])
    return DeviceGrads(dq.astype(q.dtype), contributions, dsinks)


def one_call_plan(device: int, q, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                  scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                  segment_ids=None, window=None, softcap=None, token_index=None):
    """The ``seqplan.documents.PrefixRuns`` virtual device ``device`` runs as all-gather-KV's one
    varlen call, or None when it walks the blocks — for reports, on the host from concrete ids
    and token indices: the call is eligible (``allgather.prefix_eligible``) and the plan fits
    ``kernels/runs``' bounds (which the program itself decides on the device)."""
    from seqplan.documents import PREFIX_KEY_FACTOR, shard_prefix_runs

    from .kernels import runs

    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    r = device // strategy.ulysses
    if not _one_call(strategy, config, ring_shard(q, r, strategy.ring), segment_ids):
        return None
    b, seq = q.shape[:2]
    ring, t = strategy.ring, seq // strategy.ring
    shards = lambda x: None if x is None else np.moveaxis(np.asarray(x, np.int32).reshape(b, ring, t), 1, 0)
    plan = shard_prefix_runs(shards(segment_ids), shards(token_index), device=r, shard_major=False,
                             layout=config.layout, max_keys=PREFIX_KEY_FACTOR * b * seq)
    fits = plan is not None and len(plan.cu_q) - 1 <= max(max(runs.PREFIX_SLOTS), b)
    return plan if fits else None


def _one_call(strategy: Strategy, config: AttentionConfig, q_d, segment_ids) -> bool:
    """Whether the virtual device runs all-gather-KV's one varlen call (``allgather.prefix_eligible``)."""
    return (strategy.kv_exchange == "allgather" and strategy.ring > 1
            and prefix_eligible(config, q_d, segment_ids is not None))


def _kv_heads(kv, heads: slice, dtype):
    """The global k, v [b, T, ., d] of ``heads`` in ``dtype`` (the one call's gathered K/V)."""
    return tuple(x[:, :, heads].astype(dtype) for x in kv)


def _int32(x):
    return None if x is None else x.astype(jnp.int32)


def _check(q, k, v, strategy: Strategy, layout: str, scale, segment_ids, window, sinks, softcap,
           token_index=None) -> None:
    validate(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), strategy.mesh_sizes(),
             layout=layout, kv_exchange=strategy.kv_exchange, scale=scale)
    check_segment_ids(*shape_and_dtype(segment_ids), q.shape)
    check_token_index(*shape_and_dtype(token_index), q.shape)
    if token_index is not None and not isinstance(token_index, jax.core.Tracer):  # tracers: no values to see
        check_token_index_range(int(token_index.min()), int(token_index.max()), q.shape[1])
    check_window(window)
    check_softcap(softcap)
    check_sinks(*shape_and_dtype(sinks), q.shape[2])


def replay_attention(q, k, v, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                     scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                     segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """(o, lse) of ``strategy`` on global q, k, v (and segment ids, window, sinks, softcap) in layout
    order, every virtual device's forward run in turn on the inputs' device (module docstring)."""
    _check(q, k, v, strategy, layout, scale, segment_ids, window, sinks, softcap, token_index)
    kw = dict(strategy=strategy, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
              deterministic=deterministic, segment_ids=segment_ids, window=window, sinks=sinks, softcap=softcap,
              token_index=token_index)
    outs = [device_forward(d, q, k, v, **kw) for d in range(strategy.devices)]
    rows = [outs[r * strategy.ulysses:(r + 1) * strategy.ulysses] for r in range(strategy.ring)]
    o = jnp.concatenate([jnp.concatenate([o_d for o_d, _ in row], axis=2) for row in rows], axis=1)
    lse = jnp.concatenate([jnp.concatenate([lse_d for _, lse_d in row], axis=1) for row in rows], axis=2)
    return o, lse


def replay_attention_grads(q, k, v, o, lse, do, dlse=None, *, strategy: Strategy, causal: bool = False,
                           layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                           deterministic: bool = False, segment_ids=None, window=None, sinks=None,
                           softcap=None, token_index=None):
    """(dq, dk, dv) of ``strategy`` for cotangents ``do`` (and ``dlse``, None: lse unused), given
    the forward's global o and lse; every virtual device's backward run in turn, dK/dV summed as
    the real exchange sums them. dq like q, dk and dv like k. With ``sinks`` [h]: (dq, dk, dv,
    dsinks), dsinks [h] like sinks — every device's share of its heads, summed in device order."""
    _check(q, k, v, strategy, layout, scale, segment_ids, window, sinks, softcap, token_index)
    kw = dict(strategy=strategy, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
              deterministic=deterministic, segment_ids=segment_ids, window=window, sinks=sinks, softcap=softcap,
              token_index=token_index)
    n_ring, n_uly = strategy.ring, strategy.ulysses
    outs = [device_backward(d, q, k, v, o, lse, do, dlse, **kw) for d in range(strategy.devices)]
    dq = jnp.concatenate([jnp.concatenate([outs[r * n_uly + u].dq for u in range(n_uly)], axis=2)
                          for r in range(n_ring)], axis=1)
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
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                # The real attention hands back dK/dV in the K/V dtype it was given: float32 for
                # Ulysses-replicated heads (summed below), the caller's dtype otherwise.
                groups.append(total.astype(F32) if replicated else total.astype(k.dtype))
            shards.append(jnp.concatenate(groups, axis=2))  # [b, T/R, hk·reps or hk, d]
        full = jnp.concatenate(shards, axis=1)
        if replicated:  # each KV head's replicas, summed in float32 (ulysses.gather_kv_heads)
            b, t, n, d = full.shape
            full = full.reshape(b, t, k.shape[2], n // k.shape[2], d).sum(3).astype(k.dtype)
        grads.append(full)
    if sinks is None:
        return dq, grads[0], grads[1]
    dsinks = jnp.zeros(sinks.shape, F32)
    for d in range(strategy.devices):
        dsinks = dsinks.at[strategy.head_groups(q.shape[2], k.shape[2], d % n_uly)[0]].add(outs[d].dsinks)
    return dq, grads[0], grads[1], dsinks.astype(sinks.dtype)
