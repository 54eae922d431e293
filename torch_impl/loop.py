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

**Sliding window.** With ``config.window = (left, right)``, every ring shard's original positions
are static (``layout_permutation``), so each block's window decision is plain Python on ints
(``schedule.window_flags`` on the min / max position of its query and key parts): out of reach
-> skipped, forward and backward, before any document test; covered entirely -> its static mask
alone; otherwise the window joins the mask and the kernel gets ``positions``. Exact for the
contiguous and zigzag parts, conservative for stripe. Documents and window are carried together,
per call, by :class:`ShardMasks` (per visit: :class:`VisitMasks`).

**Sinks.** ``sinks [h]`` (gpt-oss logits: each row's softmax denominator gains exp(sinks[h]),
no value vector) enter once per row after the last merge, inside the autograd Function
(:func:`add_sinks`: lse_f = logaddexp(lse, sink), o_f = o·exp(lse − lse_f)). The block backward
is then given the final o_f and lse_f and needs nothing new — D = rowsum(dO∘O_f) accounts for the
sink, and fused kernels need no lse cotangent of their own — and the Function's backward returns
the sinks' gradient over this rank's rows (:func:`sinks_grad`: −Σ_rows P_sink·(D − dlse),
P_sink = exp(sink − lse_f)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from seqplan.bands import crop_to_band, part_offset
from seqplan.documents import HostPair, cached_plan, one_document_per_row
from seqplan.layouts import ring_positions
from seqplan.schedule import (
    Block,
    BlockMask,
    DocumentWork,
    Hop,
    Part,
    Schedule,
    Span,
    device_visits,
    document_flags,
    return_distance,
    window_flags,
)

from .comm import Comm, RingShift, axis_size, host_to_device
from .config import AttentionConfig, deterministic_kernels
from .merge import Float32Rows, merge_partials_into


def ring_index(groups) -> int:
    """This rank's index on the ring over ``groups = (outer, inner)`` (o·I + i; a group of
    ``None`` counts as size 1, index 0)."""
    outer, inner = groups
    n_in = 1 if inner is None else dist.get_world_size(inner)
    o = 0 if outer is None else dist.get_group_rank(outer, dist.get_rank())
    i = 0 if inner is None else dist.get_group_rank(inner, dist.get_rank())
    return o * n_in + i


def _tails(tensors, rows: int) -> tuple:
    """Each tensor's last ``rows`` rows (dim 1), contiguous: what a hop with a halo sends."""
    return tuple(x.narrow(1, x.shape[1] - rows, rows).contiguous() for x in tensors)


def _halo_span(x, rows: int) -> Span:
    """The last ``rows`` rows of ``x`` (dim 1): the halo's, as a :class:`Span`."""
    return Span(x.shape[1] - rows, x.shape[1])


def _rows(acc, part):
    """``acc[part]`` along the rows (dim 1), a view to merge or add into: a :class:`Float32Rows`'s
    float32 rows (widened as asked), or a tensor's."""
    return acc.rows(part) if isinstance(acc, Float32Rows) else _part(acc, part, 1)


def as_dtype(acc, dtype):
    """An accumulator (:class:`Float32Rows`: its widened rows cast, the rest as the kernel wrote
    them) or a tensor, in ``dtype``."""
    return acc.result(dtype) if isinstance(acc, Float32Rows) else acc.to(dtype)


def _buffer(x):
    """A contiguous receive buffer like ``x`` (``empty_like`` would copy x's strides)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class KVWalk:
    """This rank's K/V along ``schedule``: ``for visit, kv in KVWalk(...)`` gives every step's
    :class:`schedule.Visit` with the K/V of its source shard, the transfer of the K/V the next step
    needs already started (so it overlaps the step's compute). Receive buffers are allocated once
    per hop kind, two at most, and reused alternately (with a halo, the one hop's rows get their own).

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
        self._sending: tuple | None = None  # with a halo: the rows in flight

    def _start(self, hop: Hop, kv: tuple, into: tuple | None = None) -> tuple:
        """Start sending ``kv`` one ``hop``; returns the buffers they arrive in (after ``_wait``;
        with a halo, the rows that travel: :meth:`_arrived` puts them in place)."""
        if self.schedule.halo is not None:  # the ring's one K/V hop: the rows the window reads
            kv = self._sending = _tails(kv, self.schedule.halo)  # kept alive until they land
            into = tuple(_buffer(x) for x in kv)
        if into is None:
            pool, n = self._pools.setdefault(hop, []), self._sent.get(hop, 0)
            if len(pool) < 2 and n == len(pool):
                pool.append(tuple(_buffer(x) for x in kv))
            into, self._sent[hop] = pool[n % 2], n + 1
        if hop not in self._shifts:
            self._shifts[hop] = self.comm.shift(hop, self.groups, **return_distance(self.schedule, hop))
        self._shifts[hop].start(kv, into)
        return into

    def _wait(self, hop: Hop) -> None:
        self._shifts[hop].wait()

    def _arrived(self, incoming: tuple, like: tuple) -> tuple:
        """The K/V as the next step reads them: with a halo, the rows that came in the last rows of
        zeros shaped ``like`` (rows the window masks: never read into a result)."""
        halo = self.schedule.halo
        if halo is None:
            return incoming
        return tuple(torch.cat([x.new_zeros((x.shape[0], x.shape[1] - halo, *x.shape[2:])), y], 1)
                     for x, y in zip(like, incoming))

    def __iter__(self):
        visits = iter(device_visits(self.schedule, ring_index(self.groups)))
        kv_round = self.kv
        for rnd in self.schedule.rounds:
            next_round = self._start(rnd.kv_hop, kv_round) if rnd.kv_hop is not None else None  # hidden by the round
            kv = kv_round
            for step in rnd.steps:
                incoming, hop, keep = None, step.kv_hop, False
                if step.local and self._given_first:
                    incoming, hop = self.first, None
                elif hop is not None:
                    keep = step.local and self._keep_first
                    own = keep and self.schedule.halo is None  # a halo's rows get buffers of their own anyway
                    incoming = self._start(hop, kv, tuple(_buffer(x) for x in kv) if own else None)
                yield next(visits), kv
                if hop is not None:
                    self._wait(hop)
                    incoming = self._arrived(incoming, kv)
                    if keep:
                        self.first = incoming
                if incoming is not None:
                    kv = incoming
            if next_round is not None:
                self._wait(rnd.kv_hop)
                kv_round = next_round


class DKVTrail:
    """The dK/dV accumulators of the shard in hand (float32 where they add: whole, or with a halo
    only its rows, :class:`Float32Rows`), one hop behind it (the backward of
    ring and double ring): after each step they leave by the step's ``dkv_hop`` for the shard's
    next holder (:meth:`send`); :meth:`current` waits until those of the shard now in hand have
    arrived. After the last step's hop they are this rank's own."""

    def __init__(self, comm: Comm, groups, dk, dv, schedule: Schedule):
        self.comm, self.groups, self.schedule = comm, groups, schedule
        # whole accumulators travel in float32; with a halo only its rows do, and the rest of the
        # shard stays as the own block's kernel wrote it (Float32Rows widens the rows blocks touch)
        self._acc = ([Float32Rows(dk), Float32Rows(dv)] if schedule.halo is not None else
                     [dk.float().contiguous(), dv.float().contiguous()])
        self._spare = None
        self._shifts: dict[Hop, RingShift] = {}
        self._in_flight: RingShift | None = None
        self._sending: list | None = None  # with a halo: the rows in flight (kept alive until they land)

    def current(self, source: int | None = None) -> list:
        """[dk, dv] of the shard in hand (waits for them; ``source``: for :class:`ShardGrads`'s interface)."""
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None
            if self.schedule.halo is not None:  # the rows that came land in this rank's accumulators
                for acc, rows in zip(self._acc, self._spare):
                    acc.rows(_halo_span(acc.base, rows.shape[1])).copy_(rows)
                self._sending = None
        return self._acc

    def send(self, hop: Hop | None) -> None:
        """Start moving the accumulators one ``hop`` (``None``: they stay). With a halo only its
        rows travel, and the rest of these accumulators stay this rank's own
        (``schedule.window_halo``: blocks add exact zeros there before they come home)."""
        if hop is None:
            return
        if hop not in self._shifts:
            self._shifts[hop] = self.comm.shift(hop, self.groups, **return_distance(self.schedule, hop))
        if self.schedule.halo is not None:
            self._sending = [acc.rows(_halo_span(acc.base, self.schedule.halo)).contiguous() for acc in self._acc]
            if self._spare is None:
                self._spare = [_buffer(x) for x in self._sending]
            self._shifts[hop].start(self._sending, self._spare)
            self._in_flight = self._shifts[hop]
            return
        if self._spare is None:
            self._spare = [_buffer(x) for x in self._acc]
        self._shifts[hop].start(self._acc, self._spare)
        self._in_flight = self._shifts[hop]
        self._acc, self._spare = self._spare, self._acc


def _part(x, which: Part, dim: int):
    """``x[which]`` along ``dim`` (a view; a tensor or a NumPy array)."""
    lo, hi = which.bounds(x.shape[dim])
    if which is Part.ALL:
        return x
    return x[(slice(None),) * dim + (slice(lo, hi),)] if isinstance(x, np.ndarray) else x.narrow(dim, lo, hi - lo)


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


def gather_token_index(token_index, groups, comm: Comm):
    """Every ring shard's token indices (the ``token_index`` argument: original token index per
    row, layout order), int32 [R, b, t] from this rank's [b, t], gathered exactly as
    :func:`gather_segment_ids` gathers the ids (one more int32 all-gather per group, made only
    when they are given). ``None`` in, ``None`` out."""
    return gather_segment_ids(token_index, groups, comm)


def block_work(block: Block, q_ids, kv_ids) -> DocumentWork:
    """What ``block`` computes, given the whole shards' ids: ``q_ids`` of this rank's queries
    [b, t], ``kv_ids`` of the visiting K/V [b, t] — NumPy (the loops' host copy: no device sync)
    or tensors (one device-to-host copy brings both flags home). The smallest and largest id of
    the block's query part and of its key part, per batch row, go to ``schedule.document_flags``."""
    q_part, kv_part = _part(q_ids, block.q_part, 1), _part(kv_ids, block.kv_part, 1)
    if isinstance(q_part, np.ndarray):
        shared, one_document = (bool(f) for f in document_flags(q_part.min(1), q_part.max(1), kv_part.min(1),
                                                                   kv_part.max(1)))
    else:
        q_lo, q_hi = torch.aminmax(q_part, dim=1)
        kv_lo, kv_hi = torch.aminmax(kv_part, dim=1)
        shared, one_document = torch.stack(document_flags(q_lo, q_hi, kv_lo, kv_hi)).tolist()
    if not shared:
        return DocumentWork.SKIP
    return DocumentWork.PLAIN if one_document else DocumentWork.DOCUMENTS


@dataclass(frozen=True, eq=False)
class VisitMasks:
    """Beyond the schedule's static masks, what decides which (query, key) pairs of one visit —
    this rank's queries against one visiting shard's keys — are visible.

    segments:         packed documents: (q_ids [b, t], kv_ids [b, t]) int32 of the whole shards, or None.
    host_segments:    the same ids as NumPy arrays (copied once per call), or None.
    window:           (left, right) on original positions, or None.
    positions:        with a window, (q_pos [t], kv_pos [t]): the whole shards' original positions as
                      NumPy ints — static, so a block's window decision costs no device sync; with
                      explicit token indices, per row (q_pos [b, t], kv_pos [b, t]), copied to the
                      host once per call.
    device_positions: the same as int32 tensors on the inputs' device (the windowed kernel's
                      ``positions``).
    kernel_memos:     per block of this visit, a dict its kernel keeps through the call (forward
                      and backward: held in ``ShardMasks.plans``), or None."""

    segments: tuple | None = None
    window: tuple[int, int] | None = None
    positions: tuple | None = None
    device_positions: tuple | None = None
    host_segments: tuple | None = None
    kernel_memos: dict | None = None

    def kernel_memo(self, key) -> dict | None:
        """The dict the kernel of block ``key`` (the block and its kernel mask) keeps through the call."""
        return None if self.kernel_memos is None else self.kernel_memos.setdefault(key, {})


@dataclass(frozen=True, eq=False)
class ShardMasks:
    """:class:`VisitMasks` of every visit of one call, kept on the autograd context for the
    backward: ``ids_all`` int32 [R, b, t] (packed documents, shard r at index r, or None) and its
    host copy ``ids_host`` (one device-to-host copy per call, so no block decides on a device sync),
    ``window`` (left, right) or None, and with a window every ring shard's original positions
    (``positions`` NumPy [R, t], ``device_positions`` int32 [R, t] on the inputs' device).
    ``plans``: the call's host-side plans (:meth:`plan`), so the backward reuses the forward's —
    and, per visit, the dicts its blocks' kernels keep their run lists in (``VisitMasks.kernel_memos``)."""

    ids_all: torch.Tensor | None
    window: tuple[int, int] | None
    positions: np.ndarray | None
    device_positions: torch.Tensor | None
    ids_host: np.ndarray | None = None
    plans: dict = field(default_factory=dict, repr=False)
    block: HostShards | None = None

    def plan(self, planner, *arrays, **flags):
        """``seqplan.documents.cached_plan(planner, *arrays, **flags)`` for arrays of this call
        (``ids_host``, ``positions``), remembered here too: the backward, and every later use in
        the call, takes the plan without hashing the ids again (each lookup hashes and compares
        every array: ≈ 0.27 ms of CRC-32 and 0.13 of comparison per 512 KB). When the arrays are
        the :func:`host_ids` block's own (``block``), the plan is kept in the block by which of
        its arrays it was made from: every layer's call, forward and backward, takes it with no
        hashing at all — three CRC-32s a call on the shared prefix's path before (4x H200 profile,
        docs/gpu/documents-2026-11-29-evening-h200x4.md)."""
        key = (planner, tuple(id(a) for a in arrays), tuple(sorted(flags.items())))
        if key not in self.plans:
            held = None if self.block is None else self.block.names(arrays)
            if held is None:
                self.plans[key] = cached_plan(planner, *arrays, **flags)
            else:
                block_key = (planner, held, key[2])
                if block_key not in self.block.plans:
                    self.block.plans[block_key] = planner(*arrays, **flags)
                self.plans[key] = self.block.plans[block_key]
        return self.plans[key]

    @classmethod
    def build(cls, config: AttentionConfig, ring_size: int, t: int, ids_all, device, index_all=None,
              host: HostShards | None = None) -> ShardMasks:
        """The masks of a call on a ring of ``ring_size`` shards of ``t`` tokens (in
        ``config.layout``; positions from :func:`ring_positions`) — or, given ``index_all``
        (every shard's token indices, int [R, b, t]; the window then ``config.mask_window``, on them),
        per-row positions [R, b, t] from them (one host copy per call, none when ``host`` — the
        caller's host copies of both, :func:`host_ids` — is given)."""
        positions = device_positions = None
        ids_host, index_host = (_host_copies(ids_all, None if index_all is None else index_all.to(torch.int32))
                                if host is None else (host.ids, host.index))
        if index_all is not None:
            device_positions, positions = index_all.to(torch.int32), index_host
        elif config.window is not None:
            positions, device_positions = _static_positions(config.layout, ring_size, t, torch.device(device))
        if ids_host is not None and config.shared_tokens is None and one_document_per_row(ids_host):
            ids_all = ids_host = None  # the same mask without documents: blocks route as plain ones
        return cls(ids_all, config.mask_window, positions, device_positions, ids_host, block=host)

    def visit(self, device: int, source: int) -> VisitMasks | None:
        """Ring shard ``device``'s queries meeting shard ``source``'s keys (None without documents
        and window: the static masks alone, the code path of a call without either)."""
        if self.ids_all is None and self.window is None:
            return None

        def pair(x):
            return None if x is None else (x[device], x[source])

        return VisitMasks(pair(self.ids_all), self.window, pair(self.positions), pair(self.device_positions),
                          pair(self.ids_host), self.plans.setdefault(("kernel memos", device, source), {}))


# ---- the batch's ids on the host, given once (torch only: JAX plans on the device, under jit) ----

@dataclass(frozen=True, eq=False)
class HostShards:
    """Every ring shard's ids (and token indices, or None) on the host, int32 [R, b, t]: what a
    call would otherwise copy from the device (:func:`_host_copies`). ``plans``: the plans made
    from these arrays (:meth:`ShardMasks.plan`), kept as long as the block: its arrays are
    read-only and held here, so which of them a plan came from names its inputs exactly."""

    ids: np.ndarray
    index: np.ndarray | None
    plans: dict = field(default_factory=dict, repr=False)

    def names(self, arrays) -> tuple | None:
        """Which of this block's arrays each of ``arrays`` is (``"ids"``, ``"index"``; None stays
        None), or None when one is not the block's own (by identity: an equal copy is not)."""
        mine = {id(self.ids): "ids", **({} if self.index is None else {id(self.index): "index"})}
        names = tuple(None if a is None else mine.get(id(a)) for a in arrays)
        return None if any(a is not None and n is None for a, n in zip(arrays, names)) else names


@dataclass(frozen=True, eq=False)
class HostIds:
    """The laid-out rows a :func:`host_ids` block declares: ``segment_ids`` int32 [b, seq] and
    ``token_index`` int32 [b, seq] or None, read-only. What the block's calls derive from them —
    the ring shards, their device copies, the token indices' range — is made once per block
    (``derived``), not once per call: a model's layers all take the same."""

    segment_ids: np.ndarray
    token_index: np.ndarray | None
    derived: dict = field(default_factory=dict, repr=False)

    def _once(self, key, make):
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def shards(self, ring: int) -> HostShards:
        """Ring shard r = the r-th contiguous seq / R of each row (every layout's order), [R, b, t]."""
        def split(x):
            if x is None:
                return None
            shards = x.reshape(x.shape[0], ring, -1).transpose(1, 0, 2).copy()
            shards.setflags(write=False)  # the block's plans are kept by which array they came from
            return shards

        return self._once(("shards", ring), lambda: HostShards(split(self.segment_ids), split(self.token_index)))

    def on_device(self, ring: int, device) -> tuple:
        """:meth:`shards`' ids and token indices (or None) on ``device`` (:func:`host_to_device`)."""
        shards = self.shards(ring)
        return self._once(("device", ring, str(device)), lambda: tuple(
            None if x is None else host_to_device(x, device) for x in (shards.ids, shards.index)))

    def index_range(self) -> tuple[int, int]:
        """(min, max) of the token indices (the block has them)."""
        return self._once("range", lambda: (int(self.token_index.min()), int(self.token_index.max())))


_HOST_IDS: ContextVar[HostIds | None] = ContextVar("ringbridge_host_ids", default=None)


@contextmanager
def host_ids(segment_ids, token_index=None) -> Iterator[HostIds]:
    """Inside the block, the attention calls with packed documents read every ring shard's ids
    (and token indices) from these host arrays instead of copying the gathered ones off the GPU
    — a copy that waits for all the GPU's queued work, once per call and so once per layer
    (docs/decisions.md, "The batch's ids on the host"). ``segment_ids`` / ``token_index``: the
    whole laid-out rows every rank's shards come from, NumPy int [b, seq] in layout order (a
    ``seqplan.chooser.LayoutChoice``'s ``segment_ids`` and ``token_index``), the same on every
    rank. A call still gathers the ids on the device, compares them with these there, and
    returns NaN in o and lse when they differ (a wrong copy is never a silent wrong answer; the
    comparison needs no host sync); a call whose [b, R·t] is not theirs raises ``ValueError``."""
    def checked(x, name):
        x = np.asarray(x)
        if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"host_ids: {name} must be an integer [b, seq] array in layout order, got {x.dtype} {x.shape}")
        x = x.astype(np.int32)  # a copy: later writes to the caller's array do not reach it
        x.setflags(write=False)
        return x

    ids = checked(segment_ids, "segment_ids")
    index = None if token_index is None else checked(token_index, "token_index")
    if index is not None and index.shape != ids.shape:
        raise ValueError(f"host_ids: token_index {index.shape} must have segment_ids' shape {ids.shape}")
    held = HostIds(ids, index)
    reset = _HOST_IDS.set(held)
    try:
        yield held
    finally:
        _HOST_IDS.reset(reset)


def declared_host_ids() -> HostIds | None:
    """The innermost :func:`host_ids` block's arrays, or None outside one."""
    return _HOST_IDS.get()


def _call_host_shards(ring: int, segment_ids, token_index) -> HostShards | None:
    """This call's shards from the :func:`host_ids` block it runs in, or None (no block, or a call
    without ids). Refuses a block whose rows are not this call's [b, R·t] or that lacks the token
    indices the call passes (or has ones it does not)."""
    held = _HOST_IDS.get()
    if held is None or segment_ids is None:
        return None
    b, t = segment_ids.shape
    if held.segment_ids.shape != (b, ring * t):
        raise ValueError(f"host_ids: the block's rows are {held.segment_ids.shape}, this call's every ring shard "
                         f"[b, R·t] = {(b, ring * t)}")
    if (held.token_index is None) != (token_index is None):
        raise ValueError("host_ids: give the block token_index exactly when the calls pass token_index "
                         f"(the block has {'none' if held.token_index is None else 'one'}, the call "
                         f"{'none' if token_index is None else 'one'})")
    return held.shards(ring)


def _host_mismatch(ring: int, ids_all, index_all):
    """A 0-dim bool tensor on the ids' device: whether the gathered ids (or token indices) differ
    from the :func:`host_ids` block's — decided on the device, read by no one on the host."""
    ids_host, index_host = _HOST_IDS.get().on_device(ring, ids_all.device)
    bad = (ids_all.to(torch.int32) != ids_host).any()
    if index_all is not None:
        bad = bad | (index_all.to(torch.int32) != index_host).any()
    return bad


@lru_cache(maxsize=32)
def _static_positions(layout: str, ring_size: int, t: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """A static layout's ring positions (:func:`ring_positions`), on the host and on ``device``,
    built once per shape: a copy from pageable host memory waits for the GPU's queued work, and
    this one ran in every call — a host sync a step on the window ring and USP (4x H200 profile,
    2026-11-27). No caller writes either (the host one refuses), so one pair serves every call."""
    positions = ring_positions(layout, ring_size, t)
    on_device = torch.from_numpy(positions.copy()).to(device)  # its own memory, even on the CPU
    positions.setflags(write=False)
    return positions, on_device


def _host_copies(*tensors) -> tuple:
    """NumPy copies of int32 tensors of one shape (None stays None) in ONE device-to-host copy:
    each copy makes the host wait for the GPU's queued work, once per call is enough."""
    given = [x for x in tensors if x is not None]
    if not given:
        return (None,) * len(tensors)
    stacked = iter(torch.stack(given).cpu().numpy() if len(given) > 1 else [given[0].cpu().numpy()])
    return tuple(None if x is None else next(stacked) for x in tensors)


def _window_reach(block: Block, masks: VisitMasks) -> tuple[bool, bool]:
    """``schedule.window_flags`` (reachable, covered) of ``block`` from the min / max original
    position of its query part and of its key part (plain ints: no device sync)."""
    q_pos, kv_pos = masks.positions
    q_lo, q_hi = block.q_part.bounds(q_pos.shape[-1])
    kv_lo, kv_hi = block.kv_part.bounds(kv_pos.shape[-1])
    q_part, kv_part = q_pos[..., q_lo:q_hi], kv_pos[..., kv_lo:kv_hi]
    if q_part.ndim == 2:  # per-row token indices: reachable in some row, covered in every row
        reachable, covered = window_flags(q_part.min(1), q_part.max(1), kv_part.min(1), kv_part.max(1), *masks.window)
        return bool(reachable.any()), bool(covered.all())
    reachable, covered = window_flags(int(q_part.min()), int(q_part.max()), int(kv_part.min()), int(kv_part.max()),
                                      *masks.window)
    return bool(reachable), bool(covered)


def _kernel_mask(block: Block, masks: VisitMasks | None) -> tuple[BlockMask, dict] | None:
    """(mask, keyword arguments) of ``block``'s kernel call, or None to skip it: out of the
    window's reach (decided on static positions first, no sync), or :func:`block_work` says SKIP.
    The mask is the block's static one, plus the document mask (``segments`` given, their
    parts) unless one document covers the block, plus the window (``positions`` given) unless
    every pair lies inside it."""
    if masks is None:
        return block.mask, {}
    mask, extras = block.mask, {}
    if masks.window is not None:
        reachable, covered = _window_reach(block, masks)
        if not reachable:
            return None
        if not covered:
            q_pos, kv_pos = masks.device_positions
            if q_pos.dim() == 2:  # per-row token indices: no static offset; their host copy for run lists
                mask = mask.with_window(masks.window)
                host = tuple(_part(x, p, 1) for x, p in zip(masks.positions, (block.q_part, block.kv_part)))
                extras["positions"] = HostPair(_part(q_pos, block.q_part, 1), _part(kv_pos, block.kv_part, 1), host)
            else:
                host_parts = (x[slice(*p.bounds(len(x)))]
                              for x, p in zip(masks.positions, (block.q_part, block.kv_part)))
                mask = mask.with_window(masks.window, part_offset(*host_parts))  # static offset: no device sync
                extras["positions"] = (_part(q_pos, block.q_part, 0), _part(kv_pos, block.kv_part, 0))
    if masks.segments is not None:
        host = masks.host_segments
        work = block_work(block, *(host if host is not None else masks.segments))
        if work is DocumentWork.SKIP:
            return None
        if work is DocumentWork.DOCUMENTS:
            (q_ids, kv_ids), parts = masks.segments, (block.q_part, block.kv_part)
            mask = mask.with_documents()
            extras["segments"] = HostPair(_part(q_ids, parts[0], 1), _part(kv_ids, parts[1], 1),
                                          None if host is None else (_part(host[0], parts[0], 1),
                                                                     _part(host[1], parts[1], 1)),
                                          masks.kernel_memo((block, mask)))
    return mask, extras


def _sharing_bounds(q_ids, kv_ids):
    """(i0, i1, j0, j1): the smallest ranges of the queries [b, t] and the keys [b, s] holding
    every token whose document the other side holds too (per row, then over rows); None when no
    document is on both sides."""
    shared_q = np.zeros(q_ids.shape[1], bool)
    shared_k = np.zeros(kv_ids.shape[1], bool)
    for q_row, k_row in zip(q_ids, kv_ids):
        shared_q |= np.isin(q_row, k_row)
        shared_k |= np.isin(k_row, q_row)
    if not shared_q.any():
        return None
    rows, keys = np.flatnonzero(shared_q), np.flatnonzero(shared_k)
    return int(rows[0]), int(rows[-1]) + 1, int(keys[0]), int(keys[-1]) + 1


def crop_block(block: Block, masks: VisitMasks | None) -> Block | None:
    """``block`` cropped to the queries and keys that can see each other, or None when none can
    (skipped, forward and backward), so that its kernel, merge and gradient adds cover those rows
    and keys, not the shard's. Exact: a query left out sees nothing here (o = 0, lse = -inf merge
    as nothing) and a key left out gets zero dK / dV. Two crops, each decided on host copies (no sync):

    - a windowed block whose parts are position runs (static positions): to its band
      (``seqplan.bands.crop_to_band``; the window ring's halo block is the window's rows of the shard);
    - a token-index block (per-row token indices): to the queries and keys whose documents both
      sides hold — pays where the layout keeps the documents shared across devices together (the
      per-document hybrid puts them first in every shard); remembered by content
      (``seqplan.documents.cached_plan``).

    Other blocks: unchanged."""
    if masks is None or masks.positions is None:
        return block
    if np.ndim(masks.positions[0]) == 1:
        return block if masks.window is None else _band_of(block, masks)
    if masks.host_segments is None:
        return block
    q_ids, kv_ids = (_part(x, p, 1) for x, p in zip(masks.host_segments, (block.q_part, block.kv_part)))
    bounds = cached_plan(_sharing_bounds, q_ids, kv_ids)
    if bounds is None:
        return None
    i0, i1, j0, j1 = bounds
    if (i0, i1, j0, j1) == (0, q_ids.shape[1], 0, kv_ids.shape[1]):
        return block
    q_lo = block.q_part.bounds(masks.positions[0].shape[-1])[0]
    kv_lo = block.kv_part.bounds(masks.positions[1].shape[-1])[0]
    return Block(Span(q_lo + i0, q_lo + i1), Span(kv_lo + j0, kv_lo + j1), block.mask)


def _band_of(block: Block, masks: VisitMasks) -> Block | None:
    """A windowed block on static positions cropped to its band (:func:`crop_block`); its static
    mask stays (``_kernel_mask`` derives the window from the cropped parts' positions)."""
    reachable, covered = _window_reach(block, masks)
    if not reachable:
        return None
    t = len(masks.positions[0])
    offset = None if covered else part_offset(*(x[slice(*p.bounds(t))]
                                               for x, p in zip(masks.positions, (block.q_part, block.kv_part))))
    if offset is None:
        return block
    cut = crop_to_band(block, block.mask.with_window(masks.window, offset), t)
    return None if cut is None else Block(cut.q_part, cut.kv_part, block.mask)


class ShardGrads:
    """Float32 dK/dV of every ring shard side by side ([R, b, t, hk, d] each; the own block's at
    ``source``): all-gather KV's (one reduce-scatter then sums the ranks') and the replay's (it
    sums the devices' in the mesh's order). :class:`DKVTrail`'s interface; nothing travels."""

    def __init__(self, ring: int, dk, dv, source: int):
        self.dk, self.dv = (torch.zeros((ring, *x.shape), dtype=torch.float32, device=x.device) for x in (dk, dv))
        self.dk[source], self.dv[source] = dk, dv  # widened as they are copied in

    def current(self, source: int | None = None) -> list:
        return [self.dk[source], self.dv[source]]

    def send(self, hop: Hop | None) -> None:
        return None


class BlockGrads(tuple):
    """(dq, dk, dv) of a block with the block they belong to (``block``: cropped or not)."""

    block: Block

    def __new__(cls, grads, block: Block):
        self = super().__new__(cls, grads)
        self.block = block
        return self


def attend_block(backend, scale, q, block: Block, kv, masks: VisitMasks | None = None):
    """(o_b, lse_b) of ``q[block.q_part]`` attending to ``kv[block.kv_part]``, or None when the
    block is skipped (out of the window, or no pair of one document: see :func:`_kernel_mask`).
    The local block (own K/V: equal positions and ids) is never None."""
    call = _kernel_mask(block, masks)
    if call is None:
        return None
    mask, extras = call
    k_cur, v_cur = kv
    return backend.fwd(_part(q, block.q_part, 1), _part(k_cur, block.kv_part, 1), _part(v_cur, block.kv_part, 1),
                       mask, scale, **extras)


def merge_block(backend, scale, q, block: Block | None, kv, state, masks: VisitMasks | None = None) -> None:
    """Merge ``q[block.q_part]`` attending to the visiting ``kv`` into ``state = (o, lse)`` in
    place (nothing for a masked or skipped block; a windowed block on static positions cropped to
    its band, a token-index block to its shared documents: :func:`crop_block`)."""
    block = None if block is None else crop_block(block, masks)
    partial = None if block is None else attend_block(backend, scale, q, block, kv, masks)
    if partial is None:
        return
    o, lse = state
    merge_partials_into(_rows(o, block.q_part), _part(lse, block.q_part, 2), *partial)


def grad_block(backend, scale, saved, block: Block | None, kv, masks: VisitMasks | None = None):
    """(dq, dk, dv) of one block against the visiting ``kv`` (None for a masked or skipped
    block); ``saved = (q, o, lse, do, dlse)`` of this rank (o and lse final: sinks merged in).
    A block is cropped (:func:`crop_block`: a windowed one to its band, a token-index one to its
    shared documents): the result is a :class:`BlockGrads` naming the block its gradients cover,
    which :func:`add_grads` follows."""
    block = None if block is None else crop_block(block, masks)
    call = None if block is None else _kernel_mask(block, masks)
    if call is None:
        return None
    mask, extras = call
    (q, o, lse, do, dlse), (k_cur, v_cur) = saved, kv
    qp, kp = block.q_part, block.kv_part
    return BlockGrads(backend.bwd(_part(do, qp, 1), _part(q, qp, 1), _part(k_cur, kp, 1), _part(v_cur, kp, 1),
                                  _part(o, qp, 1), _part(lse, qp, 2), mask, scale,
                                  None if dlse is None else _part(dlse, qp, 2), **extras), block)


def add_grads(block: Block | None, grads, dq, dkv) -> None:
    """dq[q_part] += dq_b; dk, dv (of the visiting shard)[kv_part] += dk_b, dv_b — in place."""
    if grads is None:
        return
    block = getattr(grads, "block", block)  # the block the gradients cover (cropped: crop_block)
    dq_b, dk_b, dv_b = grads
    _rows(dq, block.q_part).add_(dq_b)
    _rows(dkv[0], block.kv_part).add_(dk_b)
    _rows(dkv[1], block.kv_part).add_(dv_b)


def add_sinks(o, lse, sinks):
    """The attention sinks entered once per row after every block merged: o [b, t, h, d],
    lse [b, h, t], sinks [h] -> (o_f, lse_f) float32 with lse_f = logaddexp(lse, sinks[h]) and
    o_f = o·exp(lse - lse_f) (a row that saw no key: o_f = 0, lse_f = its sink). ``sinks`` None:
    (o, lse) unchanged."""
    if sinks is None:
        return o, lse
    sink = sinks.float()[None, :, None]  # [1, h, 1]
    lse_f = torch.logaddexp(lse.float(), sink)
    return o.float() * torch.exp(lse.float() - lse_f).transpose(1, 2).unsqueeze(-1), lse_f


def finish_output(o, lse, sinks, dtype):
    """The forward's final (o in ``dtype``, lse): the sinks entered once per row after every block
    merged (:func:`add_sinks`, on every row in float32), then o cast (``o``: a tensor or a
    :class:`Float32Rows` accumulator)."""
    if sinks is None:
        return as_dtype(o, dtype), lse
    o, lse = add_sinks(o.full() if isinstance(o, Float32Rows) else o, lse, sinks)
    return o.to(dtype), lse


def sinks_grad(o, lse, do, dlse, sinks):
    """The sinks' gradient from the rows given (this rank's): -Σ over (b, t) of P_sink·(D - dlse),
    with the FINAL o [b, t, h, d] and lse [b, h, t] (sinks merged in), P_sink = exp(sinks[h] -
    lse), D = rowsum(dO∘O) (``dlse`` None: lse unused). [h] float32."""
    p_sink = torch.exp(sinks.float()[None, :, None] - lse.float())  # [b, h, t]
    delta = torch.einsum("bthd,bthd->bht", do.float(), o.float())
    if dlse is not None:
        delta = delta - dlse.float()
    return -(p_sink * delta).sum(dim=(0, 2))


def attend_visits(q, config: AttentionConfig, schedule: Schedule, masks: ShardMasks, me: int, visits):
    """(o, lse) of rank ``me``'s visits, ``visits`` yielding ``(visit, kv)`` in the schedule's
    order (:class:`KVWalk`; all-gather KV's and the replay's resident shards): its own block, then
    every visiting K/V merged by LSE into its accumulator, float32 on the rows they touch
    (:class:`Float32Rows`; one step: the kernel's output as it is)."""
    backend = config.backend()
    for visit, kv in visits:
        visit_masks = masks.visit(me, visit.source)
        if visit.step.local:  # own K/V, never empty
            o, lse = attend_block(backend, config.scale, q, visit.block, kv, visit_masks)
            o = Float32Rows(o) if schedule.size > 1 else o  # float32 on the rows other blocks merge into
        else:
            merge_block(backend, config.scale, q, visit.block, kv, (o, lse), visit_masks)
    return o, lse


def grad_visits(saved, config: AttentionConfig, schedule: Schedule, masks: ShardMasks, me: int, visits,
                start_dkv: Callable):
    """(dq, dkv) of rank ``me``'s visits (``saved = (q, o, lse, do, dlse)``; ``visits`` as
    :func:`attend_visits`'s): its own block's gradients start dq (:class:`Float32Rows`) and the dK/dV accumulators
    ``start_dkv(dk, dv, source)`` in the kernel's dtype (:class:`DKVTrail`: they travel;
    :class:`ShardGrads`: they stay; each stores them in float32),
    every visited block adds into the ``current(source)`` ones, then ``send(step.dkv_hop)``. With
    one step: (dq, (dk, dv)) as the kernel returned them. Blocks the forward skipped are skipped again."""
    backend = config.backend()
    for visit, kv in visits:
        visit_masks = masks.visit(me, visit.source)
        grads = grad_block(backend, config.scale, saved, visit.block, kv, visit_masks)
        if visit.step.local:
            assert grads.block == visit.block, "an own block is never cropped: its gradients are the shard's"
            dq, dk, dv = grads
            if schedule.size == 1:
                return dq, (dk, dv)
            dq = Float32Rows(dq)  # float32 on the rows other blocks add into (kernels may return bf16)
            dkv = start_dkv(dk, dv, visit.source)  # each accumulator widens them as it stores them
        else:
            add_grads(visit.block, grads, dq, dkv.current(visit.source))  # once the shard's dK/dV have arrived
        dkv.send(visit.step.dkv_hop)  # dK/dV of the shard just visited move on with it (a DKVTrail)
    return dq, dkv


def walk_forward(q, k, v, groups, config: AttentionConfig, schedule: Schedule, masks: ShardMasks):
    """One rank's forward over ``schedule`` (ring or double ring): :func:`attend_visits` with K/V
    travelling (:class:`KVWalk`). Returns (o, lse, kv_first), kv_first the K/V received for step
    1 when the schedule's backward reuses them (else None). ``masks``: packed documents and
    window of the call (:class:`ShardMasks`)."""
    k, v = k.contiguous(), v.contiguous()  # they are sent as they are
    walk = KVWalk(schedule, config.comm, groups, (k, v), keep_first=schedule.backward_reuses_first_kv)
    o, lse = attend_visits(q, config, schedule, masks, ring_index(groups), walk)
    return o, lse, walk.first


def walk_backward(q, k, v, o, lse, kv_first, do, dlse, groups, config: AttentionConfig, schedule: Schedule,
                  masks: ShardMasks):
    """One rank's backward over ``schedule``: K/V travel again (from ``kv_first`` when the
    forward kept it), the visited shard's float32 dK/dV follow it one hop behind (the step's
    ``dkv_hop``: ring, inner, or diagonal after a double-ring round; :class:`DKVTrail`), dq stays
    local (:func:`grad_visits`)."""
    walk = KVWalk(schedule, config.comm, groups, (k.contiguous(), v.contiguous()), first=kv_first)
    trail = lambda dk, dv, source: DKVTrail(config.comm, groups, dk, dv, schedule)
    dq, dkv = grad_visits((q, o, lse, do, dlse), config, schedule, masks, ring_index(groups), walk, trail)
    if schedule.size == 1:
        return dq, *dkv
    return dq, *dkv.current()  # after R hops, this shard's own


class _Attention(torch.autograd.Function):
    """Autograd for a (forward, backward) pair; see :func:`attention_with_vjp`."""

    # forward's arguments after ctx, in order: backward returns one gradient (or None) for each
    ARGUMENTS = ("forward", "backward", "q", "k", "v", "groups", "config", "segment_ids", "token_index", "sinks")

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, groups, config: AttentionConfig, segment_ids, token_index, sinks):
        # An unused output's gradient arrives as None rather than zeros, so the kernels know
        # there is no lse cotangent without inspecting a tensor (a device sync on GPUs).
        ctx.set_materialize_grads(False)
        with deterministic_kernels(config.deterministic):
            return _Attention._forward(ctx, forward, backward, q, k, v, groups, config, segment_ids, token_index,
                                       sinks)

    @staticmethod
    def _forward(ctx, forward, backward, q, k, v, groups, config: AttentionConfig, segment_ids, token_index, sinks):
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        ctx.kv_dtype = k.dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        ring = axis_size(groups[0]) * axis_size(groups[1])
        host = _call_host_shards(ring, segment_ids, token_index)  # before any collective: it may refuse
        ids_all = gather_segment_ids(segment_ids, groups, config.comm)  # once, for both passes
        index_all = gather_token_index(token_index, groups, config.comm)  # likewise (config.token_index: given)
        masks = ShardMasks.build(config, ring, q.shape[1], ids_all, q.device, index_all, host)
        o, lse, extra = forward(q, k, v, groups, config, masks)
        o, lse = finish_output(o, lse, sinks, q.dtype)  # the backward sees the final o, lse
        if host is not None:  # a host copy that differs from the gathered ids: NaN, never a quiet wrong answer
            bad = _host_mismatch(ring, ids_all, index_all)
            o, lse = (x.masked_fill(bad, float("nan")) for x in (o, lse))
        ctx.save_for_backward(q, k, v, o, lse, *(() if sinks is None else (sinks,)), *(extra or ()))
        ctx.groups, ctx.config, ctx.backward_fn, ctx.masks = groups, config, backward, masks
        ctx.has_sinks = sinks is not None
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        with deterministic_kernels(ctx.config.deterministic):
            return _Attention._backward(ctx, do, dlse)

    @staticmethod
    def _backward(ctx, do, dlse):
        q, k, v, o, lse, *rest = ctx.saved_tensors
        sinks, extra = (rest[0], rest[1:]) if ctx.has_sinks else (None, rest)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = ctx.backward_fn(q, k, v, o, lse, tuple(extra) or None, do, dlse, ctx.groups, ctx.config,
                                     ctx.masks)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[_Attention.ARGUMENTS.index("sinks")]:  # this rank's rows
            dsinks = sinks_grad(o, lse, do, dlse, sinks).to(sinks.dtype)
        grads = {"q": as_dtype(dq, q.dtype), "k": as_dtype(dk, ctx.kv_dtype), "v": as_dtype(dv, ctx.kv_dtype),
                 "sinks": dsinks}
        return tuple(grads.get(name) for name in _Attention.ARGUMENTS)


def attention_with_vjp(forward: Callable, backward: Callable) -> Callable:
    """A differentiable ``(q, k, v, groups, config: AttentionConfig, segment_ids=None, sinks=None,
    token_index=None) -> (o, lse)`` from ``forward(q, k, v, groups, config, masks) -> (o, lse, extra)`` and
    ``backward(q, k, v, o, lse, extra, do, dlse, groups, config, masks) -> (dq, dk, dv)``:
    ``extra`` (K/V the forward received) is saved for the backward; ``segment_ids`` (this rank's
    [b, t], no gradient) are all-gathered once (:func:`gather_segment_ids`) and, with
    ``token_index`` (this rank's [b, t] or None; gathered once, :func:`gather_token_index`) or
    ``config.window``'s shard positions, make the call's :class:`ShardMasks`, kept for the
    backward. ``sinks`` ([h] logits of this rank's heads, or None) are merged into the forward's
    final (o, lse) (:func:`add_sinks`); their gradient is this rank's rows' contribution
    (:func:`sinks_grad`), which the caller's autograd sums into ``sinks.grad``."""
    return lambda q, k, v, groups, config, segment_ids=None, sinks=None, token_index=None: _Attention.apply(
        forward, backward, q, k, v, groups, config, segment_ids, token_index, sinks)
