"""Tier 1 — the fused window adapters (torch_impl/kernels/window.py on FA2, jax_impl's fa3 on FA3)
hand the kernel a cropped block and two window sizes (``seqplan.bands``); the kernel reads them as
a band aligned to the block's bottom-right corner. Why this tier exists: that translation is
integer arithmetic a GPU run would only catch as a wrong number — here it is proved pair by pair
against the window it stands for, and the block's band against ``BlockMask.visible``; the loops'
crop of a visited block to its band (``crop_to_band``) keeps every visible pair, at the right
offset, and no row or key that sees nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from seqplan.bands import band, block_band, crop_to_band, part_offset
from seqplan.schedule import UNBOUNDED, Block, BlockMask, MaskKind, Part


def _fa2_visible(t: int, s: int, left: int, right: int) -> np.ndarray:
    """FA2's sliding window on a [t, s] block: query i sees key j when
    (s - t) - left <= j - i <= (s - t) + right (-1: unbounded)."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    low = -np.inf if left < 0 else (s - t) - left
    high = np.inf if right < 0 else (s - t) + right
    return (j - i >= low) & (j - i <= high)


@pytest.mark.parametrize("t, s", [(1, 1), (5, 5), (4, 9), (9, 4), (8, 8)])
def test_band_is_the_window_it_stands_for(t, s):
    for lo, hi in itertools.product(range(-12, 13), [*range(-12, 13), None]):
        i, j = np.arange(t)[:, None], np.arange(s)[None, :]
        want = (j - i >= lo) & (True if hi is None else (j - i <= hi))
        cut = band(t, s, lo, hi)
        if not want.any():
            assert cut is None, (t, s, lo, hi)
            continue
        assert cut is not None and cut.left >= 0 and (cut.right >= 0 or (hi is None and cut.right == -1))
        got = np.zeros((t, s), bool)
        got[cut.i0:cut.i1, cut.j0:cut.j1] = _fa2_visible(cut.i1 - cut.i0, cut.j1 - cut.j0, cut.left, cut.right)
        np.testing.assert_array_equal(got, want, err_msg=str((t, s, lo, hi, cut)))


@pytest.mark.parametrize("kind", [MaskKind.FULL, MaskKind.CAUSAL])
def test_block_band_is_the_masks_window(kind):
    """Every (offset, window) of small blocks: the band's pairs are exactly BlockMask.visible's —
    a causal block's offsets included (the loops build none, but a window ending before the
    diagonal must see nothing, not everything)."""
    t = s = 6
    for q0, k0, left, right in itertools.product([0, 3, 6, 11], [0, 5, 6], [0, 1, 4, 7], [0, 2, UNBOUNDED]):
        q_pos, kv_pos = np.arange(q0, q0 + t), np.arange(k0, k0 + s)
        offset = part_offset(q_pos, kv_pos)
        assert offset == q0 - k0
        mask = BlockMask(kind, window=(left, right), offset=offset)
        want = np.array([[mask.visible(i, j, q_pos=q_pos[i], kv_pos=kv_pos[j]) for j in range(s)] for i in range(t)])
        cut = block_band(mask, t, s, offset)
        got = np.zeros((t, s), bool)
        if cut is not None:
            got[cut.i0:cut.i1, cut.j0:cut.j1] = _fa2_visible(cut.i1 - cut.i0, cut.j1 - cut.j0, cut.left, cut.right)
        np.testing.assert_array_equal(got, want, err_msg=str((kind, q0, k0, left, right, cut)))


def test_part_offset_refuses_parts_that_are_not_runs():
    assert part_offset(np.array([4, 5, 6]), np.array([0, 1, 2])) == 4
    assert part_offset(np.array([0, 1, 7]), np.array([0, 1, 2])) is None  # a zigzag shard across its chunks
    assert part_offset(np.array([0, 2, 4]), np.array([1, 3, 5])) is None  # stripe


def _visible_pairs(block: Block, mask: BlockMask, positions) -> set:
    """(query row, key row) of the shard visible in ``block`` under ``mask`` (``BlockMask.visible``
    on the shard positions; the block's own grid for its causal diagonal)."""
    t = len(positions[0])
    (q_lo, q_hi), (k_lo, k_hi) = block.q_part.bounds(t), block.kv_part.bounds(t)
    return {(i, j) for i in range(q_lo, q_hi) for j in range(k_lo, k_hi)
            if mask.visible(i - q_lo, j - k_lo, q_pos=positions[0][i], kv_pos=positions[1][j])}


@pytest.mark.parametrize("part", [Part.ALL, Part.FIRST_HALF, Part.SECOND_HALF])
def test_crop_to_band_keeps_every_visible_pair_and_nothing_else(part):
    """A visited shard of 8 tokens against this shard's 8, every start and window: the cropped
    block holds exactly the visible pairs, each at the cropped mask's offset, its rows and keys all
    taking part (none left to merge as nothing); a block that sees nothing is None; causal blocks
    and unknown offsets stay whole."""
    t = 8
    for q0, k0, left, right in itertools.product([8, 16, 30], [0, 6, 8, 20], [0, 1, 3, 9, 40], [0, 2, UNBOUNDED]):
        positions = (np.arange(q0, q0 + t), np.arange(k0, k0 + t))
        block = Block(part, Part.ALL, BlockMask(MaskKind.FULL))
        (q_lo, q_hi) = part.bounds(t)
        mask = BlockMask(MaskKind.FULL, window=(left, right), offset=q0 + q_lo - k0)
        want = _visible_pairs(block, mask, positions)
        cut = crop_to_band(block, mask, t)
        if not want:
            assert cut is None, (q0, k0, left, right)
            continue
        assert cut is not None and cut.mask.window == (left, right)
        (i0, i1), (j0, j1) = cut.q_part.bounds(t), cut.kv_part.bounds(t)
        assert cut.mask.offset == positions[0][i0] - positions[1][j0]
        assert _visible_pairs(cut, cut.mask, positions) == want
        assert {i for i, _ in want} == set(range(i0, i1)) and {j for _, j in want} == set(range(j0, j1))
    whole = Block(Part.ALL, Part.ALL, BlockMask(MaskKind.CAUSAL))
    causal = BlockMask(MaskKind.CAUSAL, window=(2, 0), offset=0)
    assert crop_to_band(whole, causal, t) == Block(Part.ALL, Part.ALL, causal)
    unknown = BlockMask(MaskKind.FULL, window=(2, 0))
    assert crop_to_band(Block(Part.ALL, Part.ALL, BlockMask(MaskKind.FULL)), unknown, t).mask == unknown
