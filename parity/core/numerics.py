"""the contract's (docs/contract.md) numerics policy, stated in one place.

- float32 inputs: relative error ‖x − ref‖ / ‖ref‖ ≤ ``FLOAT32_RTOL`` for o, lse, dq, dk, dv (and
  dsinks [h] for a case with attention sinks).
- bfloat16 / float16 inputs (the flash-attention criterion): max |x − ref| ≤
  ``LOWP_FACTOR`` × max(max |control − ref|, max |ideal − ref|) + ``LOWP_ABS_FLOOR[dtype]`` ×
  max |ref|, where *control* is plain dense attention run in the same dtype by the same
  framework, *ideal* (``parity.core.inputs.flash_ideal``, where the caller computes it with the
  NumPy oracle, as ``check_case`` does) is the exact flash-style answer from the same inputs (o
  rounded to the dtype, the backward's D read from that o, outputs rounded), and *ref* is the
  float64 oracle on the very same (already rounded) inputs. dsinks' control is the dense control's own dsinks (jax.grad / autograd
  through it).

Why the ideal: on rows that see one or two keys (small windows; sinks, whose o is not a key's
value) the backward's D = rowsum(dO∘O) of the rounded o is off by rounding while the dense
control's autodiff never forms it, so the control can be several times closer than any flash
backward: measured on 40 seeds of 8 tokens, window (1, 0), bf16, one device, JAX's dk failed the
control-only bound on 2 seeds (2.09e-2 against 2 × 6.9e-3 + floor) with exactly the ideal's
error (both frameworks); and JAX's low-precision control rounds dsinks (a handful of numbers) to
the dtype, sometimes luckily close (f16, 64 tokens, window (5, 2), sinks: 1 of 40 seeds failed
dsinks at 1.92e-3 against 2 × 3.8e-4 + floor, the ideal's error 1.92e-3).

The floor is relative to the tensor's scale so that one number serves o (≈1), lse (≈log s) and
gradients (whose size grows with seq_len); it is a quarter of a bf16 ulp (2⁻¹⁰) and a quarter of an
fp16 ulp (2⁻¹³): it only matters where the control happens to be almost exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .names import DTYPES

FLOAT32_RTOL = 1e-5
LOWP_FACTOR = 2.0
LOWP_ABS_FLOOR = {"bfloat16": 2.0**-10, "float16": 2.0**-13}


@dataclass(frozen=True)
class TensorCheck:
    """One tensor's verdict. ``error`` and ``tolerance`` are in the metric the dtype uses
    (relative Frobenius error for float32, max absolute error for low precision)."""

    name: str
    error: float
    tolerance: float
    max_abs_error: float
    control_error: float | None = None  # low precision: max |control − ref|
    floor: float | None = None  # low precision: LOWP_ABS_FLOOR[dtype] × max |ref|
    ideal_error: float | None = None  # low precision, when given: max |ideal − ref|

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.error) and self.error <= self.tolerance)

    def __str__(self) -> str:
        mark = "ok" if self.ok else "FAIL"
        return f"{self.name}: error {self.error:.3e} (tol {self.tolerance:.3e}) {mark}"


def step_verdict(checks: list[TensorCheck]) -> dict:
    """A whole step's verdict from its tensors' checks: ``passed`` (every tensor within its
    tolerance), ``tensors``, and the ``worst`` tensor by error / tolerance with that ``worst_ratio``."""
    worst = max(checks, key=lambda c: c.error / c.tolerance)
    return {"passed": all(c.ok for c in checks), "tensors": len(checks), "worst": worst.name,
            "worst_ratio": worst.error / worst.tolerance}


def check_tensor(name: str, got, ref, dtype: str, control=None, ideal=None) -> TensorCheck:
    """Compare ``got`` with the float64 ``ref`` under the policy for inputs of ``dtype``.
    ``control`` (dense attention in the same low-precision dtype) is required unless float32;
    ``ideal`` (the exact flash-style answer) is optional."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"{name}: shape {got.shape} differs from the reference's {ref.shape}")
    diff = got - ref
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    if not np.all(np.isfinite(got)):
        max_abs = float("inf")
    if dtype == "float32":
        rel = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny))
        return TensorCheck(name, rel if np.isfinite(max_abs) else float("inf"), FLOAT32_RTOL, max_abs)
    if control is None:
        raise ValueError(f"{name}: a {dtype} check needs the same-dtype dense control")
    control_err = float(np.max(np.abs(np.asarray(control, dtype=np.float64) - ref)))
    ideal_err = None if ideal is None else float(np.max(np.abs(np.asarray(ideal, dtype=np.float64) - ref)))
    floor = LOWP_ABS_FLOOR[dtype] * float(np.max(np.abs(ref)))
    tolerance = LOWP_FACTOR * max(control_err, ideal_err or 0.0) + floor
    return TensorCheck(name, max_abs, tolerance, max_abs, control_err, floor, ideal_err)
