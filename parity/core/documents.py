"""Packed documents: the ``segment_ids`` of a parity case, drawn from a seed (NumPy only).

Ids are [b, t] int32 in *original* token order (the harness permutes them into layout order with
everything else). Query i may read key j only if their ids are equal (and, causal, j <= i by
original position). Each batch row draws its own documents. The patterns (``names.DOCUMENTS``):

    none         no ids at all (the call passes no ``segment_ids``)
    mix          long-tailed document lengths: at least two length-1 documents and one of about a
                 third of the sequence (so documents span shards), the rest lognormal around t/12;
                 ids grow along the sequence with random gaps (not 0, 1, 2, ...)
    one          a single document (a random id): every block is one document (the PLAIN path)
    singletons   every token its own document (increasing ids): each query sees only itself,
                 and almost every off-diagonal block can be skipped
    interleaved  runs of long-tailed lengths whose ids come from a small pool, so a document is
                 several separate runs and ids do not grow along the sequence (the conservative
                 path of the per-block test: id ranges overlap where no id is shared)
    short        many short documents (lognormal around t/64) and one of t/4: the per-document
                 hybrid keeps most whole on one shard and splits the long one (the benchmark's
                 short balance mix, reduced: the shared prefix's case); not in the case matrices

``lengths_to_ids`` turns document lengths into ids; the balance probe (parity.probes.balance)
draws its realistic-size mixes with it.
"""

from __future__ import annotations

import numpy as np

from .names import DOCUMENTS, check_choice

__all__ = ["draw_segment_ids", "long_tailed_lengths", "lengths_to_ids"]


def lengths_to_ids(lengths, ids=None) -> np.ndarray:
    """[sum(lengths)] int32: document k's ``lengths[k]`` tokens carry ``ids[k]`` (default k)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths < 1).any():
        raise ValueError(f"document lengths must be a 1-d array of positive ints, got {lengths}")
    ids = np.arange(len(lengths)) if ids is None else np.asarray(ids)
    if ids.shape != lengths.shape:
        raise ValueError(f"one id per document: {len(ids)} ids for {len(lengths)} lengths")
    return np.repeat(ids, lengths).astype(np.int32)


def long_tailed_lengths(rng: np.random.Generator, seq: int, *, median: float, sigma: float = 1.0,
                        forced=(), cap: int | None = None) -> np.ndarray:
    """Document lengths summing to exactly ``seq``: the ``forced`` lengths (those that fit) at random
    places among lognormal(log ``median``, ``sigma``) draws (rounded, at least 1, at most ``cap``
    when given; the last draw is cut to fit)."""
    forced = list(forced)
    while sum(forced) > seq:
        forced.pop()
    drawn, room, longest = [], seq - sum(forced), seq if cap is None else max(1, int(cap))
    while room > 0:
        length = min(room, longest, max(1, int(round(rng.lognormal(np.log(max(median, 1.0)), sigma)))))
        drawn.append(length)
        room -= length
    for length in forced:
        drawn.insert(int(rng.integers(0, len(drawn) + 1)), length)
    return np.array(drawn, dtype=np.int64)


def _increasing_ids(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` distinct increasing ids starting anywhere in [0, 100) with gaps of 1-3."""
    return int(rng.integers(0, 100)) + np.cumsum(rng.integers(1, 4, size=count))


def _interleaved(rng: np.random.Generator, seq: int) -> np.ndarray:
    """Runs whose ids come from a pool of about half as many ids as runs (see the module docstring):
    run 2 reuses run 0's id when there are three runs or more, and adjacent runs differ."""
    runs = long_tailed_lengths(rng, seq, median=max(seq / 10, 1.0), sigma=0.8)
    if len(runs) < 3 <= seq:  # a long draw can leave one or two runs: then no id could come back
        runs = np.array([seq // 3, seq // 3, seq - 2 * (seq // 3)], dtype=np.int64)
    pool = rng.choice(1000, size=max(2, len(runs) // 2), replace=False)  # arbitrary, unsorted values
    run_ids = rng.integers(0, len(pool), size=len(runs))
    for k in range(1, len(runs)):
        if k == 2:
            run_ids[2] = run_ids[0]
        if run_ids[k] == run_ids[k - 1]:
            run_ids[k] = (run_ids[k - 1] + 1) % len(pool)
    return lengths_to_ids(runs, pool[run_ids])


def _row(pattern: str, rng: np.random.Generator, seq: int) -> np.ndarray:
    if pattern == "one":
        return np.full(seq, int(rng.integers(0, 1000)), dtype=np.int32)
    if pattern == "singletons":
        return (int(rng.integers(0, 100)) + 2 * np.arange(seq)).astype(np.int32)
    if pattern == "interleaved":
        return _interleaved(rng, seq)
    if pattern == "short":
        lengths = long_tailed_lengths(rng, seq, median=max(seq / 64, 1.0), forced=(max(1, seq // 4),))
        return lengths_to_ids(lengths, _increasing_ids(rng, len(lengths)))
    lengths = long_tailed_lengths(rng, seq, median=seq / 12, forced=(1, 1, max(2, seq // 3)))
    return lengths_to_ids(lengths, _increasing_ids(rng, len(lengths)))


def draw_segment_ids(pattern: str, batch: int, seq: int, rng: np.random.Generator, unit: int = 1) -> np.ndarray | None:
    """[batch, seq] int32 ids in original order for ``pattern`` (None for "none"), one draw per row.
    ``unit`` > 1 draws the pattern over ``seq // unit`` units and gives each unit's id to ``unit``
    consecutive tokens, so every document's length is a multiple of ``unit`` (the per-document
    zigzag needs multiples of 2R: ``Case.token_index``); a length-1 document becomes one of
    ``unit`` tokens."""
    check_choice("documents", pattern, DOCUMENTS)
    if not isinstance(unit, int) or isinstance(unit, bool) or unit < 1 or seq % unit:
        raise ValueError(f"unit must be a positive int dividing seq={seq}, got {unit!r}")
    if pattern == "none":
        return None
    return np.stack([np.repeat(_row(pattern, rng, seq // unit), unit) for _ in range(batch)])
