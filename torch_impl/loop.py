"""The machinery ring, all-gather-KV and double-ring attention share: walking a
:class:`schedule.Schedule` on this rank (K/V forward, dK/dV one hop behind), one block's forward
merge and backward gradients, and the autograd Function that joins a forward and a backward.

Shapes (per rank): q, o, dq [b, t, h, d]; k, v, dk, dv [b, t, hk, d]; lse [b, h, t] float32.

**Packed documents.** With ``segment_ids`` (this rank's [b, t]), the forward all-gathers every
ring shard's ids once (:func:`gather_segment_ids`: ``ids_all`` int32 [R, b, t], shard r at index
r) and keeps them on the autograd context for the backward; no ids travel with the K/V. Each
block then asks :func:`block_work` what to compute — SKIP (no pair shares a document: no kernel
call, forward or backward), PLAIN (the static mask: a fused kernel may run it) or DOCUMENTS (the
document mask, ``segments`` given to the kernel) — a Python branch on one small device-to-host
copy per block. The local step is never skipped (every query sees itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .comm import Comm, RingShift
from .config import AttentionConfig
from .merge import merge_partials_into
from .schedule import Block, BlockMask, DocumentWork, Hop, Part, Schedule, device_visits, document_flags


def ring_index(groups) -> int:
    """This rank's index on the ring over ``groups = (outer, inner)`` (o·I + i; a group of
    ``None`` counts as size 1, index 0)."""
    outer, inner = groups
    n_in = 1 if inner is None else dist.get_world_size(inner)
    o = 0 if outer is None else dist.get_group_rank(outer, dist.get_rank())
    i = 0 if inner is None else dist.get_group_rank(inner, dist.get_rank())
    return o * n_in + i


def _buffer(x):
    """A contiguous receive buffer like ``x`` (``empty_like`` would copy x's strides)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class KVWalk:
    """This rank's K/V along ``schedule``: ``for visit, kv in KVWalk(...)`` gives every step's
    :class:`schedule.Visit` with the K/V of its source shard, the transfer of the K/V the next step
    needs already started (so it overlaps the step's compute). Receive buffers are allocated once
    per hop kind, two at most, and reused alternately.

    ``first``: the K/V of step 1, already received (the single ring's backward: the first hop is
    not sent again). ``keep_first``: receive the K/V of step 1 into a buffer of their own, never
    reused, and keep it as ``self.first`` (the single ring's forward saves it for the backward)."""

    def __init__(self, schedule: Schedule, comm: Comm, groups, kv: tuple, *, first: tuple | None = None,
                 keep_first: bool = False):
        self.schedule, self.comm, self.groups, self.kv = schedule, comm, groups, kv
        self.first, self._given_first, self._keep_first = first, first is not None, keep_first
        self._shifts: dict[Hop, RingShift] = {}
        self._pools: dict[Hop, list] = {}
        self._sent: dict[Hop, int] = {}

    def _start(self, hop: Hop, kv: tuple, into: tuple | None = None) -> tuple:
        """Start sending ``kv`` one ``hop``; returns the buffers they arrive in (after ``_wait``)."""
        if into is None:
            pool, n = self._pools.setdefault(hop, []), self._sent.get(hop, 0)
            if len(pool) < 2 and n == len(pool):
                pool.append(tuple(_buffer(x) for x in kv))
            into, self._sent[hop] = pool[n % 2], n + 1
        if hop not in self._shifts:
            self._shifts[hop] = self.comm.shift(hop, self.groups)
        self._shifts[hop].start(kv, into)
        return into

    def _wait(self, hop: Hop) -> None:
        self._shifts[hop].wait()

    def __iter__(self):
        visits = iter(device_visits(self.schedule, ring_index(self.groups)))
        kv_round = self.kv
        for rnd in self.schedule.rounds:
            next_round = self._start(rnd.kv_hop, kv_round) if rnd.kv_hop is not None else None  # hidden by the round
            kv = kv_round
            for step in rnd.steps:
                incoming, hop = None, step.kv_hop
                if step.local and self._given_first:
                    incoming, hop = self.first, None
                elif hop is not None:
                    keep = step.local and self._keep_first
                    incoming = self._start(hop, kv, tuple(_buffer(x) for x in kv) if keep else None)
                    if keep:
                        self.first = incoming
                yield next(visits), kv
                if hop is not None:
                    self._wait(hop)
                if incoming is not None:
                    kv = incoming
            if next_round is not None:
                self._wait(rnd.kv_hop)
                kv_round = next_round


class DKVTrail:
    """The float32 dK/dV accumulators of the shard in hand, one hop behind it (the backward of
    ring and double ring): after each step they leave by the step's ``dkv_hop`` for the shard's
    next holder (:meth:`send`); :meth:`current` waits until those of the shard now in hand have
    arrived. After the last step's hop they are this rank's own."""

    def __init__(self, comm: Comm, groups, dk, dv):
        self.comm, self.groups = comm, groups
        self._acc, self._spare = [dk.contiguous(), dv.contiguous()], None
        self._shifts: dict[Hop, RingShift] = {}
        self._in_flight: RingShift | None = None

    def current(self) -> list:
        """[dk, dv] of the shard in hand (waits for them)."""
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None
        return self._acc

    def send(self, hop: Hop | None) -> None:
        """Start moving the accumulators one ``hop`` (``None``: they stay)."""
        if hop is None:
            return
        if hop not in self._shifts:
            self._shifts[hop] = self.comm.shift(hop, self.groups)
        if self._spare is None:
            self._spare = [_buffer(x) for x in self._acc]
        self._shifts[hop].start(self._acc, self._spare)
        self._in_flight = self._shifts[hop]
        self._acc, self._spare = self._spare, self._acc


def _part(x, which: Part, dim: int):
    """``x[which]`` along ``dim`` (a view)."""
    lo, hi = which.bounds(x.shape[dim])
    return x if which is Part.ALL else x.narrow(dim, lo, hi - lo)


def gather_segment_ids(segment_ids, groups, comm: Comm):
    """Every ring shard's segment ids, int32 [R, b, t] (shard r = o·I + i at index r), from this
    rank's [b, t]: one all-gather over the inner group, then one over the outer (``None`` groups
    are skipped). ``None`` in, ``None`` out."""
    if segment_ids is None:
        return None
    ids = segment_ids.to(torch.int32).contiguous()
    b, t = ids.shape
    ids_all = ids.unsqueeze(0)
    for group in (groups[1], groups[0]):  # inner, then outer: index o·I + i
        if group is not None:
            ids_all = comm.gather(ids_all, group).reshape(-1, b, t)
    return ids_all


def block_work(block: Block, q_ids, kv_ids) -> DocumentWork:
    """What ``block`` computes, given the whole shards' ids: ``q_ids`` of this rank's queries
    [b, t], ``kv_ids`` of the visiting K/V [b, t]. The smallest and largest id of the block's
    query part and of its key part, per batch row, go to ``schedule.document_flags``; one
    device-to-host copy brings both flags home."""
    q_lo, q_hi = torch.aminmax(_part(q_ids, block.q_part, 1), dim=1)
    kv_lo, kv_hi = torch.aminmax(_part(kv_ids, block.kv_part, 1), dim=1)
    shared, one_document = torch.stack(document_flags(q_lo, q_hi, kv_lo, kv_hi)).tolist()
    if not shared:
        return DocumentWork.SKIP
    return DocumentWork.PLAIN if one_document else DocumentWork.DOCUMENTS


def _kernel_mask(block: Block, segments) -> tuple[BlockMask, dict] | None:
    """(mask, keyword arguments) of ``block``'s kernel call — ``segments = (q_ids, kv_ids)`` of
    the whole shards, or None without packed documents — or None where :func:`block_work` says
    SKIP. The kernel receives ``segments`` (its parts) only with a document mask."""
    if segments is None:
        return block.mask, {}
    work = block_work(block, *segments)
    if work is DocumentWork.SKIP:
        return None
    if work is DocumentWork.PLAIN:
        return block.mask, {}
    q_ids, kv_ids = segments
    return block.mask.with_documents(), {"segments": (_part(q_ids, block.q_part, 1), _part(kv_ids, block.kv_part, 1))}


def attend_block(backend, scale, q, block: Block, kv, segments=None):
    """(o_b, lse_b) of ``q[block.q_part]`` attending to ``kv[block.kv_part]``, or None when the
    block holds no pair of one document (``segments``: see :func:`_kernel_mask`). The local block
    (own K/V, ``q_ids`` = ``kv_ids``) is never None: equal id ranges always meet."""
    call = _kernel_mask(block, segments)
    if call is None:
        return None
    mask, documents = call
    k_cur, v_cur = kv
    return backend.fwd(_part(q, block.q_part, 1), _part(k_cur, block.kv_part, 1), _part(v_cur, block.kv_part, 1),
                       mask, scale, **documents)


def merge_block(backend, scale, q, block: Block | None, kv, state, segments=None) -> None:
    """Merge ``q[block.q_part]`` attending to the visiting ``kv`` into ``state = (o, lse)`` in
    place (nothing for a masked or document-skipped block)."""
    partial = None if block is None else attend_block(backend, scale, q, block, kv, segments)
    if partial is None:
        return
    o, lse = state
    merge_partials_into(_part(o, block.q_part, 1), _part(lse, block.q_part, 2), *partial)


def grad_block(backend, scale, saved, block: Block | None, kv, segments=None):
    """(dq, dk, dv) of one block against the visiting ``kv`` (None for a masked or
    document-skipped block); ``saved = (q, o, lse, do, dlse)`` of this rank; ``segments``: the
    whole shards' (q_ids, kv_ids), or None."""
    call = None if block is None else _kernel_mask(block, segments)
    if call is None:
        return None
    mask, documents = call
    (q, o, lse, do, dlse), (k_cur, v_cur) = saved, kv
    qp, kp = block.q_part, block.kv_part
    return backend.bwd(_part(do, qp, 1), _part(q, qp, 1), _part(k_cur, kp, 1), _part(v_cur, kp, 1),
                       _part(o, qp, 1), _part(lse, qp, 2), mask, scale,
                       None if dlse is None else _part(dlse, qp, 2), **documents)


def add_grads(block: Block | None, grads, dq, dkv) -> None:
    """dq[q_part] += dq_b; dk, dv (of the visiting shard)[kv_part] += dk_b, dv_b — in place."""
    if grads is None:
        return
    dq_b, dk_b, dv_b = grads
    _part(dq, block.q_part, 1).add_(dq_b)
    _part(dkv[0], block.kv_part, 1).add_(dk_b)
    _part(dkv[1], block.kv_part, 1).add_(dv_b)


def _visit_segments(ids_all, device: int, source: int):
    """(q_ids, kv_ids) of a visit — this rank's shard and the visited one — from the gathered
    ``ids_all`` [R, b, t] (None without packed documents)."""
    return None if ids_all is None else (ids_all[device], ids_all[source])


def walk_forward(q, k, v, groups, config: AttentionConfig, schedule: Schedule, ids_all=None):
    """One rank's forward over ``schedule`` (ring or double ring): its own block, then every
    visiting K/V merged by LSE into a float32 accumulator. Returns (o, lse, kv_first), kv_first
    the K/V received for step 1 when the schedule's backward reuses them (else None).
    ``ids_all``: every shard's segment ids [R, b, t] (:func:`gather_segment_ids`) or None."""
    backend, me = config.backend(), ring_index(groups)
    k, v = k.contiguous(), v.contiguous()  # they are sent as they are
    walk = KVWalk(schedule, config.comm, groups, (k, v), keep_first=schedule.backward_reuses_first_kv)
    for visit, kv in walk:
        segments = _visit_segments(ids_all, me, visit.source)
        if visit.step.local:  # own K/V, never empty
            o, lse = attend_block(backend, config.scale, q, visit.block, kv, segments)
            o = o.float() if schedule.size > 1 else o  # the float32 accumulator (kernels may return the input dtype)
        else:
            merge_block(backend, config.scale, q, visit.block, kv, (o, lse), segments)
    return o, lse, walk.first


def walk_backward(q, k, v, o, lse, kv_first, do, dlse, groups, config: AttentionConfig, schedule: Schedule,
                  ids_all=None):
    """One rank's backward over ``schedule``: K/V travel again (from ``kv_first`` when the
    forward kept it), the visited shard's float32 dK/dV follow it one hop behind (the step's
    ``dkv_hop``: ring, inner, or diagonal after a double-ring round), dq stays local; blocks the
    forward skipped for packed documents (``ids_all``, kept by the forward) are skipped again."""
    backend, me = config.backend(), ring_index(groups)
    saved = (q, o, lse, do, dlse)
    for visit, kv in KVWalk(schedule, config.comm, groups, (k.contiguous(), v.contiguous()), first=kv_first):
        segments = _visit_segments(ids_all, me, visit.source)
        if visit.step.local:
            dq, dk, dv = grad_block(backend, config.scale, saved, visit.block, kv, segments)
            if schedule.size == 1:
                return dq, dk, dv
            dq = dq.float()  # the float32 accumulators (kernels may return bf16)
            trail = DKVTrail(config.comm, groups, dk.float(), dv.float())
        else:
            grads = grad_block(backend, config.scale, saved, visit.block, kv, segments)
            add_grads(visit.block, grads, dq, trail.current())  # once the shard's dK/dV have arrived
        trail.send(visit.step.dkv_hop)  # dK/dV of the shard just visited move on with it
    dk, dv = trail.current()  # after R hops, this shard's own
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """Autograd for a (forward, backward) pair; see :func:`attention_with_vjp`."""

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, groups, config: AttentionConfig, segment_ids):
        # An unused output's gradient arrives as None rather than zeros, so the kernels know
        # there is no lse cotangent without inspecting a tensor (a device sync on GPUs).
        ctx.set_materialize_grads(False)
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        ctx.kv_dtype = k.dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        ids_all = gather_segment_ids(segment_ids, groups, config.comm)  # once, for both passes
        o, lse, extra = forward(q, k, v, groups, config, ids_all)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse, *(extra or ()))
        ctx.groups, ctx.config, ctx.backward_fn, ctx.ids_all = groups, config, backward, ids_all
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, *extra = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = ctx.backward_fn(q, k, v, o, lse, tuple(extra) or None, do, dlse, ctx.groups, ctx.config,
                                     ctx.ids_all)
        return None, None, dq.to(q.dtype), dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None


def attention_with_vjp(forward: Callable, backward: Callable) -> Callable:
    """A differentiable ``(q, k, v, groups, config: AttentionConfig, segment_ids=None) -> (o, lse)``
    from ``forward(q, k, v, groups, config, ids_all) -> (o, lse, extra)`` and ``backward(q, k, v,
    o, lse, extra, do, dlse, groups, config, ids_all) -> (dq, dk, dv)``: ``extra`` (K/V the forward
    received) is saved for the backward; ``segment_ids`` (this rank's [b, t], no gradient) are
    all-gathered once into ``ids_all`` [R, b, t] (:func:`gather_segment_ids`), kept for the backward."""
    return lambda q, k, v, groups, config, segment_ids=None: _Attention.apply(forward, backward, q, k, v, groups,
                                                                             config, segment_ids)
