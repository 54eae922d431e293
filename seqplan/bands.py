"""A windowed block as a band of its local grid, for the fused kernels' own sliding windows.

When a block's queries and keys are each one contiguous run of original positions (every block
of the contiguous layout, zigzag's half-shard blocks), its window is a band of the local [t, s]
grid: with δ = q_pos[0] - kv_pos[0] (:attr:`BlockMask.offset`), key j is visible to query i when

    lo <= j - i <= hi,    lo = δ - left,    hi = δ + right    (and hi <= 0 on a causal block)

FlashAttention's window (FA2, FA3) is such a band aligned to the grid's bottom-right corner:
j - i in [(s - t) - window_left, (s - t) + window_right], both sizes non-negative (-1: unbounded).
:func:`band` crops the block to the rows that see a key and the keys some row sees, which makes
both sizes non-negative; the adapter writes o = 0, lse = -inf for the rows left out and zero
dK / dV for the keys left out. NumPy only; each framework's window adapter calls it with static
ints (torch on the host, JAX at trace time from the loop's static offset).

Both loops also crop a visited block to its band before the kernel (:func:`crop_to_band`), so the
merge, the dQ add and the dK / dV adds cover the band's rows and keys, not the shard's: the
window ring's one halo block is a 4096-row band of a 32k-row shard at window 4096.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schedule import UNBOUNDED, Block, BlockMask, MaskKind, Span


@dataclass(frozen=True)
class Band:
    """The cropped block: rows [i0, i1), keys [j0, j1), and the window sizes of the bottom-right
    aligned convention for it (-1: unbounded)."""

    i0: int
    i1: int
    j0: int
    j1: int
    left: int
    right: int


def band(t: int, s: int, lo: int, hi: int | None) -> Band | None:
    """The sub-block of a [t, s] grid that holds the pairs lo <= j - i <= hi (``hi`` None: no
    upper bound) and the window for it, or None when no pair is visible (``lo > hi`` among them:
    a causal block whose window ends before its diagonal)."""
    if hi is not None and lo > hi:
        return None
    i0 = 0 if hi is None else max(0, -hi)
    i1 = min(t, s - lo)
    j0 = max(0, lo)
    j1 = s if hi is None else min(s, t + hi)
    if i0 >= i1 or j0 >= j1:
        return None
    lo_c, offset = lo - j0 + i0, (j1 - j0) - (i1 - i0)
    right = -1 if hi is None else hi - j0 + i0 - offset
    return Band(i0, i1, j0, j1, offset - lo_c, right)


def contiguous_start(positions) -> int | None:
    """positions[0] when the positions are p, p + 1, ..., else None (NumPy ints)."""
    values = np.asarray(positions)
    start = int(values[0])
    return start if np.array_equal(values, np.arange(start, start + len(values))) else None


def part_offset(q_pos, kv_pos) -> int | None:
    """δ = q_pos[0] - kv_pos[0] when both parts are contiguous runs of original positions, else
    None (the block is then no band: the portable kernel's job)."""
    q0, k0 = contiguous_start(q_pos), contiguous_start(kv_pos)
    return None if q0 is None or k0 is None else q0 - k0


def block_band(mask: BlockMask, t: int, s: int, offset: int) -> Band | None:
    """The band of a windowed block of ``mask.kind`` (FULL or CAUSAL) whose parts are offset by
    ``offset`` (δ above), or None when it sees nothing."""
    if mask.window is None or mask.kind is MaskKind.STRICT:
        raise ValueError(f"a band needs a windowed FULL or CAUSAL block, got {mask}")
    left, right = mask.window
    hi = None if right >= UNBOUNDED else offset + right
    if mask.kind is MaskKind.CAUSAL:
        hi = 0 if hi is None else min(hi, 0)
    return band(t, s, offset - left, hi)


def crop_to_band(block: Block, mask: BlockMask, t: int) -> Block | None:
    """``block`` (its parts of a shard of ``t`` tokens) cropped to the band its windowed FULL
    ``mask`` sees (``mask.offset``: the parts' static offset, δ above): a block over the band's
    rows and keys (:class:`Span`) whose mask is the window at the cropped parts' offset — ``block``
    under ``mask`` when the band is the whole block, None when it sees nothing. Exact: a row left
    out sees no key of the block (its merge would change nothing) and a key left out gets zero dK /
    dV. CAUSAL blocks are not cropped (their diagonal is the local grid's; a crop would move it):
    the loops' causal blocks are a shard's own, whose band is the whole block."""
    whole = Block(block.q_part, block.kv_part, mask)
    if mask.kind is not MaskKind.FULL or mask.window is None or mask.offset is None:
        return whole
    (q_lo, q_hi), (kv_lo, kv_hi) = block.q_part.bounds(t), block.kv_part.bounds(t)
    cut = block_band(mask, q_hi - q_lo, kv_hi - kv_lo, mask.offset)
    if cut is None:
        return None
    if (cut.i0, cut.i1, cut.j0, cut.j1) == (0, q_hi - q_lo, 0, kv_hi - kv_lo):
        return whole
    return Block(Span(q_lo + cut.i0, q_lo + cut.i1), Span(kv_lo + cut.j0, kv_lo + cut.j1),
                 mask.with_window(mask.window, mask.offset + cut.i0 - cut.j0))
