"""Collective building blocks shared by the algorithms (one place for the ring shift), and
:class:`Comm`, the one object through which ring, all-gather-KV and double-ring attention send.

**The communication hook.** Every K/V and dK/dV transfer of those three goes through the
:class:`Comm` in their config: ``shift`` for each :class:`schedule.Hop`, ``gather`` and
``scatter`` for all-gather KV. A probe or test subclasses :class:`Comm` and installs it with
``with using(MyComm()):`` around the call that *traces* the attention (JAX fixes the transfers
when it traces): the per-device entry points put the installed one into their config, so it is
part of the config and the backward uses the same one. ``benchmarks/overlap.py`` replaces every
hop by a local copy this way. Ulysses' all-to-alls are not routed through it. Caveat: JAX caches
traces by function, so a function already traced (``jax.jit(f)`` called before) keeps the
transfers it was traced with, inside or outside ``using`` — trace a fresh function under it.
"""

from __future__ import annotations

import jax
from jax import lax

from seqplan.hooks import HookStack
from seqplan.schedule import Hop


def axis_size(axis_name: str | None) -> int:
    """Static size of a mesh axis inside ``shard_map``; ``None`` (no axis) counts as 1."""
    return 1 if axis_name is None else int(lax.axis_size(axis_name))


def ring_shift(tree, axis_name: str, offset: int = 1):
    """Send every array in ``tree`` ``offset`` devices further on the ring (r -> r+offset mod n;
    1: the next device), receive from r-offset. One collective-permute per array."""
    n = axis_size(axis_name)
    perm = [(j, (j + offset) % n) for j in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def diagonal_shift(tree, axis_names: tuple[str, str]):
    """Send every array one step further on both axes of a 2-D ring, (o, i) -> (o+1, i+1) mod
    the axis sizes: where a double-ring shard goes after the last inner step of a round."""
    outer, inner = axis_names
    n_out, n_in = axis_size(outer), axis_size(inner)
    # Device (o, i) has index o·I + i over the pair of axes (row-major in the order given).
    perm = [(o * n_in + i, (o + 1) % n_out * n_in + (i + 1) % n_in) for o in range(n_out) for i in range(n_in)]
    return jax.tree.map(lambda x: lax.ppermute(x, tuple(axis_names), perm), tree)


def seq_to_heads(x, axis_name: str):
    """Ulysses all-to-all: [b, t/U, h, d] -> [b, t, h/U, d] (device u keeps head block u)."""
    return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x, axis_name: str):
    """Inverse Ulysses all-to-all: [b, t, h/U, d] -> [b, t/U, h, d]."""
    return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def gather_shards(x, axis_name: str):
    """All-gather along the sequence axis: [b, t/R, ...] -> [b, t, ...] (shard r at rows r·t/R)."""
    return lax.all_gather(x, axis_name, axis=1, tiled=True)


def scatter_shard_sums(x_all, axis_name: str):
    """Reduce-scatter along the sequence axis: [b, t, ...] summed over devices -> [b, t/R, ...]."""
    return lax.psum_scatter(x_all, axis_name, scatter_dimension=1, tiled=True)


class Comm:
    """The transfers of ring, all-gather-KV and double-ring attention (see the module docstring).
    Hashable by identity; subclasses override any method and call ``super()`` to send for real.
    ``axes`` is the attention's ring axis name, or ``(outer, inner)`` for the double ring."""

    def shift(self, tree, hop: Hop, axes, back: int = 0):
        """Every array of ``tree`` one ``hop`` further (one collective-permute per array);
        ``back``: the distance of a ``RETURN`` hop (a truncated ring's reach)."""
        if hop is Hop.RING:
            return ring_shift(tree, axes)
        if hop is Hop.RETURN:
            return ring_shift(tree, axes, -back)
        if hop is Hop.DIAGONAL:
            return diagonal_shift(tree, axes)
        return ring_shift(tree, axes[0] if hop is Hop.OUTER else axes[1])

    def gather(self, x, axis_name: str):
        """All-gather KV: :func:`gather_shards`."""
        return gather_shards(x, axis_name)

    def scatter(self, x_all, axis_name: str):
        """All-gather KV's dK/dV home: :func:`scatter_shard_sums`."""
        return scatter_shard_sums(x_all, axis_name)


_HOOKS: HookStack[Comm] = HookStack(Comm, Comm())
# current_comm(): the Comm the next attention call picks up (the plain one unless using());
# using(comm): route the transfers of attention calls traced inside the block through ``comm``.
current_comm, using = _HOOKS.current, _HOOKS.using
