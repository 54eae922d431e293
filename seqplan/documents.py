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

from dataclasses import dataclass

import numpy as np


class Segments(tuple):
    """A block's ``segments = (q_ids [b, t], kv_ids [b, s])`` as the loops hand them to a kernel — a
    plain 2-tuple of the framework's arrays — with, when the loop has them, the same ids as NumPy
    arrays (``host``): torch's loops copy every shard's ids to the host once per call, so a kernel
    that plans on the host (a varlen run list) needs no device-to-host copy per block."""

    host: tuple | None

    def __new__(cls, q_ids, kv_ids, host: tuple | None = None):
        self = super().__new__(cls, (q_ids, kv_ids))
        self.host = host
        return self


@dataclass(frozen=True)
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


def document_runs(q_ids: np.ndarray, kv_ids: np.ndarray, causal: bool) -> DocumentRuns | None:
    """The block's runs (module docstring); ``causal``: the block's causal mask, which a varlen
    kernel applies per run — exact only when the keys are the queries' own tokens (a diagonal
    block: equal ids, so every run is square)."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    b, t = q_ids.shape
    if causal and (t != kv_ids.shape[1] or not np.array_equal(q_ids, kv_ids)):
        return None
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
