"""Sequence layouts: the token permutations that balance causal work over the ring.

A layout permutes tokens once, at data-loading time. Every layout acts on the R ring shards
(``seq_len / R`` tokens each); Ulysses then splits a ring shard contiguously. Which blocks each
device computes under a layout (the step plan) is part of the schedule (``schedule.py``), where
``LAYOUTS`` is defined.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schedule import LAYOUTS
from .shared import ring_shards, shared_bucket, shared_extent

__all__ = ["BALANCE_TOLERANCE", "DOCUMENT_HYBRID", "DOCUMENT_LAYOUTS", "DOCUMENT_ZIGZAG", "LAYOUTS",
           "MAX_SPLIT_CANDIDATES", "RowLayout", "balanced_split_at", "causal_work", "default_split_at", "document_layout",
           "document_runs", "hybrid_layout", "layout_permutation", "pad_documents", "ring_positions",
           "row_layout", "rope_positions", "seq_multiple", "static_token_index"]


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


# ---- the per-document zigzag (explicit, per-row layouts) -----------------------------------------

DOCUMENT_ZIGZAG = "document-zigzag"  # not a static layout: a per-row permutation built from the ids
DOCUMENT_HYBRID = "document-hybrid"  # long documents as document-zigzag, short ones whole, balanced
DOCUMENT_LAYOUTS = (DOCUMENT_ZIGZAG, DOCUMENT_HYBRID)


@dataclass(frozen=True)
class RowLayout:
    """An explicit per-row layout: ``perm`` [b, seq] the original token index at each layout
    position of each batch row (apply as ``np.take_along_axis(x, perm[..., None, None], 1)``, a
    per-row ``x[:, perm]``); ``inverse`` [b, seq] with ``inverse[b, perm[b, i]] = i`` (read outputs
    and gradients back to original order the same way); ``token_index`` [b, seq] int32, the
    attention argument: the original token index of every token in layout order — the positions
    the causal and window masks compare. Here it equals ``perm``; it is kept apart because it is
    what the attention functions read, while ``perm`` is what data loading applies."""

    perm: np.ndarray
    inverse: np.ndarray
    token_index: np.ndarray


def document_runs(ids_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every document of one row in original order: a document is a maximal
    run of equal ids (an id that comes back later starts another document of the layout; the
    masks still compare ids, so that changes which device holds what, never the answer)."""
    ids_row = np.asarray(ids_row)
    starts = np.flatnonzero(np.r_[True, ids_row[1:] != ids_row[:-1]])
    return starts, np.diff(np.r_[starts, len(ids_row)])


def _check_ids(segment_ids, ring_size: int) -> np.ndarray:
    ids = np.asarray(segment_ids)
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"segment_ids must be an integer [batch, seq] array, got {ids.dtype} {ids.shape}")
    if not isinstance(ring_size, (int, np.integer)) or isinstance(ring_size, bool) or ring_size < 1:
        raise ValueError(f"ring_size must be an int >= 1, got {ring_size!r}")
    return ids


def document_layout(segment_ids, ring_size: int) -> RowLayout:
    """The per-document zigzag (TransformerEngine's THD context parallelism) of every row of
    ``segment_ids`` [b, seq] (original order): each document (:func:`document_runs`) is cut into
    2R equal chunks, and ring shard r holds, document after document in original order, chunks
    r and 2R-1-r of each. Every shard then holds seq / R tokens, every document's two chunks are
    one run of its id, increasing in original order (a device's own block is plain causal per
    document), and every device holds the same causal work of every document: with chunk length c,
    chunks r and 2R-1-r see r·c + c·(c+1)/2 and (2R-1-r)·c + c·(c+1)/2 causal keys per query,
    together (2R-1)·c² + c·(c+1) pairs on every device.

    Every document length must be a multiple of 2R: pad first with :func:`pad_documents`
    (ValueError otherwise, naming the first document that is not)."""
    ids = _check_ids(segment_ids, ring_size)
    batch, seq = ids.shape
    n_chunks = 2 * ring_size
    perm = np.empty((batch, seq), np.int64)
    for row in range(batch):
        starts, lengths = document_runs(ids[row])
        _check_split(lengths, starts, ids[row], row, n_chunks, np.ones(len(lengths), bool), DOCUMENT_ZIGZAG)
        shards = [[] for _ in range(ring_size)]
        for start, length in zip(starts.tolist(), lengths.tolist()):
            chunk = length // n_chunks
            for r in range(ring_size):
                for c in (r, n_chunks - 1 - r):
                    shards[r].append(np.arange(start + c * chunk, start + (c + 1) * chunk))
        perm[row] = np.concatenate([np.concatenate(s) for s in shards])
    return _row_layout(perm)


def _row_layout(perm: np.ndarray) -> RowLayout:
    inverse = np.empty_like(perm)
    np.put_along_axis(inverse, perm, np.arange(perm.shape[1])[None, :].repeat(perm.shape[0], 0), axis=1)
    return RowLayout(perm, inverse, perm.astype(np.int32))


def _check_split(lengths: np.ndarray, starts: np.ndarray, ids_row: np.ndarray, row: int, n_chunks: int,
                 split: np.ndarray, name: str) -> None:
    bad = np.flatnonzero(split & (lengths % n_chunks != 0))
    if len(bad):
        d = int(bad[0])
        raise ValueError(
            f"{name} needs every document it splits to have a length divisible by 2·R = {n_chunks}; row {row}, "
            f"document {d} (id {ids_row[starts[d]]}, tokens {starts[d]}..{starts[d] + lengths[d] - 1}) has length "
            f"{lengths[d]}: pad with seqplan.layouts.pad_documents first")


def default_split_at(seq: int, ring_size: int) -> int:
    """The per-document hybrid's lowest threshold: documents of at least seq / (8R) tokens (an
    eighth of a shard; 2048 at 128k tokens on 8 devices, chunks of at least 128 tokens) — chosen on
    the balance probe's mixes, where splitting every document that long keeps every device's run
    area within 1.005 of the mean (a quarter of a shard: 1.035; whole documents up to a shard:
    2.02 — one document's causal work can exceed a device's share). :func:`balanced_split_at`
    splits no more than this, and fewer where fewer balance."""
    return max(2 * ring_size, seq // (8 * ring_size))


# The hybrid's default threshold keeps every device's causal work within this factor of the mean
# (:func:`balanced_split_at`), trying at most this many document lengths between "split none" and
# the floor: each try is one placement of the batch (≈ 3-40 ms a 128k row), and on the balance
# mixes the choice was always among the 5 longest.
BALANCE_TOLERANCE = 1.01
MAX_SPLIT_CANDIDATES = 8


def causal_work(segment_ids, perm: np.ndarray, ring_size: int) -> np.ndarray:
    """Causal (query, key) pairs each ring shard's queries see within their document, [b, R],
    when row i is laid out as ``segment_ids[i][perm[i]]`` (original order in, token index =
    ``perm``): a query sees the keys of its document up to its own position. A document is a
    run of equal ids (:func:`document_runs`), as the layouts place them: an id that comes back
    later counts as another document here, while the masks, which compare ids, let it see the
    earlier run too (more pairs than counted; the layouts' balance is by runs)."""
    ids = np.asarray(segment_ids)
    work = np.empty((ids.shape[0], ring_size))
    for row in range(ids.shape[0]):
        starts, lengths = document_runs(ids[row])
        start_of = np.repeat(starts, lengths)  # each token's document start, original order
        pairs = perm[row] - start_of[perm[row]] + 1
        work[row] = pairs.reshape(ring_size, -1).sum(1)
    return work


def balanced_split_at(segment_ids, ring_size: int, tolerance: float = BALANCE_TOLERANCE) -> int:
    """The hybrid's default threshold for ``segment_ids`` [b, seq]: of the thresholds that split
    none, the longest document, the two longest, … (the :data:`MAX_SPLIT_CANDIDATES` longest
    lengths) and :func:`default_split_at` (never below), those that keep every device's causal
    work (:func:`causal_work`) within
    ``tolerance`` of the mean in every row, the one whose shards share the fewest tokens — each
    split document puts len / R tokens in every shard's shared prefix (all-gather KV's
    ``shared_tokens``, on its bucket ladder: what the gather moves), and so do the pieces of a
    document cut for room — equal buckets to the better balance, then to the fewest splits;
    :func:`default_split_at` when none balances. On the balance mixes
    at 128k over 4 devices the shared prefix falls from 6,171 to 2,057 tokens (short), 26,650 to
    22,550 (heavy-tail) and 22,583 to 20,530 (few-long), the work within 1.009 / 1.008 / 1.004
    of the mean (docs/decisions.md, "The hybrid splits the fewest documents that balance")."""
    ids = _check_ids(segment_ids, ring_size)
    if ids.shape[1] % ring_size:
        raise ValueError(f"seq={ids.shape[1]} must be divisible by ring_size={ring_size}")
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance >= 1:
        raise ValueError(f"tolerance must be a number >= 1 (max / mean causal work), got {tolerance!r}")
    return _balanced(ids, ring_size, tolerance)[0]


def _balanced(ids: np.ndarray, ring_size: int, tolerance: float) -> tuple[int, np.ndarray | None]:
    """:func:`balanced_split_at` for checked ids, with the permutation it placed for the threshold it
    returns (None where it placed none: the floor, without trying)."""
    floor = default_split_at(ids.shape[1], ring_size)
    lengths = np.concatenate([document_runs(row)[1] for row in ids])
    if ring_size == 1 or not (lengths >= floor).any():
        return floor, None
    longest = sorted({int(x) for x in lengths if x > floor}, reverse=True)[:MAX_SPLIT_CANDIDATES]
    best = None
    for split_at in [int(lengths.max()) + 1] + longest + [floor]:
        perm = _hybrid_perm(ids, ring_size, split_at)
        work = causal_work(ids, perm, ring_size)
        if (work.max(1) > tolerance * work.mean(1)).any():
            continue
        laid = ring_shards(np.take_along_axis(ids, perm, 1), ring_size)
        # the bucket is what the gather moves; among equal buckets the better balance, then fewer splits
        key = (shared_bucket(shared_extent(laid), laid.shape[2]), float((work.max(1) / work.mean(1)).max()))
        if best is None or key < best[0]:
            best = (key, split_at, perm)
    return (floor, None) if best is None else best[1:]


def hybrid_layout(segment_ids, ring_size: int, split_at: int | None = None) -> RowLayout:
    """The per-document hybrid (after WLB-LLM and ByteScale) of every row of ``segment_ids`` [b, seq]
    (original order): documents of at least ``split_at`` tokens (default
    :func:`balanced_split_at`: of the thresholds that balance, the one sharing the fewest tokens
    between shards) are cut as in
    :func:`document_layout` — 2R chunks, shard r holding
    chunks r and 2R-1-r, the same causal work on every device — and shorter ones are kept whole on
    one device, placed longest first on the device with the least causal work (n·(n+1)/2 per
    document) among those with room; a document no device has room for is cut into contiguous
    pieces, the largest room first, so every shard holds exactly seq / R tokens. Each shard holds
    first the documents it shares with other devices, then its whole ones, each group in
    original order (every document one run with increasing token indices; shared documents in
    the same order on every shard). A whole document never meets another device's keys: an
    off-diagonal block's visible pairs lie in the shards' leading shared tokens, so torch crops
    the block to them (``torch_impl.loop.crop_block``) and the varlen runs skip the rest.

    Every document it splits must have a length divisible by 2R (:func:`pad_documents`)."""
    ids = _check_ids(segment_ids, ring_size)
    if ids.shape[1] % ring_size:
        raise ValueError(f"seq={ids.shape[1]} must be divisible by ring_size={ring_size}")
    if split_at is not None and (not isinstance(split_at, (int, np.integer)) or split_at < 1):
        raise ValueError(f"split_at must be an int >= 1, got {split_at!r}")
    perm = None
    if split_at is None:  # the threshold's search placed its permutation already
        split_at, perm = _balanced(ids, ring_size, BALANCE_TOLERANCE)
    return _row_layout(_hybrid_perm(ids, ring_size, split_at) if perm is None else perm)


def _hybrid_perm(ids: np.ndarray, ring_size: int, split_at: int) -> np.ndarray:
    """:func:`hybrid_layout`'s permutation [b, seq] for a checked ``ids`` and threshold."""
    batch, seq = ids.shape
    n_chunks, cap = 2 * ring_size, seq // ring_size
    perm = np.empty((batch, seq), np.int64)
    for row in range(batch):
        starts, lengths = document_runs(ids[row])
        split = lengths >= split_at
        _check_split(lengths, starts, ids[row], row, n_chunks, split, DOCUMENT_HYBRID)
        shared: list[list[np.ndarray]] = [[] for _ in range(ring_size)]  # documents on several devices
        whole: list[list[np.ndarray]] = [[] for _ in range(ring_size)]  # documents on this device alone
        room, work = np.full(ring_size, cap, np.int64), np.zeros(ring_size)
        for d in np.flatnonzero(split):
            chunk = lengths[d] // n_chunks
            for r in range(ring_size):
                for c in (r, n_chunks - 1 - r):
                    (shared if ring_size > 1 else whole)[r].append(
                        np.arange(starts[d] + c * chunk, starts[d] + (c + 1) * chunk))
            room -= 2 * chunk
        for d in sorted(np.flatnonzero(~split), key=lambda d: (-lengths[d], d)):
            start, n = int(starts[d]), int(lengths[d])
            fits = np.flatnonzero(room >= n)
            if len(fits):
                r = int(fits[np.argmin(work[fits])])
                whole[r].append(np.arange(start, start + n))
                room[r] -= n
                work[r] += n * (n + 1) / 2
                continue
            done = 0
            while done < n:  # no room for it whole: contiguous pieces, the largest room first
                r = int(np.argmax(room))
                piece = int(min(room[r], n - done))
                (shared if piece < n else whole)[r].append(np.arange(start + done, start + done + piece))
                room[r] -= piece
                work[r] += piece * (piece + 1) / 2 + piece * done
                done += piece
        ordered = lambda parts: np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        perm[row] = np.concatenate([np.concatenate([ordered(shared[r]), ordered(whole[r])])
                                    for r in range(ring_size)])
    return perm


def row_layout(name: str, segment_ids, ring_size: int) -> RowLayout:
    """The per-row layout called ``name`` (:data:`DOCUMENT_LAYOUTS`) of ``segment_ids``."""
    if name == DOCUMENT_ZIGZAG:
        return document_layout(segment_ids, ring_size)
    if name == DOCUMENT_HYBRID:
        return hybrid_layout(segment_ids, ring_size)
    raise ValueError(f"per-row layout must be one of {DOCUMENT_LAYOUTS}, got {name!r}")


def pad_documents(segment_ids, ring_size: int, multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The padding rule of the per-document zigzag: every document (:func:`document_runs`) of
    every row is extended at its end, with its own id, to the next multiple of 2R tokens; then
    every row is extended by one trailing filler document (id: the row's largest id + 1) to a
    common length, itself a multiple of ``lcm(2R, multiple)`` (``multiple``: e.g. 2R·U for
    Ulysses, or a tile size). Returns ``(padded_ids [b, seq'], source [b, seq'])``: ``source`` the
    original token index of each padded token, -1 for padding.

    Exactness: a padding token comes after every real token of its document in original order, so
    under ``causal=True`` no real query sees it, and real outputs and gradients are exact if the
    loss gives padding no weight (dO = 0 on pad rows — then pad queries add nothing to real dK /
    dV). Without causal masking, give the padding ids of its own after the layout is built (the
    layout reads the padded ids; the masks read whatever ids the call passes). Cost: at most
    2R - 1 extra tokens per document (on average ≈ R - 1/2) plus the filler, all computed like
    real tokens — ``(seq' - seq) / seq`` more tokens, which the balance probe reports."""
    ids = _check_ids(segment_ids, ring_size)
    if not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(f"multiple must be an int >= 1, got {multiple!r}")
    n_chunks = 2 * ring_size
    rows = []
    for row in ids:
        starts, lengths = document_runs(row)
        padded = -(-lengths // n_chunks) * n_chunks
        out_ids = np.repeat(row[starts], padded)
        source = np.full(int(padded.sum()), -1, np.int64)
        offsets = np.r_[0, np.cumsum(padded)[:-1]]
        for start, length, offset in zip(starts.tolist(), lengths.tolist(), offsets.tolist()):
            source[offset:offset + length] = np.arange(start, start + length)
        rows.append((out_ids, source, int(row.max()) + 1))
    unit = np.lcm(n_chunks, multiple)
    width = -(-max(len(r[0]) for r in rows) // unit) * unit
    out = np.empty((len(rows), width), ids.dtype)
    src = np.full((len(rows), width), -1, np.int64)
    for b, (out_ids, source, filler) in enumerate(rows):
        out[b, :len(out_ids)], out[b, len(out_ids):] = out_ids, filler
        src[b, :len(source)] = source
    return out, src


def rope_positions(token_index, segment_ids) -> np.ndarray:
    """The layers' RoPE ``positions`` from the token indices: each token's index minus the
    smallest token index of its document (its id, in its row) — the position restarting at 0 at
    every document start, in layout order like both inputs. NumPy; the layers take the result."""
    index, ids = np.asarray(token_index), np.asarray(segment_ids)
    if index.shape != ids.shape or index.ndim != 2:
        raise ValueError(f"token_index and segment_ids must both be [batch, seq], got {index.shape}, {ids.shape}")
    out = np.empty_like(index)
    for row in range(index.shape[0]):
        _, doc = np.unique(ids[row], return_inverse=True)
        first = np.full(doc.max() + 1, np.iinfo(np.int64).max)
        np.minimum.at(first, doc, index[row].astype(np.int64))
        out[row] = index[row] - first[doc]
    return out


def static_token_index(seq_len: int, layout: str, ring_size: int, batch: int = 1, ulysses_size: int = 1) -> np.ndarray:
    """The token indices a static layout implies (the default of the ``token_index`` argument):
    :func:`layout_permutation` in every row, int32 [batch, seq]."""
    perm = layout_permutation(seq_len, layout, ring_size, ulysses_size).astype(np.int32)
    return np.broadcast_to(perm, (batch, seq_len)).copy()
