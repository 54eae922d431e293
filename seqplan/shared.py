"""All-gather-KV's shared prefix (``shared_tokens``), framework-free: only the K/V that another
device's queries can see travel.

Under the per-document hybrid layout (``seqplan.layouts.hybrid_layout``) every ring shard holds
first the documents it shares with other shards, then documents it holds whole. With
``shared_tokens = P`` the caller promises that every token whose document also lies on another
shard sits within the first P positions of its shard. All-gather-KV then splits each device's
work in two parts, both causal by token index within documents (:data:`PART_MASK`):

- **shared**: the device's queries [0, P) against every shard's first P keys — the only K/V
  gathered (R·P tokens instead of R·t) and the only dK / dV reduce-scattered;
- **local**: its queries [P, t) against its own t keys — documents held whole, no transfer, so
  this part runs while the prefixes are gathered.

Every query's keys lie in exactly one part (a query at P or later belongs to a document no other
shard holds, whose earlier tokens are on this shard; a query before P sees only prefix tokens), so
the two parts' outputs are final — no merge. On the 128k balance mixes over 4 devices the hybrid's
shared tokens are 6 % (short), 64 % (heavy-tail) and 60 % (few-long) of a shard with its default
threshold (``layouts.balanced_split_at``; 13 / 78 / 64 % when every document of seq / (8R) tokens
or more was split).

:func:`shared_extent` is the smallest P a batch allows; :func:`shared_bucket` rounds it up to a
short ladder (JAX compiles one program per P); :func:`check_shared_tokens` refuses a P the ids
break; :func:`split_runs` plans both parts as one-call varlen runs (``documents.prefix_runs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .documents import PREFIX_KEY_FACTOR, PrefixRuns, prefix_runs, shard_prefix_runs
from .schedule import UNBOUNDED, BlockMask, MaskKind

# Both parts' mask: key visible when it shares the query's document and its token index is <= the
# query's (seqplan.schedule.by_token_index's causal window, the one call's mask on token indices).
PART_MASK = BlockMask(MaskKind.FULL, documents=True, window=(UNBOUNDED, 0))

# shared_bucket's ladder: P rounded up to a multiple of a sixteenth of the shard.
BUCKETS_PER_SHARD = 16


def check_shared_tokens_value(shared_tokens) -> int | None:
    """``shared_tokens`` as an int >= 0, or None (ValueError otherwise); its bound by the shard
    length is checked where the shard is known (:func:`check_shared_tokens`)."""
    if shared_tokens is None:
        return None
    if not isinstance(shared_tokens, (int, np.integer)) or isinstance(shared_tokens, bool) or shared_tokens < 0:
        raise ValueError(f"shared_tokens must be an int >= 0 or None, got {shared_tokens!r}")
    return int(shared_tokens)


def check_shared_exchange(shared_tokens, algorithm: str, kv_exchange: str) -> dict:
    """``{"shared_tokens": value}`` for the per-device call, ``{}`` when None; ValueError unless the
    value is an int >= 0 and the call all-gathers K/V over a ring (``algorithm`` "ring" or "usp"
    — the decomposition's — with ``kv_exchange`` "allgather")."""
    shared_tokens = check_shared_tokens_value(shared_tokens)
    if shared_tokens is None:
        return {}
    if algorithm not in ("ring", "usp") or kv_exchange != "allgather":
        raise ValueError(f"shared_tokens applies to kv_exchange='allgather' over a ring (ring or USP), got "
                         f"{algorithm} with kv_exchange={kv_exchange!r}")
    return {"shared_tokens": shared_tokens}


def check_shared_call(config, documents: bool) -> None:
    """ValueError unless a call given ``shared_tokens`` (``config``: an AttentionConfig) is one its
    split takes: packed documents (``documents``), causal by the layout or by token index, no
    other window, no soft-capping — raised before any collective."""
    if config.shared_tokens is None:
        return
    if not documents or config.softcap is not None or \
            config.one_call_mask(documents) is None:
        raise ValueError("shared_tokens needs causal packed documents (segment_ids; causal by the layout or by "
                         "token_index) with no other window and no softcap")


def spans_shards(ids_all) -> np.ndarray:
    """bool [R, b, t]: whether each token's document also has tokens on another ring shard
    (``ids_all`` int [R, b, t], every shard's ids in layout order).

    Decided per run of equal ids, not per token: a shard holds each document as a few runs, so
    the grouping by (row, id) — a sort — runs over a few hundred runs instead of R·b·t tokens.
    Torch plans this for every batch with new ids (the shared prefix's split, on the host): on
    the 128k balance mixes over 4 shards :func:`shared_extent` (this and a scan) took 4.0–6.0 ms
    deciding per token on this project's 2-core box, 0.2–0.4 ms deciding per run (docs/decisions.md,
    "Plans for a new batch")."""
    ids_all = np.asarray(ids_all)
    ring, b, t = ids_all.shape
    if ids_all.size == 0:
        return np.zeros(ids_all.shape, bool)
    flat = ids_all.reshape(-1)
    starts = np.ones(ids_all.shape, bool)  # a run never crosses a row or a shard: each starts at position 0
    starts[..., 1:] = ids_all[..., 1:] != ids_all[..., :-1]
    at = np.flatnonzero(starts)  # each run's first token (C order: shard, row, position)
    run_shard, run_row = at // (b * t), (at // t) % b
    # a document is (row, id), numbered row · ids + the id's rank (ranked, not the id itself: any
    # dtype, uint64 past 2^53 included, numbers exactly)
    ranks, id_rank = np.unique(flat[at], return_inverse=True)
    document = run_row * len(ranks) + id_rank.reshape(-1)
    first = np.full(b * len(ranks), ring)
    last = np.full(b * len(ranks), -1)
    np.minimum.at(first, document, run_shard)
    np.maximum.at(last, document, run_shard)
    spans = (first != last)[document]  # per run
    return np.repeat(spans, np.diff(np.append(at, flat.size))).reshape(ring, b, t)


def shared_extent(ids_all) -> int:
    """The smallest ``shared_tokens`` the ids allow: one past the last position, over every shard
    and row, of a token whose document spans shards (0: none does)."""
    spans = spans_shards(ids_all).any(axis=1)  # [R, t]
    hit = np.flatnonzero(spans.any(axis=0))
    return int(hit[-1] + 1) if len(hit) else 0


def shared_bucket(extent: int, t: int) -> int:
    """``extent`` rounded up to a multiple of t / :data:`BUCKETS_PER_SHARD` (at most ``t``): a
    short static ladder, so a training run's batches reuse a few compiled programs."""
    step = max(1, -(-t // BUCKETS_PER_SHARD))
    return min(t, -(-extent // step) * step)


def ring_shards(segment_ids, ring: int) -> np.ndarray:
    """Laid-out ids [b, seq] -> every ring shard's [R, b, seq / R]."""
    ids = np.asarray(segment_ids)
    b, seq = ids.shape
    if seq % ring:
        raise ValueError(f"seq={seq} must be divisible by ring={ring}")
    return np.ascontiguousarray(ids.reshape(b, ring, seq // ring).transpose(1, 0, 2))


def shared_tokens_for(segment_ids, ring: int) -> int:
    """The ``shared_tokens`` to pass for laid-out ids [b, seq] on a ring of ``ring`` shards: the
    smallest the ids allow (:func:`shared_extent`), on :func:`shared_bucket`'s ladder."""
    ids_all = ring_shards(segment_ids, ring)
    return shared_bucket(shared_extent(ids_all), ids_all.shape[2])


def check_shared_tokens(ids_all, shared_tokens: int) -> None:
    """ValueError unless ``shared_tokens`` is at most the shard length and every token whose
    document spans shards lies within the first ``shared_tokens`` positions of its shard
    (``ids_all`` [R, b, t]; the same verdict on every rank: the ids are the gathered ones)."""
    ring, _, t = np.asarray(ids_all).shape
    if shared_tokens > t:
        raise ValueError(f"shared_tokens={shared_tokens} exceeds the ring shard's {t} tokens")
    extent = shared_extent(ids_all)
    if extent > shared_tokens:
        spans = spans_shards(ids_all)
        shard, row, pos = (int(x[0]) for x in np.nonzero(spans[:, :, shared_tokens:]))
        raise ValueError(
            f"shared_tokens={shared_tokens}, but row {row}'s token at position {pos + shared_tokens} of ring shard "
            f"{shard} belongs to a document on several shards (these ids need shared_tokens >= {extent}; "
            "seqplan.chooser.choose_layout lays documents out and gives the value)")


def part_positions(index_all, layout: str, ring: int, b: int, t: int) -> np.ndarray:
    """Every shard's token indices [R, b, t]: the call's (``index_all``), or the static layout's
    positions in every row."""
    if index_all is not None:
        return np.asarray(index_all)
    from .layouts import ring_positions  # layouts imports documents, which this module imports

    return np.broadcast_to(ring_positions(layout, ring, t)[:, None, :], (ring, b, t))


@dataclass(frozen=True, eq=False)
class SplitRuns:
    """A device's two parts as one-call varlen plans (:class:`documents.PrefixRuns`).

    shared_tokens: P.
    shared:        queries [0, P) against every shard's prefix, [b, R·P] (``key_index`` into
                   them packed row-major: row, then shard, then position), or None: P = 0 (no part) or no plan within
                   ``PREFIX_KEY_FACTOR`` times its keys (the portable kernel then).
    local:         queries [P, t) against the device's own [b, t] keys (packed row-major), or
                   None: P = t (no part) or no plan (the portable kernel)."""

    shared_tokens: int
    shared: PrefixRuns | None
    local: PrefixRuns | None


def split_runs(ids_all, index_all, *, device: int, shared_tokens: int, layout: str) -> SplitRuns:
    """Device ``device``'s :class:`SplitRuns` from every shard's ids ``ids_all`` [R, b, t] and
    token indices ``index_all`` [R, b, t] (None: the static ``layout``'s positions)."""
    ids_all = np.asarray(ids_all)
    ring, b, t = ids_all.shape
    index_all = part_positions(index_all, layout, ring, b, t)
    p = shared_tokens
    shared = local = None
    if p:
        prefix = lambda x: np.ascontiguousarray(x[:, :, :p])
        shared = shard_prefix_runs(prefix(ids_all), prefix(index_all), device=device, shard_major=False,
                                   max_keys=PREFIX_KEY_FACTOR * ring * b * p)
    if p < t:
        ids, index = ids_all[device], index_all[device]
        local = prefix_runs(ids[:, p:], ids, index[:, p:], index, max_keys=PREFIX_KEY_FACTOR * b * t)
    return SplitRuns(p, shared, local)
