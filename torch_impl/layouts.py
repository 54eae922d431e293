"""Sequence layouts and the causal step plan they imply.

A layout permutes tokens once, at data-loading time, so that causal work is balanced over the
ring. Every layout acts on the R ring shards (``seq_len / R`` tokens each); Ulysses then splits a
ring shard contiguously. The *step plan* says, for ring step i (K/V from ring shard
``src = (r - i) mod R`` on device r), which part of the local queries meets which part of the
visiting keys, under which mask; both the forward and the backward follow it, so a fully masked
block is never computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

LAYOUTS = ("contiguous", "zigzag", "stripe")


class Mask(Enum):
    """Mask of one square-or-rectangular block, in *local* indices (i: query row, j: key col)."""

    FULL = "full"  # every key visible
    CAUSAL = "causal"  # j <= i (the diagonal block of a causal layout)
    STRICT = "strict"  # j < i (stripe: keys from a later stripe exclude the diagonal)


class Part(Enum):
    """Which contiguous part of a local shard along the sequence axis."""

    ALL = "all"
    FIRST_HALF = "first_half"
    SECOND_HALF = "second_half"

    def bounds(self, length: int) -> tuple[int, int]:
        half = length // 2
        return {Part.ALL: (0, length), Part.FIRST_HALF: (0, half), Part.SECOND_HALF: (half, length)}[self]


@dataclass(frozen=True)
class Block:
    """One block-kernel call: ``q[q_part]`` against ``k, v[kv_part]`` under ``mask``."""

    q_part: Part
    kv_part: Part
    mask: Mask


@dataclass(frozen=True)
class StepPlan:
    """What device r computes at each ring step.

    ``local``: step 0 (its own K/V). ``from_earlier``: visiting K/V come from a ring shard
    src < r (that is, step i <= r). ``from_later``: src > r. ``None`` means the block is fully
    masked and skipped.
    """

    local: Block
    from_earlier: Block | None
    from_later: Block | None

    @property
    def uniform(self) -> bool:
        """True when every off-diagonal step is the same, so no per-device branch is needed."""
        return self.from_earlier == self.from_later


_ALL_FULL = Block(Part.ALL, Part.ALL, Mask.FULL)


def step_plan(layout: str, causal: bool) -> StepPlan:
    """The step plan for ``layout`` (see module docstring).

    - non-causal: every step is one full block (all layouts compute the same).
    - contiguous: earlier shards are fully visible, later ones fully masked (skipped).
    - zigzag (shard r = chunk r ++ chunk 2R-1-r): from an earlier shard, all queries see only
      its first chunk; from a later shard, only the second query chunk sees it, entirely.
      Either way a half-size block.
    - stripe (shard r = tokens with t % R == r): keys of stripe src <= r are visible up to and
      including the same row; keys of a later stripe only strictly below it.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not causal:
        return StepPlan(local=_ALL_FULL, from_earlier=_ALL_FULL, from_later=_ALL_FULL)
    diagonal = Block(Part.ALL, Part.ALL, Mask.CAUSAL)
    if layout == "contiguous":
        return StepPlan(local=diagonal, from_earlier=_ALL_FULL, from_later=None)
    if layout == "zigzag":
        return StepPlan(
            local=diagonal,
            from_earlier=Block(Part.ALL, Part.FIRST_HALF, Mask.FULL),
            from_later=Block(Part.SECOND_HALF, Part.ALL, Mask.FULL),
        )
    return StepPlan(local=diagonal, from_earlier=diagonal, from_later=Block(Part.ALL, Part.ALL, Mask.STRICT))


def seq_multiple(layout: str, ring_size: int, ulysses_size: int = 1) -> int:
    """The number seq_len must be divisible by: zigzag halves each device's block."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return (2 if layout == "zigzag" else 1) * ring_size * ulysses_size


def layout_permutation(seq_len: int, layout: str, ring_size: int, ulysses_size: int = 1) -> np.ndarray:
    """Original token index at each layout position (DESIGN.md). Apply as ``x[:, perm]``."""
    multiple = seq_multiple(layout, ring_size, ulysses_size)
    if ring_size < 1 or ulysses_size < 1:
        raise ValueError(f"ring_size and ulysses_size must be >= 1, got {ring_size}, {ulysses_size}")
    if seq_len % multiple:
        raise ValueError(
            f"seq_len % {multiple} must be 0 for layout {layout!r} with ring_size={ring_size}, "
            f"ulysses_size={ulysses_size}; got seq_len={seq_len}"
        )
    tokens = np.arange(seq_len)
    if layout == "contiguous":
        return tokens
    if layout == "stripe":
        return tokens.reshape(seq_len // ring_size, ring_size).T.reshape(-1)
    chunks = tokens.reshape(2 * ring_size, seq_len // (2 * ring_size))
    return np.concatenate([chunks[: ring_size], chunks[ring_size:][::-1]], axis=1).reshape(-1)
