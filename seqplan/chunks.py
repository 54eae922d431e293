"""How the portable block kernels walk a block's keys: in chunks small enough that the scores of
one chunk (t · c per batch row and head) stay bounded, so a masked block of real length never
holds its [t, s] scores. Both implementations' ``kernels/reference.py`` use it."""

from __future__ import annotations

# Scores held at once per (batch, head): t · c float32 (4 MiB). t · s below it: one chunk.
SCORE_ELEMENTS = 1 << 20
MIN_KEY_CHUNK = 64


def key_chunk(t: int, s: int) -> int:
    """Keys per chunk for a [t, s] block: all of them when t · s ≤ SCORE_ELEMENTS, else the largest
    power of two ≤ SCORE_ELEMENTS / t (at least MIN_KEY_CHUNK)."""
    if t * s <= SCORE_ELEMENTS:
        return s
    c = max(MIN_KEY_CHUNK, SCORE_ELEMENTS // max(t, 1))
    return min(s, 1 << (c.bit_length() - 1))
