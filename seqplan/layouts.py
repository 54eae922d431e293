"""Sequence layouts: the token permutations that balance causal work over the ring.

A layout permutes tokens once, at data-loading time. Every layout acts on the R ring shards
(``seq_len / R`` tokens each); Ulysses then splits a ring shard contiguously. Which blocks each
device computes under a layout (the step plan) is part of the schedule (``schedule.py``), where
``LAYOUTS`` is defined.
"""

from __future__ import annotations

import numpy as np

from .schedule import LAYOUTS

__all__ = ["LAYOUTS", "layout_permutation", "ring_positions", "seq_multiple"]


def seq_multiple(layout: str, ring_size: int, ulysses_size: int = 1) -> int:
    """The number seq_len must be divisible by: zigzag halves each device's block."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return (2 if layout == "zigzag" else 1) * ring_size * ulysses_size


def layout_permutation(seq_len: int, layout: str, ring_size: int, ulysses_size: int = 1) -> np.ndarray:
    """Original token index at each layout position (docs/contract.md). Apply as ``x[:, perm]``."""
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


def ring_positions(layout: str, size: int, t: int) -> np.ndarray:
    """The original position of every token of every ring shard, int32 [R, t] (row r: shard r in
    layout order): static, so a window's per-block decision needs no communication. Inside USP
    the ring attention's shard is a whole ring shard (Ulysses splits it contiguously)."""
    return layout_permutation(size * t, layout, size).astype(np.int32).reshape(size, t)
