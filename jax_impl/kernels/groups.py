"""The one call's backward in two groups of runs (all-gather KV: a device's queries against every
key, ``runs.prefix_plans``).

FlashAttention-3's varlen backward launches a grid of (length bound / 128) key tiles × heads ×
run slots, whatever each run's length: a tile past its run's keys starts, reads the offsets and
exits. Those empty tiles cost about 16 ns of the device each (fitted on the per-GPU attention
time of the 128k short and heavy-tail mixes over 4x H200, 2026-11-27: the per-device ordering
and spread of eight profiles; docs/gpu/documents-2026-11-27-h200x4.md, "Run 8"), and a device of
the per-document hybrid holds short and long runs together — a shared document's early chunk
sees a few keys, its late chunk the whole document — so one call over 17 runs padded to 32 slots
and bounded by the longest run's 38k keys launches ten times the tiles it needs.

So the backward may run as two calls over the same packed queries and keys: the runs with more
keys than a threshold θ (the long group: few slots, the longest run's bound) and the others (the
short group: many slots, a bound at most θ), each selected with FlashAttention's ``seqused_q`` /
``seqused_k`` (a run keeps its offsets; the queries and keys of the other group are skipped, and
their rows of this call's outputs are never written, so the two calls' outputs are combined by
group). θ is chosen on the device among the length ladder's rungs to launch the fewest tiles; the
split is taken only when it launches at most ``SPLIT_AT_MOST`` of the one call's tiles (the top
rung — no long run — is the one call of before): the second call has costs the tile count leaves
out (its own preprocess and postprocess kernels, a second set of packed gradients and the select
that stitches them). The forward needs none of this: its varlen scheduler is persistent (one
program per SM walking the real tiles). The tile is 128 keys (head dims up to 128 on sm90; FA3
takes 96 or 80 for larger ones: the count is then an underestimate, the choice still sound).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import branches
from .runs import VarlenRuns, smallest_holding

TILE_KEYS = 128  # the backward's key tile (hdim 128, sm90): what its grid is counted in
SPLIT_AT_MOST = 0.75  # of the one call's launched tiles: a smaller saving keeps the one call
GROUP, SKIP = "group", "skip"


@dataclasses.dataclass(frozen=True)
class RunSplit:
    """Which runs of a plan go to the long call, and each call's variant.

    long:   bool [M] over the plan's run slots (False for padding).
    choices: (long call, short call), each a :class:`branches.Choice` over :func:`group_variants`'
            names: SKIP for an empty group, else (GROUP, slots, bound)."""

    long: jax.Array
    choices: tuple[branches.Choice, branches.Choice]


def launched_tiles(slots, bound):
    """Key tiles × slots the backward launches for a call (per head): its grid."""
    return slots * ((bound + TILE_KEYS - 1) // TILE_KEYS)


def split_runs(runs: VarlenRuns, sizes: tuple[int, ...], ladder: tuple[int, ...], always: bool = False) -> RunSplit:
    """The split of ``runs`` (a plan over M slots, every real run first) that launches the fewest
    tiles: for each rung θ of ``ladder``, the runs with more than θ keys take the long call (slots
    and bound: the smallest of ``sizes`` / ``ladder`` holding them), the others the short one — or
    the one call (θ the top rung, which ``ladder`` must hold every run under: no long run) unless
    the best split launches at most ``SPLIT_AT_MOST`` of its tiles. ``always``: the cheapest split
    with runs in both calls wherever one exists, whatever it saves — for checks, whose small problems
    would otherwise keep the one call and leave the two calls unchecked."""
    lq, lk = jnp.diff(runs.cu_q), jnp.diff(runs.cu_k)
    real = lq > 0  # padding slots are empty; a real run has a query and a key (the plan's ok)
    sizes_a, ladder_a = jnp.asarray(sizes, jnp.int32), jnp.asarray(ladder, jnp.int32)
    long = real[None, :] & (lk[None, :] > ladder_a[:, None])  # [θ, M]
    short = real[None, :] & ~long
    n_long, n_short = long.sum(1), short.sum(1)
    slot_long, slot_short = smallest_holding(sizes_a, n_long), smallest_holding(sizes_a, n_short)
    bound_long = jnp.broadcast_to(smallest_holding(ladder_a, jnp.max(jnp.where(real, lk, 0))), n_long.shape)
    bound_short = smallest_holding(ladder_a, jnp.max(jnp.where(short, lk[None, :], 0), axis=1))
    cost = (jnp.where(n_long > 0, launched_tiles(sizes_a[slot_long], ladder_a[bound_long]), 0)
            + jnp.where(n_short > 0, launched_tiles(sizes_a[slot_short], ladder_a[bound_short]), 0))
    if always:
        both = (n_long > 0) & (n_short > 0)
        cheapest = jnp.argmin(jnp.where(both, cost, jnp.iinfo(jnp.int32).max))
        best = jnp.where(both[cheapest], cheapest, len(ladder) - 1)
    else:
        cheapest = jnp.argmin(cost)
        best = jnp.where(cost[cheapest] <= SPLIT_AT_MOST * cost[-1], cheapest, len(ladder) - 1)
    choice = lambda n, slot, bound: branches.First(
        [(n[best] == 0, SKIP)], otherwise=branches.Grid((GROUP,), ((sizes, slot[best]), (ladder, bound[best])),
                                                         in_range=True))
    return RunSplit(long[best], (choice(n_long, slot_long, bound_long), choice(n_short, slot_short, bound_short)))


def group_runs(runs: VarlenRuns, members, m: int) -> VarlenRuns:
    """The runs of ``runs`` where ``members`` [M] as a call of ``m`` slots over the same packed
    queries and keys: each member keeps its offsets, its lengths go to ``used_q`` / ``used_k``
    (FlashAttention's seqused), the slots past the members are empty at the end."""
    total = runs.cu_q.shape[0] - 1
    at = jnp.nonzero(members, size=m, fill_value=total)[0]
    real, safe = at < total, jnp.minimum(at, total - 1)
    lq, lk = jnp.diff(runs.cu_q), jnp.diff(runs.cu_k)
    offsets = lambda cu: jnp.concatenate([jnp.where(real, cu[safe], cu[total]), cu[total:]]).astype(jnp.int32)
    used_k = jnp.where(real, lk[safe], 0).astype(jnp.int32)
    return dataclasses.replace(runs, cu_q=offsets(runs.cu_q), cu_k=offsets(runs.cu_k),
                               used_q=jnp.where(real, lq[safe], 0).astype(jnp.int32), used_k=used_k,
                               longest=jnp.max(used_k))


def group_variants(call, runs: VarlenRuns, members, sizes, ladder, t: int, s: int, empty) -> dict:
    """Each variant of one group's call: ``call(group runs bounded)`` for every slot count and
    bound, and SKIP (``empty()``: outputs no row of which is read)."""
    variants = {SKIP: empty}
    for m in sizes:
        for bound in ladder:
            variants[(GROUP, m, bound)] = (
                lambda m=m, bound=bound: call(group_runs(runs, members, m).bounded(min(bound, t), min(bound, s))))
    return variants


def per_position(cu, flags, total: int):
    """A run flag ([M] over ``cu``'s runs) at every packed position [total] inside a run (past the
    last run: the last slot's flag — the caller drops those rows)."""
    f = flags.astype(jnp.int32)
    steps = f - jnp.concatenate([jnp.zeros((1,), jnp.int32), f[:-1]])
    marks = jnp.zeros((total + 1,), jnp.int32).at[cu[:-1]].add(steps, mode="drop")  # empty runs: no position
    return jnp.cumsum(marks)[:total] > 0
