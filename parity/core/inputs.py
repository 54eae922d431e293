"""Inputs and the oracle's answer for one case, framework-neutral (NumPy only).

Inputs are drawn in *original* token order, fresh for every seed, never zeros, and rounded to the
case's dtype so that every framework and the float64 oracle see the very same numbers. Frameworks
receive them permuted into layout order and return results that are permuted back. A case with
packed documents (``case.documents`` other than "none") also draws segment ids
(``parity.core.documents``), after the tensors, so its q, k, v, do, dlse are those of the same
case without documents; a case with attention sinks (``case.sinks``) draws their [heads] logits
after everything else, so its other inputs are those of the same case without sinks. A window
(``case.window``) and a soft-cap (``case.softcap``) draw nothing: they are properties of the case.

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


def make_inputs(case: Case, seed: int) -> Inputs:
    """The case's inputs from ``seed``: q, k, v, do, dlse, then the segment ids (documents), then
    the sinks (standard normal [h], rounded to the case's dtype as q is: the dense control of
    jax_impl casts the sinks to q's dtype, so every side sees the same numbers)."""
    rng = np.random.default_rng(seed)
    b, t, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    q, do = (round_to_dtype(rng.standard_normal((b, t, h, d)), case.dtype) for _ in range(2))
    k, v = (round_to_dtype(rng.standard_normal((b, t, hk, d)), case.dtype) for _ in range(2))
    dlse = round_to_dtype(rng.standard_normal((b, h, t)), "float32")
    ids = draw_segment_ids(case.documents, b, t, rng)
    sinks = round_to_dtype(rng.standard_normal(h), case.dtype) if case.sinks else None
    return Inputs(q=q, k=k, v=v, do=do, dlse=dlse, segment_ids=ids, sinks=sinks)


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


def permutation(case: Case) -> np.ndarray:
    return reference.layout_permutation(case.seq, case.layout, case.ring, case.ulysses)


def to_layout(x: Inputs, perm: np.ndarray) -> Inputs:
    """Permute every tensor's (and the segment ids') sequence axis into layout order (the sinks
    have none)."""
    ids = None if x.segment_ids is None else x.segment_ids[:, perm]
    return Inputs(q=x.q[:, perm], k=x.k[:, perm], v=x.v[:, perm], do=x.do[:, perm], dlse=x.dlse[:, :, perm],
                  segment_ids=ids, sinks=x.sinks)


def from_layout(tensors: dict[str, np.ndarray], perm: np.ndarray) -> dict[str, np.ndarray]:
    """Undo ``to_layout`` on results (lse's sequence axis is the last one; dsinks has none)."""
    inverse = np.argsort(perm)

    def back(name, t):
        return t if name in SINK_TENSORS else t[:, :, inverse] if name == "lse" else t[:, inverse]

    return {n: back(n, t) for n, t in tensors.items()}
