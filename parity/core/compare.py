"""Compare one framework's results with the oracle under the numerics policy."""

from __future__ import annotations

import numpy as np

from .cases import Case
from .inputs import case_tensors
from .numerics import TensorCheck, check_tensor


def compare(case: Case, got: dict, ref: dict, control: dict | None = None, ideal: dict | None = None) -> list[TensorCheck]:
    """One ``TensorCheck`` per tensor (o, lse, dq, dk, dv, and dsinks for a case with sinks).
    ``control`` is the same framework's dense attention in the case's dtype, needed for
    low-precision cases; ``ideal`` (``inputs.flash_ideal``), when given, is the policy's second
    control (without it the control alone sets the bound)."""
    return [check_tensor(n, got[n], ref[n], case.dtype, None if control is None else control[n],
                         None if ideal is None else ideal[n])
            for n in case_tensors(case)]


def compare_frameworks(case: Case, jax_checks: list[TensorCheck], torch_checks: list[TensorCheck],
                       jax_out: dict, torch_out: dict) -> list[TensorCheck]:
    """JAX vs torch on identical inputs: their difference may not exceed the sum of what the
    policy allows each of them against the oracle (same metric as the policy uses)."""
    checks = []
    for a, b in zip(jax_checks, torch_checks):
        x, y = np.asarray(jax_out[a.name], np.float64), np.asarray(torch_out[a.name], np.float64)
        max_abs = float(np.max(np.abs(x - y)))
        if case.dtype == "float32":
            err = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), np.finfo(np.float64).tiny))
        else:
            err = max_abs
        checks.append(TensorCheck(f"{a.name} jax-vs-torch", err, a.tolerance + b.tolerance, max_abs))
    return checks
