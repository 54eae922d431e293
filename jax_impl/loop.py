"""The machinery ring, all-gather-KV and double-ring attention share: walking a
:class:`schedule.Schedule` inside ``shard_map``, one block's forward merge and backward
gradients, and the ``custom_vjp`` that joins a forward and a backward.

Shapes (per device): q, o, dq [b, t, h, d]; k, v, dk, dv [b, t, hk, d]; lse [b, h, t] float32.

Run-time block masks (keyword arguments of the block functions, made per visit by
:func:`visit_masks`):

- packed documents: ``segments = (q_ids [b, t], kv_ids [b, t])`` — the segment ids of this
  device's queries and of the visiting K/V shard — or ``None``. The ids of every ring shard are
  all-gathered once per call (:func:`gather_segment_ids`), not sent with K/V.
- sliding window: ``window = (left, right)`` (static, from the config) with ``shard_positions =
  (table [R, t], q_shard, kv_shard)``: the int32 original positions of every ring shard's tokens
  (:func:`ring_positions`: static, the layout's) and the two shards the block meets (traced or
  ints). Kernels get ``positions = (q_pos, kv_pos)`` of the block's parts.

Every block runs under one run-time decision (:func:`under_masks`: one ``lax.switch`` on a
traced index, so nothing recompiles per batch or device) from :func:`schedule.document_flags`
and :func:`schedule.window_flags`: skipped (no pair shares a document, or the window reaches no
pair), else its static mask plus the document mask unless one document covers the block, plus
the window unless it covers the block. The window's flags come from constant [R, R] tables, and
variants that no shard pair can take are not compiled (a window wider than the sequence costs
nothing; a block no device's window reaches is not compiled at all).

Attention sinks (``sinks [h]`` float logits) enter once per row after the last merge, inside the
``custom_vjp`` (:func:`attention_with_vjp`, :func:`add_sinks`); the block backward runs with the
final (o, lse), and :func:`sinks_grad` is the sinks' cotangent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from seqplan.bands import contiguous_start, crop_to_band
from seqplan.layouts import ring_positions
from seqplan.schedule import (
    Block,
    BlockMask,
    Hop,
    Part,
    Schedule,
    Step,
    document_flags,
    return_distance,
    runs,
    window_flags,
)

from .comm import Comm, axis_size
from .config import AttentionConfig, deterministic_kernels
from .kernels import branches
from .merge import Float32Rows, merge_partials

F32 = jnp.float32


def ring_index(axes):
    """This device's index on the ring over ``axes`` (an axis name, ``(outer, inner)`` — o·I + i
    — or ``None``: 0). Traced."""
    if axes is None:
        return 0
    if isinstance(axes, tuple):
        return lax.axis_index(axes[0]) * axis_size(axes[1]) + lax.axis_index(axes[1])
    return lax.axis_index(axes)


def _repeat(body: Callable, carry: tuple, positions: range, scan: bool = True) -> tuple:
    """``carry = body(*carry, p)`` for p in ``positions``: inline for one (or all, without
    ``scan``), else one ``lax.scan``."""
    if len(positions) == 1 or not scan:
        for p in positions:
            carry = body(*carry, p)
        return carry
    carry, _ = lax.scan(lambda c, p: (body(*c, p), None), carry, jnp.arange(positions.start, positions.stop))
    return carry


def walk(schedule: Schedule, kv, state, visit: Callable, *, comm: Comm, axes, after_step: Callable | None = None,
         kv_first=None, scan: bool = True):
    """Run every step of ``schedule`` on this device, K/V moving as it says, and return ``state``.

    ``visit(step, j, s, kv, state) -> state`` computes step (j, s) against the K/V in hand;
    ``step`` gives the static kind (``step.local``: the first), ``j`` and ``s`` may be traced.
    Hops go through ``comm.shift(tree, hop, axes)``; ``after_step(step, state) -> state`` follows every step
    (the backward sends the visited shard's dK/dV by ``step.dkv_hop``). ``kv_first``: the K/V of
    step 1, already received (the single ring's backward), so the first hop is not sent again.
    Consecutive steps (and rounds) of one kind run as one ``lax.scan`` whose body is traced
    once, so the program's size does not grow with the ring's; ``scan=False`` runs every step
    inline with concrete (j, s) — the eager replay's form, where a scan or a ``lax.cond`` would be
    compiled on every call."""

    def shift(hop, tree):
        return comm.shift(tree, hop, axes, **return_distance(schedule, hop))

    def one_step(step: Step, j, kv, state, s):
        if step.local and kv_first is not None:
            kv_next = kv_first
        else:
            kv_next = shift(step.kv_hop, kv) if step.kv_hop is not None else None  # overlaps the compute
        state = visit(step, j, s, kv, state)
        if after_step is not None:
            state = after_step(step, state)
        return kv_next, state

    def one_round(rnd, kv_round, state, j):
        kv_next_round = shift(rnd.kv_hop, kv_round) if rnd.kv_hop is not None else None  # hidden by the round
        kv = kv_round
        for step, positions in runs(rnd.steps):
            kv, state = _repeat(partial(one_step, step, j), (kv, state), positions, scan)
        return kv_next_round, state

    for rnd, positions in runs(schedule.rounds):
        kv, state = _repeat(partial(one_round, rnd), (kv, state), positions, scan)
    return state


def shift_halo(comm: Comm, tree: tuple, hop: Hop, axes, halo: int | None, into: tuple | None = None, **kw) -> tuple:
    """``comm.shift(tree, hop, axes)`` — or, with ``halo`` (:attr:`Schedule.halo`), only each
    array's last ``halo`` rows (axis 1) travel and arrive in those rows of ``into``'s arrays, the
    rest of ``into`` kept (the receiver's own dK/dV accumulators); ``into`` None: of zeros (K/V).
    ``kw``: the hop's distance (``return_distance``)."""
    if halo is None:
        return comm.shift(tree, hop, axes, **kw)
    if into is not None and isinstance(into[0], Float32Rows):  # the halo's rows are the float32 ones
        assert all((x.lo, x.hi) == (x.base.shape[1] - halo, x.base.shape[1]) for x in into), "not the halo's rows"
        tails = comm.shift(tuple(x.wide for x in tree), hop, axes, **kw)
        return tuple(Float32Rows(x.base, y, x.lo) for x, y in zip(into, tails))
    tails = comm.shift(tuple(x[:, -halo:] for x in tree), hop, axes, **kw)
    if into is None:
        return tuple(jnp.pad(y, [(0, 0), (x.shape[1] - halo, 0)] + [(0, 0)] * (x.ndim - 2)) for x, y in zip(tree, tails))
    return tuple(jnp.concatenate([x[:, :-halo], y], axis=1) for x, y in zip(into, tails))


def visit_block(schedule: Schedule, device, j, s, on_block: Callable, state):
    """``on_block(block, state)`` for the block ``device`` computes at (j, s) — not the local
    step. Whether the source shard is earlier than ``device``'s is the only per-device choice,
    taken with ``lax.cond`` on a traced bool (a skipped block costs nothing)."""
    plan = schedule.plan

    def branch(block: Block | None):
        return (lambda st: st) if block is None else (lambda st: on_block(block, st))

    if plan.uniform:
        return branch(plan.from_earlier)(state)
    earlier = schedule.is_earlier(device, j, s)
    if isinstance(earlier, (bool, np.bool_)):  # a concrete device and step (the replay): no lax.cond
        return branch(plan.from_earlier if earlier else plan.from_later)(state)
    return lax.cond(earlier, branch(plan.from_earlier), branch(plan.from_later), state)


def _part(x, which: Part, axis: int):
    """``x[which]`` along ``axis`` (static bounds)."""
    lo, hi = which.bounds(x.shape[axis])
    return x if which is Part.ALL else lax.slice_in_dim(x, lo, hi, axis=axis)


def _rows(acc, which: Part):
    """``acc[which]`` along the rows (axis 1), float32 where ``acc`` is a :class:`Float32Rows`."""
    return acc.rows(which) if isinstance(acc, Float32Rows) else _part(acc, which, 1)


def _put_rows(acc, which: Part, value):
    """``acc`` with rows ``which`` (axis 1) set to ``value`` (static bounds)."""
    if isinstance(acc, Float32Rows):
        return acc.put(which, value)
    if which is Part.ALL:
        return value
    return lax.dynamic_update_slice_in_dim(acc, value, which.bounds(acc.shape[1])[0], axis=1)


def as_dtype(acc, dtype):
    """An accumulator (:class:`Float32Rows`: its float32 rows cast, the rest as the kernel wrote
    them) or an array, in ``dtype``."""
    return acc.result(dtype) if isinstance(acc, Float32Rows) else acc.astype(dtype)


def _add_rows(acc, update, which: Part):
    """acc[which] += update along the rows (axis 1; static bounds)."""
    return _put_rows(acc, which, _rows(acc, which) + update)


def gather_segment_ids(ids, axes, comm: Comm):
    """Every ring shard's segment ids, [b, t] -> [b, R·t] (shard r at rows r·t), by all-gathers
    of the int32 ids: one over a ring axis; on a double ring one over the inner axis, then one
    over the outer (r = o·I + i), as torch_impl gathers over its two groups. ``None`` stays ``None``."""
    if ids is None:
        return None
    ids = ids.astype(jnp.int32)
    if axes is None:
        return ids
    for axis in (axes[1], axes[0]) if isinstance(axes, tuple) else (axes,):
        ids = comm.gather(ids, axis)
    return ids


def gather_token_index(token_index, axes, comm: Comm):
    """Every ring shard's token indices (the ``token_index`` argument: original token index per
    row, layout order), [b, t] -> int32 [b, R·t], gathered exactly as :func:`gather_segment_ids`
    gathers the ids (one more int32 all-gather per ring axis, made only when they are given).
    ``None`` stays ``None``."""
    return gather_segment_ids(token_index, axes, comm)


def shard_of(x_all, src, t: int):
    """Ring shard ``src`` (traced or int) of a gathered [b, R·t, ...] array -> [b, t, ...]."""
    return lax.dynamic_slice_in_dim(x_all, src * t, t, axis=1)


def _concrete(x) -> bool:
    return isinstance(x, (int, np.integer))


# A windowed block is compiled once per distinct static offset of its parts (BlockMask.offset) up
# to this many; beyond, one variant without the offset (the portable kernel's positions decide).
MAX_OFFSET_VARIANTS = 4


class _WindowDecision(NamedTuple):
    """The window's part of :func:`under_masks` for one block (:func:`_window_decision`,
    :func:`_index_decision`).

    options:          the static variants the block can take: None (the window covers it) or
                      ``(offset,)`` (windowed; offset None when not static).
    index:            this block's option (int or traced int32).
    reachable:        whether the window reaches any pair of it (traced bool).
    always_reachable: whether it does for every shard pair considered (static: then never skipped).
    positions:        (q_pos, kv_pos) of the block's parts, the kernel's ``positions``."""

    options: list
    index: object
    reachable: object
    always_reachable: bool
    positions: tuple


def _window_decision(block: Block, window: tuple[int, int], shard_positions, own_block: bool,
                     by_offset: bool) -> _WindowDecision:
    """The window's part of :func:`under_masks` (:class:`_WindowDecision`). ``options``: the static
    variants this block can take — None (the window covers it: no window) or ``(offset,)``
    (windowed; ``offset`` the parts' static position offset, one
    option per distinct offset when ``by_offset`` and there are at most MAX_OFFSET_VARIANTS, else
    None) — of its one shard pair when both shards are ints, of (r, r) for a device's own block,
    else of every pair (r, src != r) of the ring (a superset of the pairs the block is used for),
    so that variants no device can take are not compiled. ``index``: this pair's option (looked
    up in a constant [R, R] table at the possibly traced shard indices); ``reachable``: its
    flag, ``always_reachable``: whether every considered pair is. ``positions``: (q_pos, kv_pos)
    of the block's parts."""
    table, q_shard, kv_shard = shard_positions
    size, t = table.shape
    q_tab, kv_tab = (table[:, slice(*part.bounds(t))] for part in (block.q_part, block.kv_part))
    reach, cover = window_flags(q_tab.min(1)[:, None], q_tab.max(1)[:, None], kv_tab.min(1)[None, :],
                                kv_tab.max(1)[None, :], *window)  # [R, R] bool: query shard x key shard
    if _concrete(q_shard) and _concrete(kv_shard):
        pairs = [(int(q_shard), int(kv_shard))]
    else:
        pairs = [(r, c) for r in range(size) for c in range(size) if (r == c) == own_block]
    q0, k0 = [contiguous_start(row) for row in q_tab], [contiguous_start(row) for row in kv_tab]

    def offset(r, c):
        return None if not by_offset or q0[r] is None or k0[c] is None else q0[r] - k0[c]

    windowed = [pair for pair in pairs if reach[pair] and not cover[pair]]
    offsets = list(dict.fromkeys(offset(*pair) for pair in windowed))
    if None in offsets or len(offsets) > MAX_OFFSET_VARIANTS:
        offsets = [None]
    options = ([None] if any(reach[pair] and cover[pair] for pair in pairs) else []) + [(o,) for o in offsets if windowed]
    choice = np.zeros((size, size), np.int32)
    for r, c in windowed:
        choice[r, c] = options.index((offset(r, c) if offsets != [None] else None,))
    index = jnp.asarray(choice)[q_shard, kv_shard] if len(options) > 1 else 0
    reachable = jnp.asarray(reach)[q_shard, kv_shard]
    positions = (_part(lax.dynamic_index_in_dim(table, q_shard, keepdims=False), block.q_part, 0),
                 _part(lax.dynamic_index_in_dim(table, kv_shard, keepdims=False), block.kv_part, 0))
    return _WindowDecision(options, index, reachable, all(reach[pair] for pair in pairs), positions)


def _index_decision(block: Block, window: tuple[int, int], token_index, own_block: bool) -> _WindowDecision:
    """The window's part of :func:`under_masks` for explicit per-row token indices
    ``token_index = (q_index [b, t], kv_index [b, t])`` (traced): a :class:`_WindowDecision` as
    :func:`_window_decision`'s, decided at run time from each
    batch row's smallest and largest index (reachable in some row; covered in every row), with
    no static offset (a fused kernel takes such a block only when the window covers it)."""
    q_pos, kv_pos = _part(token_index[0], block.q_part, 1), _part(token_index[1], block.kv_part, 1)
    reach, cover = window_flags(q_pos.min(1), q_pos.max(1), kv_pos.min(1), kv_pos.max(1), *window)
    return _WindowDecision([None, (None,)], jnp.where(cover.all(), 0, 1), reach.any(), own_block, (q_pos, kv_pos))


def under_masks(block: Block, run: Callable, state, *, segments=None, window=None, shard_positions=None,
                own_block: bool = False, by_offset: bool = False, token_index=None, documents_only: bool = False):
    """``run(mask, mask_arrays, state)`` under the block's run-time decision (module docstring):
    skipped (``state`` returned), else ``mask`` = ``block.mask`` plus documents and/or the window
    where they do not cover the block, ``mask_arrays`` the kernel's keywords for it
    (``segments=``, ``positions=``: of the block's parts). ``own_block``: a device's own block
    (queries and keys of one shard), never skipped: each query sees its own key. ``by_offset``:
    the backend uses a windowed block's static offset (``BlockBackend.window_offsets``), so the
    windowed variant is split by offset. One ``lax.switch`` over the variants that can occur (the
    window's are known statically: :func:`_window_decision`); none when one can. ``segments``
    and ``window`` None: ``run(block.mask, {}, state)``. ``token_index``: per-row token indices
    of the block's two shards, which then decide the window at run time (:func:`_index_decision`)
    instead of ``shard_positions``. ``documents_only`` (a device's own block, no window, whose
    backend runs one document as one varlen run: ``BlockBackend.one_run_documents``): the
    document variant alone, also where one document covers the block — no switch here, so the
    kernel's own dispatch is the pass's one run-time decision for the block. XLA runs a switch
    by copying its index to the host, which waits for the device and then launches the branch:
    on one H200 a step of the 32k short mix had 0.91 ms of such gaps (docs/decisions.md)."""
    if segments is None and window is None:
        return run(block.mask, {}, state)
    keep, one_document, doc_options = True, True, (False,)
    if segments is not None:
        q_ids, kv_ids = _part(segments[0], block.q_part, 1), _part(segments[1], block.kv_part, 1)
        shared, one_document = document_flags(q_ids.min(1), q_ids.max(1), kv_ids.min(1), kv_ids.max(1))
        keep, doc_options = shared, ((True,) if documents_only and own_block and window is None else (False, True))
    win_index, win_options, skippable = 0, (None,), segments is not None and not own_block
    if window is not None:
        decision = (_index_decision(block, window, token_index, own_block) if token_index is not None
                    else _window_decision(block, window, shard_positions, own_block, by_offset))
        win_options, win_index, positions = decision.options, decision.index, decision.positions
        if not win_options:  # no device can reach this block: nothing to compile
            return state
        if not decision.always_reachable:
            keep, skippable = keep & decision.reachable, True
    variants = {SKIP: lambda st: st} if skippable else {}
    for documents in doc_options:
        for option in win_options:
            mask, arrays = block.mask, {}
            if documents:
                mask, arrays["segments"] = mask.with_documents(), (q_ids, kv_ids)
            if option is not None:
                mask, arrays["positions"] = mask.with_window(window, option[0]), positions
            variants[masked(documents, option)] = partial(run, mask, arrays)
    choice = mask_choice(skippable, keep, one_document, tuple(doc_options), tuple(win_options), win_index)
    return branches.select(variants, choice).switch(state)


# The names of under_masks' variants: skipped, or run under the block's mask plus documents
# (bool) and a window option (None: the window covers the block; (offset,): windowed).
SKIP, MASKED = "skip", "masked"


def masked(documents: bool, window_option) -> tuple:
    return (MASKED, documents, window_option)


def mask_choice(skippable: bool, keep, one_document, doc_options: tuple, win_options: tuple, win_index):
    """Which of :func:`under_masks`' variants a block takes: skipped when ``skippable`` and not
    ``keep`` (no pair shares a document, or the window reaches none); else masked with the
    documents unless one document covers the block (only when documents are an option), and the
    window option at ``win_index`` of ``win_options``. ``doc_options`` (True,): the documents
    variant whatever ``one_document`` says (:func:`under_masks`' ``documents_only``)."""
    window_axis = ((win_options, win_index),)
    with_documents = branches.Grid((MASKED, True in doc_options), window_axis, in_range=True)
    run = (branches.First([(one_document, branches.Grid((MASKED, False), window_axis, in_range=True))],
                          otherwise=with_documents) if False in doc_options else with_documents)
    return branches.First([(jnp.logical_not(keep), SKIP)], otherwise=run) if skippable else run


def local_forward(backend, scale, q, kv, mask: BlockMask, segments=None, window=None, shard_positions=None,
                  out_dtype=F32, token_index=None, rows: int | None = None):
    """(o, lse) of a device's own block (step 0): queries against their own shard's K/V. ``o`` in
    ``out_dtype``: float32 when other blocks merge into it, the caller's dtype when this block is
    the device's only one — cast inside each variant, where XLA drops a fused kernel's widen-then-
    narrow (a ``lax.switch`` boundary would keep a float32 copy: ≈ 0.5 ms at 32k tokens, 32 heads).
    ``rows`` (an int): o as a :class:`Float32Rows` whose first ``rows`` queries are float32 as the
    kernel computed them, the rest in ``out_dtype``."""
    def run(m, arrays, _):
        o, lse = backend.fwd(q, *kv, m, scale, **arrays)
        return (o.astype(out_dtype) if rows is None else Float32Rows.widen(o, 0, rows, out_dtype)), lse

    return under_masks(Block(Part.ALL, Part.ALL, mask), run, None, segments=segments, window=window,
                       shard_positions=shard_positions, own_block=True, by_offset=backend.window_offsets,
                       token_index=token_index, documents_only=backend.one_run_documents(q, mask.with_documents()))


def local_backward(backend, scale, saved, kv, mask: BlockMask, segments=None, window=None, shard_positions=None,
                   grad_dtypes: GradDtypes = None, token_index=None, rows: int | None = None):
    """(dq, dk, dv) of a device's own block; ``saved = (q, o, lse, do, dlse)``, in
    ``grad_dtypes`` (:func:`alone_grad_dtypes`; None: all float32, for blocks that add up) —
    with ``rows``, as :class:`Float32Rows` whose float32 rows are dq's first ``rows`` queries and
    dK / dV's last ``rows`` keys (the halo's)."""
    q, o, lse, do, dlse = saved
    dq_dtype, kv_dtype = grad_dtypes or (F32, F32)

    def run(m, arrays, _):
        dq, dk, dv = backend.bwd(do, q, *kv, o, lse, m, scale, dlse, **arrays)
        if rows is not None:
            t = dk.shape[1]
            return (Float32Rows.widen(dq, 0, rows, dq_dtype), Float32Rows.widen(dk, t - rows, t, kv_dtype),
                    Float32Rows.widen(dv, t - rows, t, kv_dtype))
        return dq.astype(dq_dtype), dk.astype(kv_dtype), dv.astype(kv_dtype)

    return under_masks(Block(Part.ALL, Part.ALL, mask), run, None, segments=segments, window=window,
                       shard_positions=shard_positions, own_block=True, by_offset=backend.window_offsets,
                       token_index=token_index, documents_only=backend.one_run_documents(q, mask.with_documents()))


def crop_block(block: Block, mask: BlockMask, arrays: dict, t: int) -> tuple[Block | None, dict]:
    """``block`` under its variant's ``mask`` cropped to its band where the mask is a window at a
    static offset (``seqplan.bands.crop_to_band``; the mask's kernel ``arrays`` — positions
    [parts], segments [b, parts] — cropped alike), so the kernel, the merge and the gradient adds
    cover the band's rows and keys, not the shard's (the window ring's halo block: the window's
    rows of the shard); (None, arrays) when it sees nothing. Static, at trace time."""
    cut = crop_to_band(block, mask, t)
    if cut is None or (cut.q_part, cut.kv_part) == (block.q_part, block.kv_part):
        return cut, arrays
    (q0, _), (k0, _) = block.q_part.bounds(t), block.kv_part.bounds(t)
    (i0, i1), (j0, j1) = cut.q_part.bounds(t), cut.kv_part.bounds(t)

    def crop(pair):
        (q_x, kv_x), axis = pair, pair[0].ndim - 1  # the sequence axis: last (positions [t], ids [b, t])
        return lax.slice_in_dim(q_x, i0 - q0, i1 - q0, axis=axis), lax.slice_in_dim(kv_x, j0 - k0, j1 - k0, axis=axis)

    return cut, {name: crop(pair) for name, pair in arrays.items()}


def merge_block(backend, scale, q, block: Block, kv, state, segments=None, window=None, shard_positions=None,
                token_index=None):
    """Merge ``q[block.q_part]`` attending to the visiting ``kv`` into ``state = (o, lse)``
    (``segments``, ``window``, ``shard_positions``: see the module docstring; a windowed variant
    at a static offset cropped to its band first: :func:`crop_block`)."""
    k_cur, v_cur = kv

    def run(mask, arrays, state):
        cut, arrays = crop_block(block, mask, arrays, q.shape[1])
        if cut is None:
            return state
        o, lse = state
        o_b, lse_b = backend.fwd(_part(q, cut.q_part, 1), _part(k_cur, cut.kv_part, 1),
                                 _part(v_cur, cut.kv_part, 1), cut.mask, scale, **arrays)
        o_p, lse_p = merge_partials(_rows(o, cut.q_part), _part(lse, cut.q_part, 2), o_b, lse_b)
        lo, _ = cut.q_part.bounds(q.shape[1])
        lse = lse_p if cut.q_part is Part.ALL else lax.dynamic_update_slice_in_dim(lse, lse_p, lo, axis=2)
        return _put_rows(o, cut.q_part, o_p), lse

    return under_masks(block, run, state, segments=segments, window=window, shard_positions=shard_positions,
                       by_offset=backend.window_offsets, token_index=token_index)


def grad_block(backend, scale, saved, block: Block, kv, state, segments=None, window=None, shard_positions=None,
               token_index=None):
    """Add one block's gradients to ``state = (dq, dk_acc, dv_acc)`` (dk/dv of the visiting
    ``kv``); ``saved = (q, o, lse, do, dlse)`` of this device; cropped as :func:`merge_block`."""
    q, o, lse, do, dlse = saved
    k_cur, v_cur = kv

    def run(mask, arrays, state):
        cut, arrays = crop_block(block, mask, arrays, q.shape[1])
        if cut is None:
            return state
        qp, kp = cut.q_part, cut.kv_part
        dq, dk_acc, dv_acc = state
        dq_b, dk_b, dv_b = backend.bwd(
            _part(do, qp, 1), _part(q, qp, 1), _part(k_cur, kp, 1), _part(v_cur, kp, 1),
            _part(o, qp, 1), _part(lse, qp, 2), cut.mask, scale, None if dlse is None else _part(dlse, qp, 2),
            **arrays)
        return _add_rows(dq, dq_b, qp), _add_rows(dk_acc, dk_b, kp), _add_rows(dv_acc, dv_b, kp)

    return under_masks(block, run, state, segments=segments, window=window, shard_positions=shard_positions,
                       by_offset=backend.window_offsets, token_index=token_index)


def visit_masks(schedule: Schedule, config: AttentionConfig, ids_all, device, j, s, t: int, index_all=None) -> dict:
    """The run-time mask keywords of ``device``'s visit (j, s) for the block functions (ints or
    traced): ``segments`` (its own ids, the visited shard's) from the ids of every ring shard
    [b, R·t] (``None``: no documents), and with ``config.window`` the window and
    ``shard_positions`` = (:func:`ring_positions` [R, t], device, visited shard) — or, given
    ``index_all`` (every shard's token indices [b, R·t]), ``token_index`` = (its own, the visited
    shard's) in place of the static positions."""
    masks = {}
    source = schedule.source(device, j, s)
    if ids_all is not None:
        masks["segments"] = shard_of(ids_all, device, t), shard_of(ids_all, source, t)
    if index_all is not None:  # explicit token indices [b, R·t]: the masks' window is on them
        masks["window"] = config.mask_window
        masks["token_index"] = shard_of(index_all, device, t), shard_of(index_all, source, t)
    elif config.window is not None:
        masks["window"] = config.window
        masks["shard_positions"] = ring_positions(config.layout, schedule.size, t), device, source
    return masks


def add_sinks(o, lse, sinks):
    """The attention sinks entered once per row after every block merged: o [b, t, h, d],
    lse [b, h, t], sinks [h] -> (o_f, lse_f) float32 with lse_f = logaddexp(lse, sinks[h]) and
    o_f = o·exp(lse - lse_f) (a row that saw no key: o_f = 0, lse_f = its sink). ``sinks`` None:
    (o, lse) unchanged."""
    if sinks is None:
        return o, lse
    sink = sinks.astype(F32)[None, :, None]  # [1, h, 1]
    lse_f = jnp.logaddexp(lse.astype(F32), sink)
    return o.astype(F32) * jnp.swapaxes(jnp.exp(lse - lse_f), 1, 2)[..., None], lse_f


def finish_output(o, lse, sinks, dtype):
    """The forward's final (o in ``dtype``, lse): the sinks entered once per row after every block
    merged (:func:`add_sinks`, every row in float32: o whole, ``config.float32_output``), then o cast
    (``o``: an array or, without sinks, a :class:`Float32Rows` accumulator)."""
    if sinks is None:
        return as_dtype(o, dtype), lse
    assert not isinstance(o, Float32Rows), "with sinks o comes whole in float32 (config.float32_output)"
    o, lse = add_sinks(o, lse, sinks)
    return o.astype(dtype), lse


def sinks_grad(o, lse, do, dlse, sinks):
    """The sinks' cotangent from this device's rows: -Σ over (b, t) of P_sink·(D - dlse), with the
    final o [b, t, h, d] and lse [b, h, t], P_sink = exp(sinks[h] - lse), D = rowsum(dO∘O)
    (``dlse`` None: lse unused). [h] float32."""
    p_sink = jnp.exp(sinks.astype(F32)[None, :, None] - lse)  # [b, h, t]
    delta = jnp.swapaxes(jnp.einsum("bthd,bthd->bth", do.astype(F32), o.astype(F32),
                                    precision=lax.Precision.HIGHEST), 1, 2)  # [b, h, t]
    if dlse is not None:
        delta = delta - dlse.astype(F32)
    return -jnp.sum(p_sink * delta, axis=(0, 2))


def alone_dtype(schedule: Schedule, dtype):
    """The dtype a device's own block returns o / dq in: ``dtype`` when the schedule has no other
    step (nothing merges into it: one device on the ring, Ulysses), else float32."""
    return dtype if len(schedule.steps) == 1 else F32


class GradDtypes(NamedTuple):
    """The dtypes a device's own block returns its gradients in (:func:`local_backward`)."""

    dq: Any
    dkv: Any


def alone_grad_dtypes(schedule: Schedule, config: AttentionConfig, dtype) -> GradDtypes:
    """:func:`alone_dtype` for dq and for dK / dV: the inputs' ``dtype`` when the block is the
    device's only one — a fused kernel's gradients are already in it, and a float32 copy at the
    block's ``lax.switch`` would be one more pass over each — except dK / dV when
    ``config.float32_kv_grads`` (replicated KV heads, summed in float32 after the call)."""
    alone = alone_dtype(schedule, dtype)
    return GradDtypes(alone, F32 if config.float32_kv_grads else alone)


def forward_visit(q, config: AttentionConfig, schedule: Schedule, me, t: int, ids_all=None, index_all=None, *,
                  own_kv=None, kv_of: Callable | None = None, rows: int | None = None) -> Callable:
    """The ``visit`` of :func:`walk` for device ``me``'s forward: its own block, then every
    visiting K/V merged by LSE into ``state = (o, lse)``. ``t``: tokens per shard; ``ids_all`` /
    ``index_all``: every shard's segment ids / token indices [b, R·t] or None. Where the K/V come
    from: ``own_kv`` for the own block (None: what the walk carries then) and ``kv_of(kv, j, s)``
    for a visit (None: the carried K/V themselves — all-gather KV and the replay carry nothing
    and slice a resident shard, :func:`resident_kv`). The own block's o is in
    :func:`alone_dtype` (float32 with ``config.float32_output``) — or, with ``rows`` (the halo
    schedule's: its one visited block merges into the first ``rows`` queries), in q's dtype with
    those rows float32 (:class:`Float32Rows`)."""
    assert rows is None or (rows == schedule.halo and len(schedule.steps) == 2), "float32 rows: the halo schedule's"
    backend = config.backend()
    # with float32_output (sinks), even a lone block's o stays float32: the sinks rescale every row
    # before the one cast to q's dtype (rounding it first put a second rounding on o, and on dq / dsinks)
    o_dtype = q.dtype if rows is not None else F32 if config.float32_output else alone_dtype(schedule, q.dtype)

    def visit(step, j, s, kv, state):
        kv = _visit_kv(step, j, s, kv, own_kv, kv_of)
        masks = visit_masks(schedule, config, ids_all, me, j, s, t, index_all)
        if step.local:  # own K/V, never empty
            return local_forward(backend, config.scale, q, kv, schedule.plan.local.mask, out_dtype=o_dtype, rows=rows,
                                 **masks)
        return visit_block(schedule, me, j, s,
                           lambda blk, st: merge_block(backend, config.scale, q, blk, kv, st, **masks), state)

    return visit


class DKVAccumulation(NamedTuple):
    """How a backward walk keeps dK / dV: ``take(state, j, s)`` -> the ``(dq, dk_acc, dv_acc)`` a
    visited block adds into, ``keep(state, j, s, grads)`` -> the state after it (own block: ``state``
    None, ``grads`` its fresh gradients). The mesh's (:data:`TRAVELLING`): one accumulator travels
    with the K/V it belongs to; the replay's: one per source shard, kept apart."""

    take: Callable
    keep: Callable


TRAVELLING = DKVAccumulation(take=lambda state, j, s: state, keep=lambda state, j, s, grads: grads)


def per_shard_accumulation(schedule: Schedule, me, t: int) -> DKVAccumulation:
    """dK / dV of every shard in one float32 [b, R·t] accumulator each, a visited block adding
    into its source's slice — all-gather KV's (a reduce-scatter then sums the devices') and the
    replay's (it sums them in the mesh's order). One shard (R = 1): the own block's gradients as
    they are."""
    def take(state, j, s):
        dq, dk_all, dv_all = state
        src = schedule.source(me, j, s)
        return dq, shard_of(dk_all, src, t), shard_of(dv_all, src, t)

    def keep(state, j, s, grads):
        dq, dk, dv = grads
        if state is None and schedule.size == 1:
            return grads
        if state is None:  # the own block's gradients start the accumulators
            whole = lambda g: jnp.zeros((g.shape[0], schedule.size * t, *g.shape[2:]), F32)
            state, j, s = (dq, whole(dk), whole(dv)), 0, 0
        at = schedule.source(me, j, s) * t
        return (dq, lax.dynamic_update_slice_in_dim(state[1], dk.astype(F32), at, axis=1),
                lax.dynamic_update_slice_in_dim(state[2], dv.astype(F32), at, axis=1))

    return DKVAccumulation(take, keep)


def resident_kv(kv_all, schedule: Schedule, me, t: int) -> Callable:
    """``kv_of`` for K/V resident whole (all-gather KV's gathered shards, the replay's global
    arrays): the visit's source shard sliced from ``kv_all`` [b, R·t, ...] each."""
    return lambda _, j, s: tuple(shard_of(x, schedule.source(me, j, s), t) for x in kv_all)


def _visit_kv(step, j, s, carried, own_kv, kv_of):
    """The K/V of visit (j, s) (:func:`forward_visit`'s ``own_kv`` and ``kv_of``)."""
    if step.local and own_kv is not None:
        return own_kv
    return carried if kv_of is None else kv_of(carried, j, s)


def backward_visit(saved, config: AttentionConfig, schedule: Schedule, me, t: int, ids_all=None, index_all=None, *,
                   own_kv=None, kv_of: Callable | None = None, grad_dtypes: GradDtypes | None = None,
                   dkv: DKVAccumulation = TRAVELLING, rows: int | None = None) -> Callable:
    """The ``visit`` of :func:`walk` for device ``me``'s backward (``saved = (q, o, lse, do, dlse)``):
    its own block's gradients, then every visited block's added (``dkv``). ``own_kv``, ``kv_of``,
    ``ids_all``, ``index_all``, ``t``: as :func:`forward_visit`; ``grad_dtypes``: the own block's
    (default :func:`alone_grad_dtypes`); ``rows`` (the halo schedule's, with dK / dV travelling): the
    own block's gradients kept in the inputs' dtype with float32 rows where the one visited block
    adds — dq's first ``rows`` queries, dK / dV's last ``rows`` keys, the rows that travel
    (:class:`Float32Rows`)."""
    backend = config.backend()
    if rows is not None:  # one visited block, its dK / dV travelling: exact (Float32Rows)
        assert rows == schedule.halo and len(schedule.steps) == 2 and dkv is TRAVELLING and grad_dtypes is None
        dtype = saved[0].dtype
        grad_dtypes = GradDtypes(dtype, F32 if config.float32_kv_grads else dtype)
    grad_dtypes = alone_grad_dtypes(schedule, config, saved[0].dtype) if grad_dtypes is None else grad_dtypes

    def visit(step, j, s, kv, state):
        kv = _visit_kv(step, j, s, kv, own_kv, kv_of)
        masks = visit_masks(schedule, config, ids_all, me, j, s, t, index_all)
        if step.local:
            grads = local_backward(backend, config.scale, saved, kv, schedule.plan.local.mask,
                                   grad_dtypes=grad_dtypes, rows=rows, **masks)
            return dkv.keep(None, j, s, grads)
        grads = visit_block(schedule, me, j, s,
                            lambda blk, st: grad_block(backend, config.scale, saved, blk, kv, st, **masks),
                            dkv.take(state, j, s))
        return dkv.keep(state, j, s, grads)

    return visit


def walk_forward(q, k, v, axes, config: AttentionConfig, schedule: Schedule, ids_all=None, index_all=None):
    """One device's forward over ``schedule`` (ring or double ring): :func:`forward_visit` walked
    with K/V travelling. ``ids_all``: every shard's segment ids (:func:`gather_segment_ids`) or
    None; ``index_all``: every shard's token indices (:func:`gather_token_index`) or None.
    Returns (o, lse, kv_first): kv_first, the K/V of step 1 (in flight while step 0 computes),
    is kept for the backward when the schedule's backward reuses it (the single ring: R-2
    backward K/V hops, not R-1), else None."""
    kv_first = (shift_halo(config.comm, (k, v), schedule.steps[0].kv_hop, axes, schedule.halo)
                if schedule.backward_reuses_first_kv else None)
    rows = None if config.float32_output else schedule.halo  # o's rows the halo block merges into, float32
    visit = forward_visit(q, config, schedule, ring_index(axes), k.shape[1], ids_all, index_all, rows=rows)
    o, lse = walk(schedule, (k, v), None, visit, comm=config.comm, axes=axes, kv_first=kv_first)
    return o, lse, kv_first


def varying_like(x, like):
    """``x`` typed as varying over every mesh axis ``like`` varies over (inside a ``shard_map``
    with ``check_vma``): a replicated input such as the sinks then gets a per-device cotangent
    from the ``custom_vjp``, and shard_map's transpose sums it over those axes. Outside
    shard_map, or without ``check_vma``, nothing to do (shard_map then sums unmapped inputs'
    cotangents itself: checked in tests/multidevice/test_jax_windows.py)."""
    missing = jax.typeof(like).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying
    return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def attention_with_vjp(forward: Callable, backward: Callable) -> Callable:
    """A differentiable ``(q, k, v, ids, index, sinks, axes, config: AttentionConfig) -> (o, lse)``
    from ``forward(q, k, v, ids, index, axes, config) -> (o, lse, extra)`` and ``backward(q, k, v,
    o, lse, extra, do, dlse, axes, config) -> (dq, dk, dv)``; ``extra`` (K/V the forward received,
    the gathered segment ids and token indices) is saved for the backward. ``ids``: this device's
    segment ids [b, t] or None, ``index``: its token indices [b, t] or None (``config.token_index``
    says whether the masks use them) — ordinary arguments (a traced array cannot be static) with
    no cotangent. ``sinks``:
    [h] float logits or None, entered after ``forward`` (:func:`add_sinks`), so ``backward`` gets
    the final o and lse; their cotangent is :func:`sinks_grad` over this device's rows (summed
    over the devices by shard_map's transpose of a replicated input). ``axes`` and ``config`` are
    static (never arrays)."""

    def forward_with_sinks(q, k, v, ids, index, sinks, axes, config):
        if sinks is not None:  # they enter every row in float32: o comes whole in float32
            config = dataclasses.replace(config, float32_output=True)
        o, lse, extra = forward(q, k, v, ids, index, axes, config)
        o, lse = finish_output(o, lse, sinks, q.dtype)
        return o, lse, extra

    @partial(jax.custom_vjp, nondiff_argnums=(6, 7))
    def attention(q, k, v, ids, index, sinks, axes, config: AttentionConfig):
        o, lse, _ = forward_with_sinks(q, k.astype(q.dtype), v.astype(q.dtype), ids, index, sinks, axes, config)
        return o, lse

    def attention_fwd(q, k, v, ids, index, sinks, axes, config):
        q, k, v = (x.value for x in (q, k, v))  # symbolic_zeros=True wraps the primals
        ids, index, sinks = (None if x is None else x.value for x in (ids, index, sinks))
        # K/V may come in float32 (Ulysses' replicated heads, so that their dK/dV leave in float32):
        # they are computed and sent in q's dtype; only the gradients keep the caller's dtype.
        kv_dtype_of = jnp.zeros((0,), k.dtype)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        o, lse, extra = forward_with_sinks(q, k, v, ids, index, sinks, axes, config)
        return (o, lse), (q, k, v, o, lse, extra, kv_dtype_of, sinks)

    def attention_bwd(axes, config, residuals, cotangents):
        q, k, v, o, lse, extra, kv_dtype_of, sinks = residuals
        do, dlse = cotangents
        # An unused output's cotangent stays symbolic: dlse arrives as None (as in torch_impl),
        # so the block kernels know there is none — fused kernels take no lse cotangent.
        do = jnp.zeros_like(o) if isinstance(do, SymbolicZero) else do
        dlse = None if isinstance(dlse, SymbolicZero) else dlse
        if kv_dtype_of.dtype == F32 and q.dtype != F32:  # K/V replicated in float32: keep their dK / dV so
            config = dataclasses.replace(config, float32_kv_grads=True)
        with deterministic_kernels(config.deterministic):  # kernels with a deterministic mode take it
            dq, dk, dv = backward(q, k, v, o, lse, extra, do, dlse, axes, config)
        dsinks = None if sinks is None else sinks_grad(o, lse, do, dlse, sinks).astype(sinks.dtype)
        return (as_dtype(dq, q.dtype), as_dtype(dk, kv_dtype_of.dtype), as_dtype(dv, kv_dtype_of.dtype), None, None,
                dsinks)

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)

    def attention_of_shards(q, k, v, ids, index, sinks, axes, config: AttentionConfig):
        return attention(q, k, v, ids, index, None if sinks is None else varying_like(sinks, q), axes, config)

    return attention_of_shards
