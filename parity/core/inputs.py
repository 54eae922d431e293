"""Inputs and the oracle's answer for one case, framework-neutral (NumPy only).

Inputs are drawn in *original* token order, fresh for every seed, never zeros, and rounded to the
case's dtype so that every framework and the float64 oracle see the very same numbers. Frameworks
receive them permuted into layout order and return results that are permuted back. A case with
packed documents (``case.documents`` other than "none") also draws segment ids
(``parity.core.documents``), after the tensors, so its q, k, v, do, dlse are those of the same
case without documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reference
from .cases import Case
from .documents import draw_segment_ids

TENSORS = ("o", "lse", "dq", "dk", "dv")


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
    """q, k, v and the cotangents (do for o, dlse for lse), float64 in original order, and the
    packed documents' ids (None: the case has none)."""

    q: np.ndarray  # [b, t, h, d]
    k: np.ndarray  # [b, t, hk, d]
    v: np.ndarray  # [b, t, hk, d]
    do: np.ndarray  # [b, t, h, d]
    dlse: np.ndarray  # [b, h, t] (float32 values: lse is float32 in every dtype)
    segment_ids: np.ndarray | None = None  # [b, t] int32, or None


def make_inputs(case: Case, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    b, t, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    q, do = (round_to_dtype(rng.standard_normal((b, t, h, d)), case.dtype) for _ in range(2))
    k, v = (round_to_dtype(rng.standard_normal((b, t, hk, d)), case.dtype) for _ in range(2))
    dlse = round_to_dtype(rng.standard_normal((b, h, t)), "float32")
    return Inputs(q=q, k=k, v=v, do=do, dlse=dlse, segment_ids=draw_segment_ids(case.documents, b, t, rng))


def oracle(case: Case, x: Inputs) -> dict[str, np.ndarray]:
    """The float64 answer: o, lse, dq, dk, dv in original order."""
    fwd = reference.attention_forward(x.q, x.k, x.v, causal=case.causal, scale=case.scale, segment_ids=x.segment_ids)
    dq, dk, dv = reference.attention_backward(fwd, x.q, x.k, x.v, x.do, x.dlse, scale=case.scale)
    return {"o": fwd.o, "lse": fwd.lse, "dq": dq, "dk": dk, "dv": dv}


def permutation(case: Case) -> np.ndarray:
    return reference.layout_permutation(case.seq, case.layout, case.ring, case.ulysses)


def to_layout(x: Inputs, perm: np.ndarray) -> Inputs:
    """Permute every tensor's (and the segment ids') sequence axis into layout order."""
    ids = None if x.segment_ids is None else x.segment_ids[:, perm]
    return Inputs(q=x.q[:, perm], k=x.k[:, perm], v=x.v[:, perm], do=x.do[:, perm], dlse=x.dlse[:, :, perm],
                  segment_ids=ids)


def from_layout(tensors: dict[str, np.ndarray], perm: np.ndarray) -> dict[str, np.ndarray]:
    """Undo ``to_layout`` on results (lse's sequence axis is the last one)."""
    inverse = np.argsort(perm)
    return {n: (t[:, :, inverse] if n == "lse" else t[:, inverse]) for n, t in tensors.items()}
