"""Inputs and the oracle's answer for one case, framework-neutral (NumPy only).

Inputs are drawn in *original* token order, fresh for every seed, never zeros, and rounded to the
case's dtype so that every framework and the float64 oracle see the very same numbers. Frameworks
receive them permuted into layout order and return results that are permuted back. A case with
packed documents (``case.documents`` other than "none") also draws segment ids
(``parity.core.documents``), after the tensors, so its q, k, v, do, dlse are those of the same
case without documents; a case with attention sinks (``case.sinks``) draws their [heads] logits
after everything else, so its other inputs are those of the same case without sinks. A window
(``case.window``) and a soft-cap (``case.softcap``) draw nothing: they are properties of the case.

A token-index case (``case.token_index``) draws its documents in units of 2R tokens (every
length a multiple of 2R, as the per-document zigzag needs) and carries ``token_index``, each
token's original index (``arange(t)`` in every row, in original order). Its layout is per row:
``permutation(case, x)`` is the per-document zigzag of x's ids (``seqplan.layouts.document_layout``),
a [b, t] array, and ``to_layout`` / ``from_layout`` apply it row by row (``np.take_along_axis``,
the per-row form of ``x[:, perm]``) — so the laid-out ``token_index`` is the layout's own
``token_index`` (== its ``perm``), what the call passes.

The oracle's tensors are ``TENSORS`` and, for a case with sinks, ``SINK_TENSORS`` (dsinks [h]:
no sequence axis, the full gradient over every row): ``case_tensors(case)`` names them.
``flash_ideal`` is what an exact flash-style kernel returns from the same inputs: the numerics
policy's second low-precision control (``parity.core.numerics``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import reference
from .cases import Case
from .documents import draw_segment_ids

TENSORS = ("o", "lse", "dq", "dk", "dv")
SINK_TENSORS = ("dsinks",)  # compared only for cases with sinks
ALL_TENSORS = TENSORS + SINK_TENSORS


def case_tensors(case: Case) -> tuple[str, ...]:
    """The tensors a case's run returns and is compared on: o, lse, dq, dk, dv (and dsinks)."""
    return ALL_TENSORS if case.sinks else TENSORS


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` (round-to-nearest-even) and return them as float64."""
    x32 = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x32.astype(np.float64)
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":  # keep the top 16 bits of the float32 pattern, ties to even
        bits = x32.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    raise ValueError(f"unsupported dtype {dtype!r}")


@dataclass(frozen=True)
class Inputs:
    """q, k, v and the cotangents (do for o, dlse for lse), float64 in original order, the
    packed documents' ids and the attention sinks' logits (None: the case has none)."""

    q: np.ndarray  # [b, t, h, d]
    k: np.ndarray  # [b, t, hk, d]
    v: np.ndarray  # [b, t, hk, d]
    do: np.ndarray  # [b, t, h, d]
    dlse: np.ndarray  # [b, h, t] (float32 values: lse is float32 in every dtype)
    segment_ids: np.ndarray | None = None  # [b, t] int32, or None
    sinks: np.ndarray | None = None  # [h] (values of the case's dtype; passed in float32), or None
    token_index: np.ndarray | None = None  # [b, t] int32 original token index (arange in original order), or None


def make_inputs(case: Case, seed: int) -> Inputs:
    """The case's inputs from ``seed``: q, k, v, do, dlse, then the segment ids (documents), then
    the sinks (standard normal [h], rounded to the case's dtype as q is: the dense control of
    jax_impl casts the sinks to q's dtype, so every side sees the same numbers)."""
    rng = np.random.default_rng(seed)
    b, t, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    q, do = (round_to_dtype(rng.standard_normal((b, t, h, d)), case.dtype) for _ in range(2))
    k, v = (round_to_dtype(rng.standard_normal((b, t, hk, d)), case.dtype) for _ in range(2))
    dlse = round_to_dtype(rng.standard_normal((b, h, t)), "float32")
    if not case.lse_cotangent:  # drawn all the same: the other inputs stay those of the case with one
        dlse = np.zeros_like(dlse)
    ids = draw_segment_ids(case.documents, b, t, rng, unit=2 * case.ring if case.token_index else 1)
    sinks = round_to_dtype(rng.standard_normal(h), case.dtype) if case.sinks else None
    index = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy() if case.token_index else None
    return Inputs(q=q, k=k, v=v, do=do, dlse=dlse, segment_ids=ids, sinks=sinks, token_index=index)


def oracle(case: Case, x: Inputs) -> dict[str, np.ndarray]:
    """The float64 answer in original order: o, lse, dq, dk, dv (and dsinks with sinks)."""
    return _backward(case, x, _forward(case, x))


def _forward(case: Case, x: Inputs) -> reference.Forward:
    return reference.attention_forward(x.q, x.k, x.v, causal=case.causal, scale=case.scale, segment_ids=x.segment_ids,
                                       window=case.window, sinks=x.sinks, softcap=case.softcap)


def _backward(case: Case, x: Inputs, fwd: reference.Forward) -> dict[str, np.ndarray]:
    dq, dk, dv = reference.attention_backward(fwd, x.q, x.k, x.v, x.do, x.dlse, scale=case.scale)
    out = {"o": fwd.o, "lse": fwd.lse, "dq": dq, "dk": dk, "dv": dv}
    return out | ({"dsinks": reference.sinks_backward(fwd, x.do, x.dlse)} if x.sinks is not None else {})


def flash_ideal(case: Case, x: Inputs) -> dict[str, np.ndarray]:
    """What an exact flash-style kernel returns from these inputs, in float64: o rounded to the
    case's dtype and lse to float32 (what it returns), and the backward computed exactly from the
    ROUNDED o — a flash backward's D = rowsum(dO∘O) reads the o its forward returned, as
    FlashAttention's does — its dq, dk, dv rounded to the case's dtype, dsinks to float32. No
    implementation of that algorithm can be closer to the oracle; on rows that see one or two keys
    (small windows, sinks) the dense control can be several times closer (parity.core.numerics).
    NumPy float64 like ``oracle``, and as costly."""
    fwd = _forward(case, x)
    out = _backward(case, x, replace(fwd, o=round_to_dtype(fwd.o, case.dtype)))
    return {n: round_to_dtype(t, "float32" if n in ("lse", *SINK_TENSORS) else case.dtype) for n, t in out.items()}


def permutation(case: Case, x: Inputs | None = None) -> np.ndarray:
    """The case's layout: the static ``layout_permutation`` ([t], one for every row), or for a
    token-index case the per-row layout ``case.row_layout`` of ``x``'s segment ids over the case's
    ring ([b, t], one permutation per row: ``seqplan.layouts.row_layout``'s ``perm``; without ids
    every row is one document, laid out as the static zigzag over the ring)."""
    if not case.token_index:
        return reference.layout_permutation(case.seq, case.layout, case.ring, case.ulysses)
    if x is None:
        raise ValueError(f"the per-document layout of {case.name} is built from its inputs' segment ids: pass x")
    from seqplan.layouts import row_layout

    ids = np.zeros(x.q.shape[:2], np.int32) if x.segment_ids is None else x.segment_ids  # none: one document a row
    return row_layout(case.row_layout, ids, case.ring).perm


def without_token_index(x: Inputs) -> Inputs:
    """``x`` in original order without its token indices, for a dense control (which takes none:
    in original order they are the positions themselves, ``arange(t)`` in every row — checked, so
    nothing that means something is dropped)."""
    if x.token_index is None:
        return x
    if not np.array_equal(x.token_index, np.broadcast_to(np.arange(x.q.shape[1]), x.token_index.shape)):
        raise ValueError("a dense control runs in original order: its inputs' token_index must be arange(t) in every "
                         "row (to_layout them only for the sequence-parallel call)")
    return replace(x, token_index=None)


def _along(a: np.ndarray, perm: np.ndarray, axis: int) -> np.ndarray:
    """``a`` reordered along ``axis`` by ``perm``: [t] the same for every row (``np.take``), or
    [b, t] one per batch row (``np.take_along_axis``; axis 0 of ``a`` is the batch)."""
    if perm.ndim == 1:
        return np.take(a, perm, axis=axis)
    if perm.shape != (a.shape[0], a.shape[axis]):
        raise ValueError(f"a per-row permutation must be [batch, seq] = {(a.shape[0], a.shape[axis])}, "
                         f"got {perm.shape}")
    shape = [1] * a.ndim
    shape[0], shape[axis] = perm.shape
    return np.take_along_axis(a, perm.reshape(shape), axis)


def to_layout(x: Inputs, perm: np.ndarray) -> Inputs:
    """Permute every tensor's (and the segment ids' and token indices') sequence axis into layout
    order (the sinks have none). ``perm``: [t] (``x[:, perm]``) or [b, t] per row."""
    def seq(a, axis=1):
        return None if a is None else _along(a, perm, axis)

    return Inputs(q=seq(x.q), k=seq(x.k), v=seq(x.v), do=seq(x.do), dlse=seq(x.dlse, 2), segment_ids=seq(x.segment_ids),
                  sinks=x.sinks, token_index=seq(x.token_index))


def from_layout(tensors: dict[str, np.ndarray], perm: np.ndarray) -> dict[str, np.ndarray]:
    """Undo ``to_layout`` on results (lse's sequence axis is the last one; dsinks has none);
    ``perm`` [t] or [b, t] as given to ``to_layout``."""
    inverse = np.argsort(perm, axis=-1)

    def back(name, t):
        return t if name in SINK_TENSORS else _along(t, inverse, 2 if name == "lse" else 1)

    return {n: back(n, t) for n, t in tensors.items()}
