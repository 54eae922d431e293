"""Tier 1 — torch_impl's fused window adapter (kernels/window.py) hands FlashAttention-2 a cropped
block and two window sizes; FA2 reads them as a band aligned to the block's bottom-right corner.
Why this tier exists: that translation is integer arithmetic a GPU run would only catch as a
wrong number — here it is proved pair by pair against the window it stands for."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("torch")

from torch_impl.kernels.window import band


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
        if hi is not None and hi < lo:
            continue
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
