"""Every virtual device's work of a strategy, replayed on ONE device, device after device.

What a mesh of R·U devices would compute, computed on the one device the inputs live on: for each
virtual device, the real loops' own walk (``loop.walk`` over the same :class:`schedule.Schedule`,
with ``loop.forward_visit`` / ``loop.backward_visit``: their kernels, merges and casts, float32
accumulators throughout — the mesh's halo schedule keeps only its halo rows in float32, with the
same values, ``merge.Float32Rows``); only the communication is replaced — K/V sliced from the resident global arrays
(``loop.resident_kv``), dK / dV kept per source shard (``loop.per_shard_accumulation``). It is the
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
    device_backward -> (dq [b, T/R, h/U, d], {every shard: (dk, dv) [b, T/R, max(hk, U)/U, d] f32})
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

from seqplan.config import replay_config
from seqplan.schedule import summation_order
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

from .allgather import (
    gathered_masks,
    portable_backward,
    portable_forward,
    prefix_backward,
    prefix_eligible,
    prefix_forward,
    prefix_plan,
)
from .comm import Comm
from .config import AttentionConfig, deterministic_kernels
from .loop import (
    GradDtypes,
    add_sinks,
    alone_dtype,
    backward_visit,
    forward_visit,
    per_shard_accumulation,
    resident_kv,
    shard_of,
    sinks_grad,
    walk,
)

F32 = jnp.float32


# The call's config (seqplan.config.replay_config: for_call with this framework's hook)
_config = partial(replay_config, AttentionConfig)


class _Resident(Comm):
    """The replay's transfers: none. Every shard's K/V are resident (the global arrays, sliced by
    ``loop.resident_kv``), so a hop moves nothing and the walk carries nothing."""

    def shift(self, tree, hop, axes, back: int = 0):
        return tree


_RESIDENT = _Resident()


# The walk scans a block's consecutive visits only with token indices (as the former replay did):
# their blocks' varlen forms are many, and a scan compiles them once per block when the device's
# work is jitted; otherwise every visit runs inline with concrete steps — eagerly, a scan or a
# lax.cond would be compiled on every call.


def _device(device: int, q, k, v, strategy: Strategy, config: AttentionConfig):
    """(schedule, ring coordinate r, query heads, whether its KV heads are replicated, tokens per
    shard, the K/V of its KV heads [b, T, ., d] in q's dtype, as the device holds them after every hop)."""
    schedule = strategy.replay_schedule(config, q.shape[1])
    r, u = divmod(device, strategy.ulysses)
    q_heads, kv_heads, replicated = strategy.head_groups(q.shape[2], k.shape[2], u)
    return schedule, r, q_heads, replicated, q.shape[1] // strategy.ring, _kv_heads((k, v), kv_heads, q.dtype)


def device_forward(device: int, q, k, v, *, strategy: Strategy, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, block_backend: str = "auto", deterministic: bool = False,
                   segment_ids=None, window=None, sinks=None, softcap=None, token_index=None):
    """Virtual device ``device``'s forward on the global q, k, v (and segment ids, window, sinks
    [h], softcap): its (o, lse), o in q's dtype, lse with the sinks of its heads (shapes in the module
    docstring) — ``loop.walk`` over the schedule with ``loop.forward_visit``, the K/V resident."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    schedule, r, q_heads, _, t, kv_all = _device(device, q, k, v, strategy, config)
    q_d = ring_shard(q, r, strategy.ring, q_heads)

    def walked(cfg: AttentionConfig):
        visit = forward_visit(q_d, cfg, schedule, r, t, _int32(segment_ids), _int32(token_index),
                              kv_of=resident_kv(kv_all, schedule, r, t))
        return walk(schedule, None, None, visit, comm=_RESIDENT, axes=None, scan=token_index is not None)

    if _one_call(strategy, config, q_d, segment_ids):  # all-gather-KV's one varlen call (allgather.prefix_forward)
        plans = prefix_plan(config, q_d, _int32(segment_ids), _int32(token_index), r)
        masks = gathered_masks(config, q_d, _int32(segment_ids), _int32(token_index), r)
        o, lse = prefix_forward(config, q_d, kv_all, plans, lambda: portable_forward(config, q_d, kv_all, masks))
    else:
        o, lse = walked(config)
    o, lse = add_sinks(o, lse, None if sinks is None else sinks[q_heads])
    return o.astype(q.dtype), lse


def device_backward(device: int, q, k, v, o, lse, do, dlse=None, *, strategy: Strategy, causal: bool = False,
                    layout: str = "zigzag", scale: float | None = None, block_backend: str = "auto",
                    deterministic: bool = False, segment_ids=None, window=None, sinks=None, softcap=None,
                    token_index=None):
    """Virtual device ``device``'s backward, given the global o, lse (the forward's outputs), do
    and optional dlse: a ``seqplan.strategy.DeviceGrads`` — dq in q's dtype, {source shard: (dk, dv)
    contribution} for every shard (zero where it computed no block; float32 — q's dtype where the
    device's own block is the schedule's only one) and, with ``sinks``, its rows' share of dsinks
    for its heads ([h/U] float32), else None. ``loop.walk`` with ``loop.backward_visit``, every
    shard's dK / dV kept apart (``loop.per_shard_accumulation``, as all-gather KV keeps them)."""
    config = _config(q, causal, layout, scale, block_backend, deterministic, window, softcap, token_index)
    schedule, r, q_heads, replicated, t, kv_all = _device(device, q, k, v, strategy, config)
    mine = [ring_shard(x, r, strategy.ring, q_heads) for x in (q, o, do)]
    lse_d, dlse_d = (None if x is None else ring_shard(x, r, strategy.ring, q_heads, head_axis=1) for x in (lse, dlse))
    saved = (mine[0], mine[1], lse_d, mine[2], dlse_d)
    alone = alone_dtype(schedule, q.dtype)  # replicated KV heads: their copies' dK / dV are summed in float32
    grad_dtypes = GradDtypes(alone, F32 if replicated else alone)

    def walked(cfg: AttentionConfig):
        visit = backward_visit(saved, cfg, schedule, r, t, _int32(segment_ids), _int32(token_index),
                               kv_of=resident_kv(kv_all, schedule, r, t), grad_dtypes=grad_dtypes,
                               dkv=per_shard_accumulation(schedule, r, t))
        return walk(schedule, None, None, visit, comm=_RESIDENT, axes=None, scan=token_index is not None)

    with deterministic_kernels(config.deterministic):  # as the call's custom_vjp traces its backward
        if dlse is None and _one_call(strategy, config, mine[0], segment_ids):  # every shard's dK / dV from one call
            # a program of its own here, so the plans are made again (the real backward keeps the forward's)
            plans = prefix_plan(config, mine[0], _int32(segment_ids), _int32(token_index), r)
            masks = gathered_masks(config, mine[0], _int32(segment_ids), _int32(token_index), r)
            dq, dk, dv = prefix_backward(config, tuple(saved[:4]), kv_all, plans,
                                         lambda: portable_backward(config, tuple(saved[:4]), kv_all, masks))
        else:
            dq, dk, dv = walked(config)
    contributions = {src: (shard_of(dk, src, t), shard_of(dv, src, t)) for src in range(strategy.ring)}
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
