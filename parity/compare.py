"""Compare one framework's results with the oracle under the numerics policy."""

from __future__ import annotations

from .cases import Case
from .inputs import TENSORS
from .numerics import TensorCheck, check_tensor


def compare(case: Case, got: dict, ref: dict, control: dict | None = None) -> list[TensorCheck]:
    """One ``TensorCheck`` per tensor (o, lse, dq, dk, dv). ``control`` is the same framework's
    dense attention in the case's dtype, needed for low-precision cases."""
    return [check_tensor(n, got[n], ref[n], case.dtype, None if control is None else control[n])
            for n in TENSORS]
