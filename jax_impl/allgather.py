"""All-gather-KV attention (``kv_exchange="allgather"``: llama3-style context parallelism,
MaxText's default) as a ``jax.custom_vjp``, over the same ring axis, layouts and visiting order
as ring attention (:func:`schedule.allgather_schedule`).

Per device, inside ``shard_map`` over a ring axis of size R, device r holds ring shard r:

    q: [b, t/R, h, d]    k, v: [b, t/R, hk, d]    ->    o: [b, t/R, h, d], lse: [b, h, t/R]

Forward: one ``all_gather`` of K and of V ([b, t, hk, d] each, ring-shard order), then the
blocks of the step plan against each shard in turn (step i visits shard (r - i) mod R, as the
ring does), merged by LSE. Backward: float32 dK/dV for the whole gathered sequence, one
``psum_scatter`` (reduce-scatter) of each brings every shard's sum home. Memory: the gathered
K/V (R shards) are kept for the backward — the price of no transfer in the loop; the ring keeps
one shard in flight instead but needs R-1 dependent hops.

**One call** (causal packed documents whose blocks resolve to ``fa3_varlen``: :func:`prefix_eligible`):
instead of the blocks, the device's queries against every gathered key as ONE varlen call,
forward and backward, on the plan (:func:`prefix_plan`) with the fewest run slots that holds its
runs — decided on the device; when none does, the portable kernel once over every gathered key
(:func:`portable_forward`: a fallback that must exist in the program but rarely runs, kept to one
chunked scan rather than a walk of the blocks).

**Shared prefix** (``shared_tokens = P``, ``seqplan.shared``): when every token whose document
spans shards sits within its shard's first P positions (the per-document hybrid), only those K/V
are gathered — R·P tokens, independent of the device's queries [P, t) against its own keys
(documents held whole: no transfer), which XLA may run during the gather — then its queries
[0, P) attend to the gathered prefixes; each part is one varlen call on ``fa3_varlen`` where the
one call is eligible (the portable kernel elsewhere, or with an lse cotangent), no merge (every
query's keys lie in one part). The local part's one call reads the shard's own keys in place
(``runs.own_key_plans``: no ranking sort, no packed copy of the keys), where the shard's documents
are runs with increasing token indices (the hybrid's); else it takes the portable kernel. The
backward reduce-scatters the prefixes' dK / dV only. The ids are traced inside the program, so a
P they break cannot raise there: the device computes that
verdict (the same on every device: the gathered ids) and its outputs become NaN — loud, never
silently wrong; ``sequence_parallel_attention`` raises the ``ValueError`` first when its ids are
concrete.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

import seqplan.registry
from seqplan.axes import RING
from seqplan.layouts import ring_positions
from seqplan.schedule import allgather_schedule
from seqplan.shared import PART_MASK, check_shared_call
from seqplan.validation import (
    check_local_masks,
    dtype_name,
    validate_local,
)

from .block import device_kind_of, resolve_backend
from .comm import axis_size
from .config import AttentionConfig, make_config
from .kernels.fa3_varlen import one_call_backward, one_call_forward
from .kernels.reference import reference_block_bwd, reference_block_fwd
from .kernels.runs import VarlenRuns, own_key_plans
from .kernels.runs import prefix_plans as prefix_plans_of
from .loop import (
    attention_with_vjp,
    backward_visit,
    forward_visit,
    gather_segment_ids,
    gather_token_index,
    per_shard_accumulation,
    resident_kv,
    ring_index,
    walk,
)

F32 = jnp.float32


def allgather_attention(q, k, v, axis_name: str | None = RING, *, causal: bool = False, layout: str = "zigzag",
                        scale: float | None = None, block_backend: str = "auto", deterministic: bool | None = None,
                        segment_ids=None, window=None, sinks=None, softcap=None, token_index=None,
                        shared_tokens: int | None = None):
    """All-gather-KV attention over mesh axis ``axis_name`` (``None``: one device). Call inside
    ``shard_map``; inputs are this device's ring shard in layout order, ``segment_ids`` its ids
    [b, t/R] or None; ``window``, ``sinks``, ``softcap`` and ``token_index`` ([b, t/R] or None) as in
    ``ring_attention``; ``shared_tokens``: gather only each shard's first ``shared_tokens`` K/V
    (module docstring; causal packed documents, no window or softcap). Returns ``(o, lse)``."""
    validate_local(q.shape, k.shape, v.shape, tuple(dtype_name(x.dtype) for x in (q, k, v)), layout=layout,
                   scale=scale)
    window = check_local_masks(q.shape, segment_ids=segment_ids, token_index=token_index, sinks=sinks, window=window)
    config = make_config(q, causal=causal, layout=layout, scale=scale, block_backend=block_backend,
                         deterministic=deterministic, window=window, softcap=softcap,
                         token_index=token_index is not None, shared_tokens=shared_tokens)
    check_shared_call(config, segment_ids is not None)
    if shared_tokens is not None and shared_tokens > q.shape[1]:
        raise ValueError(f"shared_tokens={shared_tokens} exceeds the ring shard's {q.shape[1]} tokens")
    config.backend()  # an unknown or refused kernel fails here
    return _allgather(q, k, v, segment_ids, token_index, sinks, axis_name, config)


def _schedule(axis_name, config: AttentionConfig):
    return allgather_schedule(config.layout, config.schedule_causal, axis_size(axis_name))


def prefix_eligible(config: AttentionConfig, q, documents: bool) -> bool:
    """Whether the call may run as one varlen call per device (module docstring): static, its
    document blocks resolving to ``fa3_varlen`` on ``q``'s device kind and dtype
    (``seqplan.registry.prefix_eligible``)."""
    return seqplan.registry.prefix_eligible(config, documents, device_kind=device_kind_of(q), dtype=q.dtype,
                                            resolve_backend=resolve_backend, one_call_backends=("fa3_varlen",))


def _positions(config: AttentionConfig, index_all, b: int, ring: int, t: int):
    """Every token's index [b, R·t]: the call's token indices, or the static layout's positions."""
    if index_all is not None:
        return index_all.astype(jnp.int32)
    return jnp.broadcast_to(jnp.asarray(ring_positions(config.layout, ring, t).reshape(-1)), (b, ring * t))


def _queries_and_keys(config: AttentionConfig, q, ids_all, index_all, me):
    """Device ``me``'s queries' (ids, positions) and every gathered key's, [b, t] and [b, R·t]
    (ids None stays None: one document a row) — what the one call's plan and its fallback's mask read."""
    b, t = q.shape[:2]
    ring = (ids_all if ids_all is not None else index_all).shape[1] // t
    positions = _positions(config, index_all, b, ring, t)
    mine = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, me * t, t, axis=1)
    return (mine(ids_all), ids_all), (mine(positions), positions)


def prefix_plan(config: AttentionConfig, q, ids_all, index_all, me) -> list[VarlenRuns]:
    """Device ``me``'s one-call plan — one per static run-slot count (``kernels/runs.prefix_plans``),
    the device picks among them — of its queries ``q`` [b, t, ...]
    against every key, from every shard's ids and token indices [b, R·t] (ids None: one document
    per row; token indices None: the static layout's positions — one of the two is given)."""
    (ids_mine, ids), (positions_mine, positions) = _queries_and_keys(config, q, ids_all, index_all, me)
    return prefix_plans_of(ids_mine, ids, positions_mine, positions)


def gathered_masks(config: AttentionConfig, q, ids_all, index_all, me):
    """``PART_MASK``'s (segments, positions) of device ``me``'s queries ``q`` [b, t, ...] against
    every gathered key (ids None: one document a row) — the one call's mask for the portable
    kernel, its fallback."""
    (ids_mine, ids), positions = _queries_and_keys(config, q, ids_all, index_all, me)
    if ids is None:
        ids_mine, ids = jnp.zeros(positions[0].shape, jnp.int32), jnp.zeros(positions[1].shape, jnp.int32)
    return (ids_mine, ids), positions


def portable_forward(config: AttentionConfig, q, kv_all, masks):
    """The one call's fallback (runs that fit no plan): the portable kernel once over every
    gathered key under ``PART_MASK`` (``masks``: :func:`gathered_masks`) — one chunked scan, not
    a walk of the R blocks (whose per-block switches the program would carry in every layer, for
    a path that runs only when a batch's runs outgrow the largest plan)."""
    return reference_block_fwd(q, *kv_all, PART_MASK, config.scale, *masks)


def portable_backward(config: AttentionConfig, saved, kv_all, masks):
    """The backward of :func:`portable_forward` given ``saved = (q, o, lse, do)``: (dq, dk, dv),
    dk / dv float32 over every gathered key."""
    q, o, lse, do = saved
    dq, dk, dv = reference_block_bwd(do, q, *kv_all, o, lse, PART_MASK, config.scale, None, *masks)
    return dq, dk.astype(F32), dv.astype(F32)


def prefix_forward(config: AttentionConfig, q, kv_all, plans, fallback):
    """The device's (o, lse) as ONE varlen call against its gathered key prefixes (``plans``:
    :func:`prefix_plan`), or ``fallback()`` where the runs do not fit (module docstring).
    ``kv_all``: (k, v) [b, R·t, hk, d] in layout order."""
    return one_call_forward(q, *kv_all, config.scale, plans, fallback)


def prefix_backward(config: AttentionConfig, saved, kv_all, plans, fallback):
    """The backward of :func:`prefix_forward` given ``saved = (q, o, lse, do)`` (the GLOBAL o, lse):
    (dq, dk, dv) with dk, dv float32 [b, R·t, hk, d] — every key's gradient from this device's rows."""
    q, o, lse, do = saved
    return one_call_backward(do, q, *kv_all, o, lse, config.scale, plans, fallback)


@dataclasses.dataclass(frozen=True, eq=False)
class _GatheredSaved:
    """What the whole-gather forward keeps for its backward (a pytree): ``kv_all`` (k, v)
    [b, R·t, hk, d] or None (one device), every shard's ids and token indices [b, R·t] (or None),
    and the one-call ``plans`` (None: the blocks are walked)."""

    kv_all: tuple | None
    ids_all: object
    index_all: object
    plans: list | None


jax.tree_util.register_dataclass(_GatheredSaved, data_fields=[f.name for f in dataclasses.fields(_GatheredSaved)],
                                 meta_fields=[])


def _forward(q, k, v, ids, index, axis_name, config: AttentionConfig):
    schedule = _schedule(axis_name, config)
    if schedule.size > 1 and config.shared_tokens is not None:  # only the shared prefixes travel
        return _split_forward(q, k, v, ids, index, axis_name, config)
    kv_all = tuple(config.comm.gather(x, axis_name) for x in (k, v)) if schedule.size > 1 else None
    ids_all = gather_segment_ids(ids, axis_name, config.comm)
    index_all = gather_token_index(index, axis_name, config.comm)
    plans = None
    if schedule.size > 1 and prefix_eligible(config, q, ids_all is not None):
        me = ring_index(axis_name)
        plans = prefix_plan(config, q, ids_all, index_all, me)  # kept for the backward
        masks = gathered_masks(config, q, ids_all, index_all, me)
        o, lse = prefix_forward(config, q, kv_all, plans, lambda: portable_forward(config, q, kv_all, masks))
    else:
        o, lse = _walk_forward(q, k, v, kv_all, ids_all, index_all, axis_name, config)
    return o, lse, _GatheredSaved(kv_all, ids_all, index_all, plans)


def _walk_forward(q, k, v, kv_all, ids_all, index_all, axis_name, config: AttentionConfig):
    """(o, lse) of this device's blocks against every gathered shard, merged by LSE."""
    schedule, me, t = _schedule(axis_name, config), ring_index(axis_name), k.shape[1]
    visit = forward_visit(q, config, schedule, me, t, ids_all, index_all, own_kv=(k, v),
                          kv_of=resident_kv(kv_all, schedule, me, t))
    return walk(schedule, None, None, visit, comm=config.comm, axes=axis_name)


def _backward(q, k, v, o, lse, extra, do, dlse, axis_name, config: AttentionConfig):
    if isinstance(extra, _SplitSaved):
        return _split_backward(q, k, v, o, lse, extra, do, dlse, axis_name, config)
    schedule, kv_all, plans = _schedule(axis_name, config), extra.kv_all, extra.plans
    if plans is not None and dlse is None:
        masks = gathered_masks(config, q, extra.ids_all, extra.index_all, ring_index(axis_name))
        saved = (q, o, lse, do)
        dq, dk_all, dv_all = prefix_backward(config, saved, kv_all, plans,
                                             lambda: portable_backward(config, saved, kv_all, masks))
    else:
        dq, dk_all, dv_all = _walk_backward(q, k, v, o, lse, extra, do, dlse, axis_name, config)
    if schedule.size == 1:
        return dq, dk_all, dv_all
    return dq, config.comm.scatter(dk_all, axis_name), config.comm.scatter(dv_all, axis_name)


def _walk_backward(q, k, v, o, lse, extra: _GatheredSaved, do, dlse, axis_name, config: AttentionConfig):
    """(dq, dk, dv) of this device's blocks: dk, dv float32 [b, R·t, hk, d] (one shard's own when R = 1)."""
    schedule, me, t = _schedule(axis_name, config), ring_index(axis_name), k.shape[1]
    visit = backward_visit((q, o, lse, do, dlse), config, schedule, me, t, extra.ids_all, extra.index_all,
                           own_kv=(k, v), kv_of=resident_kv(extra.kv_all, schedule, me, t),
                           dkv=per_shard_accumulation(schedule, me, t))
    return walk(schedule, None, None, visit, comm=config.comm, axes=axis_name)


_allgather = attention_with_vjp(_forward, _backward)


# ---- the shared prefix (module docstring; seqplan.shared) ----------------------------------------

@dataclasses.dataclass(frozen=True)
class _SplitScopes:
    """The ``jax.named_scope`` of each phase of the shared-prefix call (its kernels' op names in the
    compiled program and in a profile: ``benchmarks/mesh_profile_jax.py`` sums the time by them)."""

    ids: str = "shared_prefix.ids"  # gather the ids and token indices
    gather: str = "shared_prefix.gather"  # all-gather the prefixes' K / V
    plan: str = "shared_prefix.plan"  # both parts' one-call plans, on the device
    shared: str = "shared_prefix.shared_part"  # queries [0, P) against the gathered prefixes
    local: str = "shared_prefix.local_part"  # queries [P, t) against the device's own keys
    scatter: str = "shared_prefix.reduce_scatter"  # the prefixes' dK / dV home (backward)
    combine: str = "shared_prefix.combine"  # the parts' outputs and gradients joined
    holds: str = "shared_prefix.holds"  # the shared_tokens promise checked on the gathered ids


SCOPES = _SplitScopes()


@dataclasses.dataclass(frozen=True, eq=False)
class _SplitSaved:
    """What the shared-prefix forward keeps for its backward (a pytree).

    kv_prefixes:  (k, v) [b, R·P, hk, d], every shard's first P tokens (row, then shard), or None: P = 0.
    queries:      (ids, positions) of the device's queries [b, t].
    keys_shared:  (ids, positions) of the gathered prefixes [b, R·P].
    plans:        (shared, local) one-call plans (``kernels/runs.prefix_plans``; the local part's
                  over the shard's own keys, ``runs.own_key_plans``), None where the part is empty
                  or the one call is not eligible (the portable kernel).
    holds:        bool: the ids keep ``shared_tokens``' promise (every device computes the same)."""

    kv_prefixes: tuple | None
    queries: tuple
    keys_shared: tuple
    plans: tuple
    holds: jax.Array


jax.tree_util.register_dataclass(_SplitSaved, data_fields=[f.name for f in dataclasses.fields(_SplitSaved)],
                                 meta_fields=[])


def _shared_prefix_holds(ids_all, ring: int, p: int):
    """Whether every token at position ``p`` or later of its shard belongs to a document no other
    shard holds (traced bool over gathered ids [b, R·t]; ``seqplan.shared.check_shared_tokens``'s
    verdict on the device)."""
    b, n = ids_all.shape
    t = n // ring
    if p >= t:
        return jnp.bool_(True)
    shard = jnp.repeat(jnp.arange(ring, dtype=jnp.int32), t)

    def row(ids):
        order = jnp.argsort(ids)
        ranked = ids[order]
        doc = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), (ranked[1:] != ranked[:-1]).astype(jnp.int32)]))
        first = jax.ops.segment_min(shard[order], doc, num_segments=n)
        last = jax.ops.segment_max(shard[order], doc, num_segments=n)
        spans = jnp.zeros(n, bool).at[order].set((first != last)[doc])
        return ~jnp.any(spans.reshape(ring, t)[:, p:])

    return jnp.all(jax.vmap(row)(ids_all))


def _prefixes(x, ring: int, p: int):
    """Every shard's first ``p`` positions of a gathered [b, R·t, ...] -> [b, R·p, ...]."""
    b, n = x.shape[:2]
    return x.reshape(b, ring, n // ring, *x.shape[2:])[:, :, :p].reshape(b, ring * p, *x.shape[2:])


def _part_forward(config: AttentionConfig, q, kv, plans, masks):
    """(o, lse) of one part: one varlen call on the plan that holds its runs, else (and without
    plans) the portable kernel; ``masks`` = (segments, positions), each (queries, keys)."""
    portable = lambda: reference_block_fwd(q, *kv, PART_MASK, config.scale, *masks)
    if plans is None:
        return portable()
    return one_call_forward(q, *kv, config.scale, plans, portable)


def _part_backward(config: AttentionConfig, saved, kv, plans, masks):
    """(dq, dk, dv) of one part, dk / dv float32 like ``kv``; ``saved = (q, o, lse, do, dlse)`` of its
    queries (the varlen backward takes no lse cotangent: the portable kernel then)."""
    q, o, lse, do, dlse = saved
    portable = lambda: reference_block_bwd(do, q, *kv, o, lse, PART_MASK, config.scale, dlse, *masks)
    if plans is None or dlse is not None:
        dq, dk, dv = portable()
    else:
        dq, dk, dv = one_call_backward(do, q, *kv, o, lse, config.scale, plans, portable)
    return dq, dk.astype(F32), dv.astype(F32)


def _split_forward(q, k, v, ids, index, axis_name, config: AttentionConfig):
    ring, me, t, p = axis_size(axis_name), ring_index(axis_name), q.shape[1], config.shared_tokens
    with jax.named_scope(SCOPES.ids):
        ids_all = gather_segment_ids(ids, axis_name, config.comm)
        index_all = gather_token_index(index, axis_name, config.comm)
        (ids_mine, _), (positions_mine, positions) = _queries_and_keys(config, q, ids_all, index_all, me)
    queries = (ids_mine, positions_mine)
    keys_shared = (_prefixes(ids_all, ring, p), _prefixes(positions, ring, p))
    with jax.named_scope(SCOPES.gather):  # [b, R·p, hk, d]: shard r's prefix at rows r·p, as _prefixes orders the ids
        kv_prefixes = tuple(config.comm.gather(x[:, :p], axis_name) for x in (k, v)) if p else None
    one_call = prefix_eligible(config, q, True)
    with jax.named_scope(SCOPES.plan):  # the prefixes' keys gathered, ranked; the local part's keys its own, in place
        shared = (prefix_plans_of(queries[0][:, :p], keys_shared[0], queries[1][:, :p], keys_shared[1])
                  if one_call and p else None)
        plans = (shared, own_key_plans(*queries, p) if one_call and p < t else None)
    part_masks = lambda lo, hi, keys: ((queries[0][:, lo:hi], keys[0]), (queries[1][:, lo:hi], keys[1]))
    parts = []
    if p < t:  # the local part first, as torch_impl: it needs nothing the gather brings (XLA may still reorder)
        with jax.named_scope(SCOPES.local):
            parts.append(_part_forward(config, q[:, p:], (k, v), plans[1], part_masks(p, t, queries)))
    if p:
        with jax.named_scope(SCOPES.shared):
            parts.insert(0, _part_forward(config, q[:, :p], kv_prefixes, plans[0], part_masks(0, p, keys_shared)))
    with jax.named_scope(SCOPES.combine):
        o = jnp.concatenate([o_part.astype(q.dtype) for o_part, _ in parts], axis=1)
        lse = jnp.concatenate([lse_part.astype(F32) for _, lse_part in parts], axis=2)
    with jax.named_scope(SCOPES.holds):
        holds = _shared_prefix_holds(ids_all, ring, p)
        o = jnp.where(holds, o, jnp.nan)  # a broken promise shows (module docstring)
    return o, lse, _SplitSaved(kv_prefixes, queries, keys_shared, plans, holds)


def _split_backward(q, k, v, o, lse, saved: _SplitSaved, do, dlse, axis_name, config: AttentionConfig):
    t, p = q.shape[1], config.shared_tokens
    queries, keys_shared = saved.queries, saved.keys_shared
    part = lambda x, lo, hi, axis=1: None if x is None else lax.slice_in_dim(x, lo, hi, axis=axis)
    rows = lambda lo, hi: (part(q, lo, hi), part(o, lo, hi), part(lse, lo, hi, 2), part(do, lo, hi),
                           part(dlse, lo, hi, 2))
    part_masks = lambda lo, hi, keys: ((queries[0][:, lo:hi], keys[0]), (queries[1][:, lo:hi], keys[1]))
    dq_parts = []
    dk, dv = (jnp.zeros(x.shape, F32) for x in (k, v))
    if p:
        with jax.named_scope(SCOPES.shared):
            dq_shared, dk_rows, dv_rows = _part_backward(config, rows(0, p), saved.kv_prefixes, saved.plans[0],
                                                         part_masks(0, p, keys_shared))
        with jax.named_scope(SCOPES.scatter):
            home = lambda g: config.comm.scatter(g, axis_name)  # [b, R·p] -> this shard's [b, p], summed
            dk, dv = (d.at[:, :p].add(home(g)) for d, g in ((dk, dk_rows), (dv, dv_rows)))
        dq_parts.append(dq_shared)
    if p < t:
        with jax.named_scope(SCOPES.local):
            dq_local, dk_local, dv_local = _part_backward(config, rows(p, t), (k, v), saved.plans[1],
                                                          part_masks(p, t, queries))
        with jax.named_scope(SCOPES.combine):
            dk, dv = dk + dk_local, dv + dv_local
        dq_parts.append(dq_local)
    with jax.named_scope(SCOPES.combine):
        # dq in the wider of its parts' dtypes (a fused part's is q's, the portable kernel's float32), as
        # torch_impl: the parts' rows are disjoint (nothing is summed) and the caller casts to q's dtype, so
        # the bits are a float32 buffer's, which the fused parts only paid for (run 14's profile: 0.26 ms of
        # float32 -> bf16 conversion in the short mix's backward, dq the largest buffer converted)
        wide = F32 if any(x.dtype == F32 for x in dq_parts) else q.dtype
        dq = jnp.concatenate([x.astype(wide) for x in dq_parts], axis=1)
    with jax.named_scope(SCOPES.holds):
        nan_unless = lambda x: jnp.where(saved.holds, x, jnp.nan)
        return nan_unless(dq), nan_unless(dk), nan_unless(dv)
