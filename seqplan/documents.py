"""Per-block document runs for varlen kernels: a document-masked block whose queries and keys are
contiguous runs of each document (the contiguous and zigzag layouts with ids that are contiguous
in original order) is a batch of independent attention problems, one per document, which a
varlen kernel runs from cumulative offsets (``cu_seqlens``). NumPy only; each framework's kernel
adapter turns the result into its tensors.

    q_ids [b, t], kv_ids [b, s] (int, one block)  ->  DocumentRuns | None

The runs follow the queries: run i is query run i of the packed [b·t] queries, and its keys are
the same document's key run of the same batch row (zero keys when the document has none in the
block: its queries see nothing, o = 0 and lse = -inf, which the adapter writes itself rather than
trust a kernel's convention for empty rows). ``None`` means the block is not expressible as runs
(an id in two separate runs of a row's queries, or of its keys when the queries read that
document; or a causal block whose query and key ids differ): the
adapter then routes it to the portable kernel — never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DocumentRuns:
    """``cu_q``, ``cu_k``: int32 [n + 1] cumulative run lengths of the packed queries [b·t] and
    packed keys; ``kv_index``: int64 [total_k] — which of the block's b·s keys, in run order, or
    None when that is all of them in order (no gather needed); ``max_q``, ``max_k``: the longest
    runs; ``empty_rows``: bool [b·t], queries whose document has no key in the block, or None."""

    cu_q: np.ndarray
    cu_k: np.ndarray
    kv_index: np.ndarray | None
    max_q: int
    max_k: int
    empty_rows: np.ndarray | None


def _row_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(id, start, length) of each run of equal ids in a row, or None if an id has two runs."""
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    values = ids[starts]
    if len(np.unique(values)) != len(values):
        return None
    lengths = np.diff(np.append(starts, len(ids)))
    return values, starts, lengths


def document_runs(q_ids: np.ndarray, kv_ids: np.ndarray, causal: bool) -> DocumentRuns | None:
    """The block's runs (module docstring); ``causal``: the block's causal mask, which a varlen
    kernel applies per run — exact only when the keys are the queries' own tokens (a diagonal
    block: equal ids, so every run is square)."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    b, t = q_ids.shape
    s = kv_ids.shape[1]
    if causal and (t != s or not np.array_equal(q_ids, kv_ids)):
        return None
    q_lengths, k_lengths, k_index, empty = [], [], [], []
    for row in range(b):
        q_runs = _row_runs(q_ids[row])
        if q_runs is None:
            return None
        for doc, _, n_q in zip(*q_runs):
            where = np.flatnonzero(kv_ids[row] == doc)
            start, n_k = (int(where[0]), len(where)) if len(where) else (0, 0)
            if n_k and where[-1] - start + 1 != n_k:  # a document the queries read, in two key runs
                return None
            q_lengths.append(int(n_q))
            k_lengths.append(n_k)
            k_index.append(np.arange(row * s + start, row * s + start + n_k))
            empty.append(np.full(int(n_q), n_k == 0))
    k_index = np.concatenate(k_index).astype(np.int64)
    identity = len(k_index) == b * s and np.array_equal(k_index, np.arange(b * s))
    empty = np.concatenate(empty)
    cu = lambda lengths: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return DocumentRuns(cu(q_lengths), cu(k_lengths), None if identity else k_index, max(q_lengths),
                        max(k_lengths), empty if empty.any() else None)
