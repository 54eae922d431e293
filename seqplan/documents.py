"""Per-block document runs for varlen kernels: a document-masked block whose queries and keys are
contiguous runs of each document (the contiguous and zigzag layouts with ids that are contiguous
in original order) is a batch of independent attention problems, one per document, which a
varlen kernel runs from cumulative offsets (``cu_seqlens``). NumPy only; each framework's kernel
adapter turns the result into its tensors.

    q_ids [b, t], kv_ids [b, s] (int, one block)  ->  DocumentRuns | None

The runs walk the packed queries [b·t] and the packed keys [b·s] together, in place: a document
both sides hold is one run (its query run against its key run), a document only the queries hold
is a run with zero keys (its queries see nothing: o = 0 and lse = -inf, which the adapter writes
itself rather than trust a kernel's convention for empty rows), and a document only the keys
hold is a run with zero queries (its keys get zero dK / dV, written by the adapter too);
neighbouring runs of one side alone are joined. So no
key is gathered and no gradient scattered — an off-diagonal block of packed documents is a
handful of runs over its own memory. ``None`` means the block is not expressible as runs (a
document in two runs of the queries, or of the keys when the queries read it, shared documents
in different orders, or
a causal block whose query and key ids differ): the adapter then routes it to the portable
kernel — never guesses.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np


class HostPair(tuple):
    """A block's per-token pair as the loops hand it to a kernel — ``segments = (q_ids [b, t],
    kv_ids [b, s])`` or per-row ``positions = (q_index [b, t], kv_index [b, s])`` (token indices), a
    plain 2-tuple of the framework's arrays — with, when the loop has them, the same values as
    NumPy arrays (``host``): torch's loops copy every shard's ids and token indices to the host
    once per call, so a kernel that plans on the host (a varlen run list) needs no device-to-host
    copy per block. ``memo``, when the loop gives one: a dict it keeps for this block through one
    call, forward and backward, where a kernel keeps what it derives from the pair (its run list),
    so the block's backward takes its forward's instead of deriving it again."""

    host: tuple | None
    memo: dict | None

    def __new__(cls, q_values, kv_values, host: tuple | None = None, memo: dict | None = None):
        self = super().__new__(cls, (q_values, kv_values))
        self.host = host
        self.memo = memo
        return self

    def remembered(self, key, make):
        """``make()``, kept in ``memo`` under ``key`` when the pair has one (else made each time)."""
        if self.memo is None:
            return make()
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


@dataclass(frozen=True, eq=False)  # hashed by identity: a kernel keeps its device offsets per plan object
class DocumentRuns:
    """``cu_q``, ``cu_k``: int32 [n + 1] cumulative run lengths over the packed queries [b·t] and
    the packed keys [b·s] — both in place, every token in exactly one run (a run of queries whose
    document has no key here has zero keys; a run of keys no query reads has zero queries), so a
    kernel needs no gather; ``max_q``, ``max_k``: the longest runs; ``empty_rows``: bool [b·t],
    queries whose document has no key in the block, or None; ``unread_keys``: bool [b·s], keys no
    query reads, or None."""

    cu_q: np.ndarray
    cu_k: np.ndarray
    max_q: int
    max_k: int
    empty_rows: np.ndarray | None
    unread_keys: np.ndarray | None


def _row_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(id, length) of each run of equal ids in a row."""
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    return ids[starts], np.diff(np.append(starts, len(ids)))


def _merged_runs(q_ids: np.ndarray, kv_ids: np.ndarray) -> list[tuple[int, int]] | None:
    """One row's runs as (queries, keys) pairs that walk both in order: a document the queries and
    the keys share is one pair, a document only one side holds pairs with zero of the other. None
    when that cannot be done: a document in two runs of the queries, a shared document in two
    runs of the keys, or shared documents in different orders."""
    q_docs, q_lens = _row_runs(q_ids)
    k_docs, k_lens = _row_runs(kv_ids)
    shared = set(q_docs.tolist()) & set(k_docs.tolist())
    if len(set(q_docs.tolist())) < len(q_docs) or any(np.count_nonzero(k_docs == d) > 1 for d in shared):
        return None
    pairs, i, j = [], 0, 0
    while i < len(q_docs) or j < len(k_docs):
        if i < len(q_docs) and j < len(k_docs) and q_docs[i] == k_docs[j]:
            pairs.append((int(q_lens[i]), int(k_lens[j])))
            i, j = i + 1, j + 1
        elif i < len(q_docs) and q_docs[i] not in shared:
            pairs.append((int(q_lens[i]), 0))
            i += 1
        elif j < len(k_docs) and k_docs[j] not in shared:
            pairs.append((0, int(k_lens[j])))
            j += 1
        else:  # shared documents met in different orders
            return None
    merged: list[tuple[int, int]] = []  # neighbouring runs of queries alone (or keys alone) are one run
    for n_q, n_k in pairs:
        if merged and ((n_k == 0 and merged[-1][1] == 0) or (n_q == 0 and merged[-1][0] == 0)):
            merged[-1] = (merged[-1][0] + n_q, merged[-1][1] + n_k)
        else:
            merged.append((n_q, n_k))
    return merged


def _own_runs(ids: np.ndarray) -> DocumentRuns | None:
    """:func:`document_runs` of a block whose keys are its queries' own tokens (a causal diagonal
    block: equal ids), without the pairwise walk: every run of one id pairs with itself, so the
    runs are the ids' runs in every row, and the block is runs only when no row holds one id in
    two runs (one pass over the ids and a sort of the run starts: 0.05 ms of host time for a 32k
    block of 35 documents on a 2-core host, where the walk took 0.2 — on the critical path of a
    forward that plans on the host)."""
    b, t = ids.shape
    flat = ids.reshape(-1)
    starts = np.union1d(np.flatnonzero(flat[1:] != flat[:-1]) + 1, np.arange(b) * t)
    row_and_id = np.stack([starts // t, flat[starts]])
    ordered = row_and_id[:, np.lexsort(row_and_id[::-1])]
    if np.any(np.all(ordered[:, 1:] == ordered[:, :-1], axis=0)):  # an id in two runs of one row
        return None
    lengths = np.diff(np.append(starts, b * t))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    longest = int(lengths.max())
    return DocumentRuns(cu, cu.copy(), longest, longest, None, None)


def document_runs(q_ids: np.ndarray, kv_ids: np.ndarray, causal: bool) -> DocumentRuns | None:
    """The block's runs (module docstring); ``causal``: the block's causal mask, which a varlen
    kernel applies per run — exact only when the keys are the queries' own tokens (a diagonal
    block: equal ids, so every run is square)."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    b, t = q_ids.shape
    if causal:
        if t != kv_ids.shape[1] or not np.array_equal(q_ids, kv_ids):
            return None
        return _own_runs(q_ids)
    pairs = []
    for row in range(b):
        row_pairs = _merged_runs(q_ids[row], kv_ids[row])
        if row_pairs is None:
            return None
        pairs += row_pairs
    q_len, k_len = (np.array([p[n] for p in pairs], np.int64) for n in (0, 1))
    empty = np.repeat(k_len == 0, q_len)
    unread = np.repeat(q_len == 0, k_len)
    cu = lambda lengths: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return DocumentRuns(cu(q_len), cu(k_len), int(q_len.max()), int(k_len.max()), empty if empty.any() else None,
                        unread if unread.any() else None)


def _row_index_ids(q_ids, kv_ids, q_index, kv_index) -> tuple[np.ndarray, np.ndarray] | None:
    """One row of a FULL block masked by token index as new ids whose document mask is exactly it,
    or None. Each query sees a set of keys of its document nested by its index (``seen``: how
    many); when every query of a document that sees any key sees the same number m of them, the
    visible pairs are exactly ``q' == k'`` with q' = 3·doc for those queries, 3·doc + 1 for the
    others (they see nothing), k' = 3·doc for the keys they see (the m of smallest index), 3·doc + 2
    for the rest — ``jax_impl/kernels/runs.index_segments`` is the same on traced arrays."""
    if min(q_index.min(initial=0), kv_index.min(initial=0)) < 0:
        return None
    documents = np.unique(np.r_[q_ids, kv_ids])  # a sort (np.unique's inverse argsorts: slower)
    q_doc, kv_doc = (np.searchsorted(documents, x).astype(np.int64) for x in (q_ids, kv_ids))
    span = np.int64(max(q_index.max(initial=0), kv_index.max(initial=0)) + 1)
    keys = np.sort(kv_doc * span + kv_index)  # (document, index) pairs, lexicographic
    count = lambda d, i: np.searchsorted(keys, d * span + i, side="right") - np.searchsorted(keys, d * span)
    seen = count(q_doc, q_index)
    n_docs = len(documents)
    most = np.zeros(n_docs, np.int64)
    np.maximum.at(most, q_doc, seen)
    least = np.full(n_docs, np.iinfo(np.int64).max)
    np.minimum.at(least, q_doc[seen > 0], seen[seen > 0])
    if not np.all((most == 0) | (most == least)):
        return None
    visible = count(kv_doc, kv_index) <= most[kv_doc]
    return 3 * q_doc + (seen == 0), 3 * kv_doc + 2 * ~visible


def index_runs(q_ids, kv_ids, q_index, kv_index) -> tuple[DocumentRuns, bool] | None:
    """The runs of a block whose causal mask is by token index — key visible when it shares the
    query's document and its token index is <= the query's (``token_index`` calls: the FULL block
    with the window ``(UNBOUNDED, 0)`` on ``positions``) — and the varlen mask that runs them
    (True: causal; False: full), or None. ``q_ids``, ``kv_ids``: [b, t], [b, s] ids, or None (one
    document per row); ``q_index``, ``kv_index``: [b, t], [b, s] token indices (or [t], [s], the
    same in every row).

    A diagonal block (the same tokens on both sides) whose indices increase along each document's
    run is the document mask with the block's own causal mask: :func:`document_runs` causal. Any
    other block is the document mask on new ids (:func:`_row_index_ids`): :func:`document_runs`
    full, in place. On the per-document zigzag and hybrid every block is one of the two. None
    when neither holds (the adapter then routes the block to the portable kernel: never
    guessed). Vectorized per row: a sort and binary searches, then :func:`document_runs`."""
    q_index, kv_index = np.asarray(q_index), np.asarray(kv_index)
    b = np.shape(q_ids)[0] if q_ids is not None else q_index.shape[0] if q_index.ndim == 2 else 1
    q_index, kv_index = (np.broadcast_to(x, (b, x.shape[-1])) for x in (q_index, kv_index))
    one = lambda x: np.zeros(x.shape, np.int32)
    q_ids, kv_ids = (one(q_index), one(kv_index)) if q_ids is None else (np.asarray(q_ids), np.asarray(kv_ids))
    if q_index.shape == kv_index.shape and np.array_equal(q_index, kv_index) and np.array_equal(q_ids, kv_ids):
        same = q_ids[:, 1:] == q_ids[:, :-1]
        if not np.all(~same | (q_index[:, 1:] > q_index[:, :-1])):
            return None
        runs = document_runs(q_ids, kv_ids, causal=True)
        return None if runs is None else (runs, True)
    new = [_row_index_ids(*(x[row] for x in (q_ids, kv_ids, q_index, kv_index))) for row in range(b)]
    if any(row is None for row in new):
        return None
    runs = document_runs(np.stack([q for q, _ in new]), np.stack([k for _, k in new]), causal=False)
    return None if runs is None else (runs, False)


_PLANS: OrderedDict = OrderedDict()
PLAN_CACHE_SIZE = 512  # blocks: a ring of 8 holds 64 per call pattern


def cached_plan(planner, *arrays, **flags):
    """``planner(*arrays, **flags)`` remembered by the arrays' contents (None kept as None): a
    training step's layers all attend over the same ids and token indices, and a block's backward
    over its forward's, so a run list is planned once per block and step and reused — not once per
    layer and pass (``index_runs`` costs ~2 ms a 16k block on a 2-core host). Looked up by a
    CRC-32 of each array (with its shape and dtype) and, on a hit, confirmed by comparing the
    arrays themselves, so a collision can only cost a plan, never return another block's (the
    key alone took 0.8 ms per 512 KB as BLAKE2; CRC-32 and the comparison take 0.15). The newest
    ``PLAN_CACHE_SIZE`` plans are kept, each with a copy of its arrays."""
    arrays = tuple(None if x is None else np.ascontiguousarray(x) for x in arrays)
    key = (planner.__name__, tuple(sorted(flags.items())),
           tuple(None if x is None else (x.shape, x.dtype.str, zlib.crc32(x.data)) for x in arrays))
    held = _PLANS.get(key)
    if held is not None and all((a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
                                for a, b in zip(held[0], arrays)):
        _PLANS.move_to_end(key)
        return held[1]
    plan = planner(*arrays, **flags)
    _PLANS[key] = (tuple(None if x is None else x.copy() for x in arrays), plan)
    _PLANS.move_to_end(key)
    if len(_PLANS) > PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


def forget_plans() -> None:
    """Empty :func:`cached_plan`'s cache: the next call plans as a new batch's first call does. A
    benchmark that repeats one batch's ids would otherwise time every step after the first
    without its host planning, which a training step with new ids pays on every rank
    (``RINGBRIDGE_FRESH_PLANS=1`` in the driver's torch rows; docs/decisions.md, "Plans for a new
    batch")."""
    _PLANS.clear()


@dataclass(frozen=True, eq=False)
class PrefixRuns:
    """One varlen call for a device's queries against every key of the sequence (all-gather-KV
    with causal token indices: :func:`prefix_runs`). ``cu_q``: int32 [n + 1] over the packed
    queries [b·t], in place, every query in one run; ``key_index``: int64 [m], which packed key
    ([b·S], row-major) fills packed position p of the gathered keys; ``cu_k``: int32 [n + 1] over
    those m gathered keys; ``max_q``, ``max_k``: the longest runs. Every run is causal with its
    queries at the END of its keys (FlashAttention's bottom-right causal mask on a run of c
    queries and k keys: query i sees the first k - c + 1 + i). Compared by identity (kernels
    keep its device copies per plan object)."""

    cu_q: np.ndarray
    cu_k: np.ndarray
    key_index: np.ndarray
    max_q: int
    max_k: int

    @property
    def keys(self) -> int:
        """How many keys the call gathers (m)."""
        return int(self.key_index.shape[0])

    @cached_property
    def key_range(self) -> tuple[int, int] | None:
        """(lo, hi) when the call reads packed keys lo, lo + 1, … hi − 1 in order, each once (a
        device's own documents: the shared prefix's local part) — a kernel then takes a view of
        the packed keys and writes their gradients back by slice, no gather and no scatter-add;
        None otherwise."""
        k = self.key_index
        if k.shape[0] == 0 or not np.array_equal(k, np.arange(k[0], k[0] + k.shape[0], dtype=k.dtype)):
            return None
        return int(k[0]), int(k[0]) + int(k.shape[0])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) for each (s, n) — vectorized."""
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return offsets + np.arange(total)


# All-gather-KV's one call gathers at most this many times the sequence's keys, else the call walks
# the blocks (torch decides on the host; JAX's traced plan is compiled for buffers of this size,
# ``jax_impl/kernels/runs.py``). The balance mixes' per-document hybrid at 128k over 8 devices
# needs 1.01 sequences of keys.
PREFIX_KEY_FACTOR = 2


def prefix_runs(q_ids, kv_ids, q_index, kv_index, *, max_keys: int | None = None) -> PrefixRuns | None:
    """The causal mask by token index — key visible when it shares the query's document and its
    token index is <= the query's — of queries ``q_ids`` / ``q_index`` [b, t] against keys
    ``kv_ids`` / ``kv_index`` [b, S] (ids None: one document per row) as ONE batch of causal runs
    over gathered keys (:class:`PrefixRuns`), or None.

    Sort each row's keys by (document, token index); a query then sees a prefix of its
    document's sorted keys, ending at ``upper`` (a binary search). Consecutive queries of one
    document whose ``upper`` grows by exactly one form a run, whose keys are that prefix up to
    its last query's ``upper`` — so the run's mask is FlashAttention's bottom-right causal mask,
    exactly. On the layouts (zigzag, the per-document zigzag and hybrid, contiguous) a device's
    queries are few runs — a document's piece each — and the gathered keys number at most the
    sequence plus one chunk per split document. None when a query sees no key (its own token is
    not among the keys: not self-attention over the whole sequence), an index is negative, or
    more than ``max_keys`` keys would be gathered (a layout whose queries interleave documents,
    such as stripe: each query its own run)."""
    q_index, kv_index = np.asarray(q_index), np.asarray(kv_index)
    b, t = q_index.shape
    s = kv_index.shape[1]
    if min(q_index.min(initial=0), kv_index.min(initial=0)) < 0:
        return None
    q_ids = np.zeros((b, t), np.int32) if q_ids is None else np.asarray(q_ids)
    kv_ids = np.zeros((b, s), np.int32) if kv_ids is None else np.asarray(kv_ids)
    span = np.int64(max(q_index.max(initial=0), kv_index.max(initial=0)) + 1)
    q_lens, k_lens, k_starts = [], [], []
    for row in range(b):
        # (document, token index) as one sortable int64: the ids shifted by the lowest of them and 0,
        # so the shifted ids are >= 0, ordered as their ranks would be — no sort to rank them first;
        # where the ids' range times the indices' span leaves no room in an int64, their ranks
        low = int(min(q_ids[row].min(initial=0), kv_ids[row].min(initial=0)))
        high = int(max(q_ids[row].max(initial=0), kv_ids[row].max(initial=0)))
        if (high - low + 1) * int(span) < 2 ** 62:
            q_doc, kv_doc = (x[row].astype(np.int64) - low for x in (q_ids, kv_ids))
        else:
            documents = np.unique(np.r_[q_ids[row], kv_ids[row]])
            q_doc, kv_doc = (np.searchsorted(documents, x[row]).astype(np.int64) for x in (q_ids, kv_ids))
        keys = kv_doc * span + kv_index[row]
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        upper = np.searchsorted(sorted_keys, q_doc * span + q_index[row], side="right")
        first = np.searchsorted(sorted_keys, q_doc * span, side="left")
        if np.any(upper == first):  # a query that sees no key
            return None
        starts = np.flatnonzero(np.r_[True, (q_doc[1:] != q_doc[:-1]) | (upper[1:] != upper[:-1] + 1)])
        ends = np.r_[starts[1:], t]
        q_lens.append(ends - starts)
        k_lens.append(upper[ends - 1] - first[starts])
        k_starts.append(order[_ranges(first[starts], k_lens[-1])] + row * s)
    q_len, k_len = np.concatenate(q_lens), np.concatenate(k_lens)
    if max_keys is not None and int(k_len.sum()) > max_keys:
        return None
    cu = lambda lengths: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return PrefixRuns(cu(q_len), cu(k_len), np.concatenate(k_starts).astype(np.int64), int(q_len.max()),
                      int(k_len.max()))


def shard_prefix_runs(ids_all, index_all, *, device: int, shard_major: bool, layout: str | None = None,
                      max_keys: int | None = None) -> PrefixRuns | None:
    """:func:`prefix_runs` of ring shard ``device``'s queries against every shard's keys, from
    every shard's ids and token indices as the loops hold them — ``ids_all`` [R, b, t] or None,
    ``index_all`` [R, b, t], or None for the static ``layout``'s positions (the same in every row:
    then ``ids_all`` is given) — with ``key_index`` into the packed keys of the all-gathered
    [R, b, t] (``shard_major``: what an all-gather returns) or of [b, R·t] (the global sequence
    in layout order: the one-device replay)."""
    from .layouts import ring_positions  # layouts imports this module

    ring, b, t = (index_all if index_all is not None else ids_all).shape
    if index_all is None:
        index_all = np.broadcast_to(ring_positions(layout, ring, t)[:, None, :], (ring, b, t))
    whole = lambda x: None if x is None else np.ascontiguousarray(np.moveaxis(x, 0, 1).reshape(b, ring * t))
    plan = prefix_runs(None if ids_all is None else ids_all[device], whole(ids_all), index_all[device],
                       whole(index_all), max_keys=max_keys)
    if plan is None or not shard_major:
        return plan
    row, s = np.divmod(plan.key_index, ring * t)
    source, j = np.divmod(s, t)
    return PrefixRuns(plan.cu_q, plan.cu_k, source * (b * t) + row * t + j, plan.max_q, plan.max_k)


def one_document_per_row(ids_all: np.ndarray) -> bool:
    """Whether every row of the gathered ids [R, b, t] is one document (one id over all shards):
    the document mask then allows every pair — it is the mask without ids, and a framework may
    mask the call so (torch does: a one-document batch, ``parity.training.llama_gpu.one_document``,
    took all-gather KV's one varlen call on FA2 at 1.44x the cuDNN walk's step, 2x H100,
    2026-11-26; docs/decisions.md)."""
    return bool((ids_all == ids_all[:1, :, :1]).all())
