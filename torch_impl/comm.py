"""Collective building blocks shared by the algorithms (one place for the ring shift), and
:class:`Comm`, the one object through which ring, all-gather-KV and double-ring attention send.

A ``group`` of ``None`` means "no group": one rank, no communication (mirrors ``axis_name=None``
in jax_impl).

**The communication hook.** Every K/V and dK/dV transfer of those three goes through the
:class:`Comm` in their config: ``shift`` gives the transfer object of each
:class:`schedule.Hop`, ``gather`` and ``scatter`` serve all-gather KV. A probe or test subclasses
:class:`Comm` and installs it with ``with using(MyComm()):`` around the attention call: the
per-device entry points put the installed one into their config, and the backward uses the same
one. ``benchmarks/overlap.py`` replaces every hop by a local copy this way. Ulysses' all-to-alls
are not routed through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqplan.hooks import HookStack
from seqplan.schedule import Hop


def axis_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class RingShift:
    """Sends tensors to the next rank of ``group`` and receives the previous rank's, into receive
    buffers allocated once and reused at every step (double-buffered by the caller).

    ``start(tensors, into)`` issues one batched isend/irecv and returns at once, so the caller
    computes while the transfer runs; ``wait()`` completes it."""

    def __init__(self, group, peers: tuple[int, int] | None = None):
        """``peers = (next, prev)`` as global ranks overrides the ring order of ``group``
        (``None`` then means the default group)."""
        self.group = group
        if peers is None:
            ranks = dist.get_process_group_ranks(group)
            me = dist.get_group_rank(group, dist.get_rank())
            peers = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        self.next, self.prev = peers
        self._reqs: list = []

    @classmethod
    def offset(cls, group, offset: int) -> RingShift:
        """r -> r+offset mod n on ``group`` (receiving from r-offset): a truncated ring's dK/dV home."""
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_group_rank(group, dist.get_rank())
        return cls(group, peers=(ranks[(me + offset) % len(ranks)], ranks[(me - offset) % len(ranks)]))

    @classmethod
    def diagonal(cls, outer_group, inner_group) -> RingShift:
        """(o, i) -> (o+1, i+1) mod the group sizes: where a double-ring shard goes after the last
        inner step of a round. The peer is in neither
        group; its global rank follows from ranks being affine in mesh coordinates (true of
        every ``init_device_mesh`` mesh): rank(o', i') = rank(o', i) + rank(o, i') - rank(o, i)."""
        outer, inner = dist.get_process_group_ranks(outer_group), dist.get_process_group_ranks(inner_group)
        me = dist.get_rank()
        o, i = dist.get_group_rank(outer_group, me), dist.get_group_rank(inner_group, me)

        def at(step: int) -> int:
            return outer[(o + step) % len(outer)] + inner[(i + step) % len(inner)] - me

        return cls(None, peers=(at(1), at(-1)))

    def start(self, tensors, into) -> None:
        ops = []
        for send, recv in zip(tensors, into):
            ops.append(dist.P2POp(dist.isend, send.contiguous(), self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group))
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 chunks; its own transpose, so backward is the same op."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # (a gradient may arrive strided; empty_like would copy its strides)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


class InFlight:
    """The handle of one all-to-all between its start and its wait — the forward's, then the
    backward's reverse one (:class:`_StartAllToAll` and :class:`_WaitAllToAll` share it)."""

    __slots__ = ("work",)

    def __init__(self):
        self.work = None

    def start(self, x, group):
        """Issue ``all_to_all_single`` of ``x`` and return its output, still arriving."""
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.work = dist.all_to_all_single(out, x, group=group, async_op=True)
        return out

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()  # NCCL: the current stream waits for it; the host does not
            self.work = None


class _StartAllToAll(torch.autograd.Function):
    """Forward: the all-to-all issued, its output returned before it has arrived (read it only
    through :class:`_WaitAllToAll`). Backward: its gradient is the reverse all-to-all that
    ``_WaitAllToAll.backward`` issued; it is waited for here, as late as autograd allows."""

    @staticmethod
    def forward(ctx, x, group, flight: InFlight):
        ctx.flight = flight
        return flight.start(x, group)

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.wait()
        return grad, None, None


class _WaitAllToAll(torch.autograd.Function):
    """Forward: wait for the all-to-all :class:`_StartAllToAll` issued. Backward: issue the reverse
    all-to-all of the gradient and return at once; the kernels autograd runs next (another head
    group's attention backward) run while it travels."""

    @staticmethod
    def forward(ctx, out, group, flight: InFlight):
        ctx.group, ctx.flight = group, flight
        flight.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return ctx.flight.start(grad, ctx.group), None, None


def _chunks_first(x, n: int, split_dim: int):
    """x with ``split_dim`` in n chunks, the chunk index first: [n, ...] (chunk j for rank j)."""
    chunks = x.reshape(*x.shape[:split_dim], n, x.shape[split_dim] // n, *x.shape[split_dim + 1:])
    return chunks.movedim(split_dim, 0)


def _received(recv, shape, n: int, split_dim: int, concat_dim: int):
    """The all-to-all's [n (source), ...] output as x's ``shape`` split and concatenated."""
    shape = list(shape)
    shape[split_dim] //= n
    shape[concat_dim] *= n
    return recv.movedim(0, concat_dim).reshape(shape)  # source index just before the concat dim


def _all_to_all(x, group, split_dim: int, concat_dim: int):
    """Tiled all-to-all: split ``split_dim`` into n chunks (chunk j to rank j) and concatenate
    the received chunks along ``concat_dim`` in rank order — ``lax.all_to_all(tiled=True)``."""
    n = axis_size(group)
    recv = _AllToAll.apply(_chunks_first(x, n, split_dim).contiguous(), group)  # [n (source), ...]
    return _received(recv, x.shape, n, split_dim, concat_dim)


class PendingAllToAll:
    """A tiled all-to-all in flight (the same result as :func:`_all_to_all`): issued on
    construction, read with :meth:`result`, which waits for it. Between the two the caller runs
    other kernels — Ulysses' head groups attend one group while the next group's all-to-all
    travels — and autograd does the same in the backward (:class:`_WaitAllToAll`)."""

    def __init__(self, x, group, split_dim: int, concat_dim: int):
        self.group, self.flight = group, InFlight()
        self.n, self.shape, self.split_dim, self.concat_dim = axis_size(group), x.shape, split_dim, concat_dim
        self.recv = _StartAllToAll.apply(_chunks_first(x, self.n, split_dim), group, self.flight)

    def result(self):
        recv = _WaitAllToAll.apply(self.recv, self.group, self.flight)
        return _received(recv, self.shape, self.n, self.split_dim, self.concat_dim)


def seq_to_heads(x, group):
    """Ulysses all-to-all: [b, t/U, h, d] -> [b, t, h/U, d] (rank u keeps head block u)."""
    return _all_to_all(x, group, split_dim=2, concat_dim=1)


def heads_to_seq(x, group):
    """Inverse Ulysses all-to-all: [b, t, h/U, d] -> [b, t/U, h, d]."""
    return _all_to_all(x, group, split_dim=1, concat_dim=2)


def start_seq_to_heads(x, group) -> PendingAllToAll:
    """:func:`seq_to_heads`, issued now and read later."""
    return PendingAllToAll(x, group, split_dim=2, concat_dim=1)


def start_heads_to_seq(x, group) -> PendingAllToAll:
    """:func:`heads_to_seq`, issued now and read later."""
    return PendingAllToAll(x, group, split_dim=1, concat_dim=2)


def _single(name: str, older: str):
    """torch ≥ 2.13 names the single-tensor collectives ``*_single`` (the older names warn)."""
    return getattr(dist, name, None) or getattr(dist, older)


def gather_shards(x, group, async_op: bool = False):
    """All-gather: every rank's ``x`` stacked in rank order, ``[R, *x.shape]`` (with ``async_op``,
    ``(result, work)``: wait on ``work`` before reading the result)."""
    n = axis_size(group)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _single("all_gather_single", "all_gather_into_tensor")(out, x.contiguous(), group=group, async_op=async_op)
    out = out.view(n, *x.shape)
    return (out, work) if async_op else out


def scatter_shard_sums(x_all, group, async_op: bool = False):
    """Reduce-scatter: ``x_all: [R, ...]`` summed over ranks; this rank's slice ``[...]`` (with
    ``async_op``, ``(result, work)``: wait on ``work`` before reading the result)."""
    out = torch.empty(x_all.shape[1:], dtype=x_all.dtype, device=x_all.device)
    work = _single("reduce_scatter_single", "reduce_scatter_tensor")(
        out, x_all.reshape(-1, *x_all.shape[2:]).contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def check_ranks_agree(fields: dict[str, tuple[int, ...]], mesh) -> None:
    """Raise the same ``ValueError`` on every rank of ``mesh`` if any rank's ``fields`` (name ->
    small ints: local shapes, dtype codes, options) differ from another's; otherwise return.

    One MAX all-reduce of [fields, -fields] per mesh dimension, in mesh-dimension order: after
    dimension j every rank holds the max over the ranks that differ from it in dimensions <= j,
    so after the last one every rank holds the mesh-wide max and min of every field — the same
    numbers everywhere, hence the same verdict, and every rank makes the same calls whatever its
    inputs (no rank can be left waiting). It costs one device-to-host copy, which is why it is
    opt-in (``check_ranks=True``; by default ``RINGBRIDGE_CHECK_RANKS=1``, like
    ``TORCH_DISTRIBUTED_DEBUG``): without it, ranks whose
    K/V shapes disagree fail in (or time out of) the first collective, and a mismatch in q alone or
    in the options goes unnoticed."""
    names = list(fields)
    width = max(len(v) for v in fields.values())
    rows = [list(fields[n]) + [0] * (width - len(fields[n])) + [len(fields[n])] for n in names]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(rows, dtype=torch.int64, device=device)
    both = torch.cat([mine, -mine])
    for dim in range(mesh.ndim):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    high, low = both[: len(names)].cpu(), (-both[len(names):]).cpu()
    differ = [f"{n}: from {_field(low[i])} to {_field(high[i])}" for i, n in enumerate(names) if not torch.equal(low[i], high[i])]
    if differ:
        raise ValueError(f"ranks of the mesh disagree on their inputs (every rank must pass the same local "
                         f"shapes, dtypes and options): {'; '.join(differ)}")


def _field(row) -> str:
    """A field's row back as text (shown elementwise min / max, the last entry its length)."""
    values = row.tolist()
    return str(tuple(values[: values[-1]]))


class Comm:
    """The transfers of ring, all-gather-KV and double-ring attention (see the module docstring).
    Hashable by identity; subclasses override any method and call ``super()`` to send for real.
    ``groups`` is ``(outer_group, inner_group)``; the single ring passes ``(None, group)``."""

    def shift(self, hop: Hop, groups, back: int = 0) -> RingShift:
        """A transfer object (``start(tensors, into)``, ``wait()``) for ``hop`` on ``groups``;
        ``back``: the distance of a ``RETURN`` hop (a truncated ring's reach)."""
        outer, inner = groups
        if hop in (Hop.RING, Hop.INNER):
            return RingShift(inner)
        if hop is Hop.RETURN:
            return RingShift.offset(inner, -back)
        if hop is Hop.OUTER:
            return RingShift(outer)
        if axis_size(outer) == 1:  # a diagonal step on a 1 x I (or O x 1) ring is a plain one
            return RingShift(inner)
        if axis_size(inner) == 1:
            return RingShift(outer)
        return RingShift.diagonal(outer, inner)

    def gather(self, x, group, async_op: bool = False):
        """All-gather KV: :func:`gather_shards`."""
        return gather_shards(x, group, async_op=async_op)

    def scatter(self, x_all, group, async_op: bool = False):
        """All-gather KV's dK/dV home: :func:`scatter_shard_sums`."""
        return scatter_shard_sums(x_all, group, async_op=async_op)


_HOOKS: HookStack[Comm] = HookStack(Comm, Comm())
# current_comm(): the Comm the next attention call picks up (the plain one unless using());
# using(comm): route the transfers of attention calls made inside the block through ``comm``.
current_comm, using = _HOOKS.current, _HOOKS.using


def host_to_device(x, device) -> torch.Tensor:
    """A NumPy array on ``device`` without waiting for the GPU's queued work: through pinned memory,
    non-blocking (a copy from pageable memory waits for the stream first — a host sync). A
    read-only array (a ``host_ids`` block's) is copied first: torch takes no read-only memory."""
    tensor = torch.from_numpy(x if x.flags.writeable else x.copy())
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
