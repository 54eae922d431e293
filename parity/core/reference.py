"""The float64 oracle: dense attention and its analytic gradients, in NumPy.

Everything in ringbridge is checked against this module, so it is written for obviousness, not
speed: one dense score matrix, one mask built from *original* token positions, and the textbook
softmax-attention backward. Shapes (docs/contract.md letters):

    q: [b, t, h, d]    k, v: [b, s, hk, d]    o: [b, t, h, d]    lse: [b, h, t]
    segment_ids: [b, t] ints (packed documents; kv_segment_ids: [b, s], default segment_ids)
    window: (left, right) non-negative ints or None      sinks: [h] logits or None
    softcap: a positive float or None

Query i reads key j only if (causal) j's original position <= i's, (packed documents) their
segment ids are equal and (sliding window) i - left <= j <= i + right, positions original.
Attention sinks (gpt-oss) add exp(sinks[h]) to every row's softmax denominator, with no value
vector: lse includes the sink, the probabilities of the keys sum to less than one. Logit
soft-capping (Gemma 2) replaces every scaled logit x = scale·q·k by softcap · tanh(x / softcap)
before the mask and the softmax; the sinks are not capped.

Query head ``h`` reads KV head ``h // (heads // kv_heads)`` (MHA, GQA and MQA alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .names import LAYOUTS


@dataclass(frozen=True)
class Forward:
    """What the oracle's forward keeps for the backward (all float64)."""

    o: np.ndarray  # [b, t, h, d]
    lse: np.ndarray  # [b, h, t] (with sinks: including the sink)
    probs: np.ndarray  # [b, h, t, s]
    sink_probs: np.ndarray | None = None  # [b, h, t]: P_sink = exp(sinks[h] - lse), None without sinks
    cap_slope: np.ndarray | None = None  # [b, h, t, s]: d capped / d logit = 1 - tanh²(x / softcap), None uncapped


def _expand_kv(x: np.ndarray, heads: int) -> np.ndarray:
    """[b, s, hk, d] -> [b, s, h, d]: each KV head serves heads // hk consecutive query heads."""
    kv_heads = x.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads % kv_heads must be 0, got heads={heads}, kv_heads={kv_heads}")
    return np.repeat(x, heads // kv_heads, axis=2)


def visible(q_pos, k_pos, causal: bool, q_ids=None, k_ids=None, window: tuple[int, int] | None = None) -> np.ndarray:
    """[b or 1, t, s] bool: True where the query at original position q_pos[t] may read the key at
    k_pos[s] (positions [t] shared by every batch row, or per row [b, t] / [b, s]: token indices)
    — causally (when ``causal``), given ids ([b, t] and [b, s]) within one document, and given
    a window (left, right) within q_pos - left <= k_pos <= q_pos + right."""
    q_pos, k_pos = (np.asarray(p)[None] if np.ndim(p) == 1 else np.asarray(p) for p in (q_pos, k_pos))
    mask = np.ones((1, q_pos.shape[1], k_pos.shape[1]), dtype=bool)
    if causal:
        mask = mask & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        left, right = _check_window(window)
        offset = k_pos[:, None, :] - q_pos[:, :, None]  # key minus query position
        mask = mask & (offset >= -left) & (offset <= right)
    if q_ids is not None:
        mask = mask & (np.asarray(q_ids)[:, :, None] == np.asarray(k_ids)[:, None, :])
    return mask


def _check_window(window) -> tuple[int, int]:
    if not (isinstance(window, tuple) and len(window) == 2
            and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0 for w in window)):
        raise ValueError(f"window must be a (left, right) tuple of non-negative ints, got {window!r}")
    return int(window[0]), int(window[1])


def _check_ids(q_ids, k_ids, b: int, t: int, s: int):
    if q_ids is None:
        if k_ids is not None:
            raise ValueError("kv_segment_ids needs segment_ids (the queries' ids) too")
        return None, None
    q_ids = np.asarray(q_ids)
    k_ids = q_ids if k_ids is None else np.asarray(k_ids)
    for name, ids, n in (("segment_ids", q_ids, t), ("kv_segment_ids", k_ids, s)):
        if ids.shape != (b, n) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must be integers of shape {(b, n)}, got {ids.dtype} {ids.shape}")
    return q_ids, k_ids


def attention_forward(
    q, k, v, *, causal: bool = False, scale: float | None = None, q_pos=None, k_pos=None, segment_ids=None,
    kv_segment_ids=None, window: tuple[int, int] | None = None, sinks=None, softcap: float | None = None,
) -> Forward:
    """Dense attention in float64. ``q_pos``/``k_pos`` are original token positions, [t] / [s] or
    per batch row [b, t] / [b, s] (the ``token_index`` argument; default: 0..t-1), so inputs in
    any layout order are masked by where tokens really are. ``segment_ids``
    [b, t] / ``kv_segment_ids`` [b, s] (default: ``segment_ids``, self-attention): packed
    documents, in the same order as q / k. ``window`` (left, right): the sliding window on those
    positions. ``sinks`` [h]: each row's denominator gains exp(sinks[h]) (lse includes it).
    ``softcap``: every scaled logit x becomes softcap · tanh(x / softcap) (the sinks are not)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s = k.shape[1]
    scale = d**-0.5 if scale is None else float(scale)
    q_pos = np.arange(t) if q_pos is None else np.asarray(q_pos)
    k_pos = np.arange(s) if k_pos is None else np.asarray(k_pos)
    if q_pos.shape not in ((t,), (b, t)) or k_pos.shape not in ((s,), (b, s)):
        raise ValueError(f"q_pos / k_pos must be [t] / [s] or [b, t] / [b, s], got {q_pos.shape}, {k_pos.shape}")
    q_ids, k_ids = _check_ids(segment_ids, kv_segment_ids, b, t, s)
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    scores = np.einsum("bthd,bshd->bhts", q, ke) * scale
    cap_slope = None
    if softcap is not None:
        if not (isinstance(softcap, (int, float)) and np.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a finite positive number or None, got {softcap!r}")
        tanh = np.tanh(scores / softcap)
        scores, cap_slope = softcap * tanh, 1.0 - tanh**2
    mask = visible(q_pos, k_pos, causal, q_ids, k_ids, window)[:, None]  # [b or 1, 1, t, s]
    scores = np.where(mask, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    if not np.all(np.isfinite(row_max)):
        raise ValueError("a query row has no visible key; the oracle needs at least one per row")
    sink = None
    if sinks is not None:
        sinks = np.asarray(sinks, dtype=np.float64)
        if sinks.shape != (h,):
            raise ValueError(f"sinks must be [heads] = ({h},), got shape {sinks.shape}")
        sink = np.broadcast_to(sinks[None, :, None, None], (b, h, t, 1))
        row_max = np.maximum(row_max, sink)
    unnorm = np.exp(scores - row_max)
    denom = unnorm.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - row_max))
    probs = unnorm / denom
    lse = (row_max + np.log(denom))[..., 0]
    o = np.einsum("bhts,bshd->bthd", probs, ve)
    return Forward(o=o, lse=lse, probs=probs, sink_probs=None if sink is None else np.exp(sink[..., 0] - lse),
                   cap_slope=cap_slope)


def attention_backward(fwd: Forward, q, k, v, do, dlse=None, *, scale: float | None = None):
    """Analytic gradients of (o, lse) with cotangents (do, dlse). Returns (dq, dk, dv), float64.

    With P = softmax(S), S = scale·QKᵀ:  dV = Pᵀ dO,  dP = dO Vᵀ,
    dS = P ∘ (dP − rowsum(dO ∘ O) + dlse)   (d lse / dS = P),  dQ = scale·dS K,  dK = scale·dSᵀ Q.
    Soft-capped (S = c·tanh(X / c), X = scale·QKᵀ): dX = dS ∘ (1 − tanh²(X / c)) takes dS's place.
    GQA: dK, dV of a KV head sum over the query heads that read it.
    """
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    scale = d**-0.5 if scale is None else float(scale)
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    p = fwd.probs
    dlse = np.zeros((b, h, t)) if dlse is None else np.asarray(dlse, dtype=np.float64)
    dv_e = np.einsum("bhts,bthd->bshd", p, do)
    dp = np.einsum("bthd,bshd->bhts", do, ve)
    delta = np.einsum("bthd,bthd->bht", do, fwd.o) - dlse
    ds = p * (dp - delta[..., None])
    if fwd.cap_slope is not None:
        ds = ds * fwd.cap_slope
    dq = np.einsum("bhts,bshd->bthd", ds, ke) * scale
    dk_e = np.einsum("bhts,bthd->bshd", ds, q) * scale
    group = h // kv_heads
    dk = dk_e.reshape(b, -1, kv_heads, group, d).sum(axis=3)
    dv = dv_e.reshape(b, -1, kv_heads, group, d).sum(axis=3)
    return dq, dk, dv


def sinks_backward(fwd: Forward, do, dlse=None) -> np.ndarray:
    """dsinks [h] float64 of a forward with sinks: the sink is one more logit per row with no value
    vector, so its dS is P_sink·(0 − (D − dlse)), D = rowsum(dO ∘ O), summed over the rows (b, t)."""
    if fwd.sink_probs is None:
        raise ValueError("the forward had no sinks")
    do = np.asarray(do, dtype=np.float64)
    b, h, t = fwd.lse.shape
    dlse = np.zeros((b, h, t)) if dlse is None else np.asarray(dlse, dtype=np.float64)
    delta = np.einsum("bthd,bthd->bht", do, fwd.o) - dlse
    return -(fwd.sink_probs * delta).sum(axis=(0, 2))


def layout_permutation(seq_len: int, layout: str, ring_size: int, ulysses_size: int = 1) -> np.ndarray:
    """Oracle for the contract's (docs/contract.md) layouts: entry i is the original token index at layout position i.

    Written token by token from the definitions (deliberately not the vectorised form the
    implementations use), so that the two can disagree.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    per_device = 2 * ring_size * ulysses_size if layout == "zigzag" else ring_size * ulysses_size
    if seq_len % per_device:
        raise ValueError(f"seq_len={seq_len} must be divisible by {per_device} for layout {layout!r}")
    shard = seq_len // ring_size
    order: list[int] = []
    for r in range(ring_size):
        if layout == "contiguous":
            order.extend(range(r * shard, (r + 1) * shard))
        elif layout == "zigzag":
            chunk = seq_len // (2 * ring_size)
            order.extend(range(r * chunk, (r + 1) * chunk))
            mirror = 2 * ring_size - 1 - r
            order.extend(range(mirror * chunk, (mirror + 1) * chunk))
        else:  # stripe
            order.extend(t for t in range(seq_len) if t % ring_size == r)
    return np.array(order, dtype=np.int64)


def document_zigzag_permutation(segment_ids, ring_size: int) -> np.ndarray:
    """Oracle for the per-document zigzag (docs/contract.md), written for obviousness: for every
    row, every ring shard r, every document (a maximal run of equal ids) in original order, the
    original indices of its chunks r and 2R-1-r (of 2R equal chunks). [b, seq]."""
    ids = np.asarray(segment_ids)
    out = []
    for row in ids:
        documents, start = [], 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                documents.append(list(range(start, i)))
                start = i
        perm = []
        for r in range(ring_size):
            for doc in documents:
                if len(doc) % (2 * ring_size):
                    raise ValueError(f"document length {len(doc)} is not a multiple of {2 * ring_size}")
                c = len(doc) // (2 * ring_size)
                perm += doc[r * c:(r + 1) * c] + doc[(2 * ring_size - 1 - r) * c:(2 * ring_size - r) * c]
        out.append(perm)
    return np.array(out)
