"""Tier 2 — torch_impl in gloo worlds of 1, 2, 4 and 8 processes against the float64 oracle, and
against jax_impl on identical inputs.

What is reduced on CPU, and why: the same all-pairs subset of the 1944-case cross product as the
JAX tier (``parity.cases.pairwise_matrix``: every layout × causal × mesh triple, every pair of
factor values), since 8 gloo processes share 2 cores; ``RINGBRIDGE_FULL=1`` runs the whole
product. Worlds are started once per session and reused by every case of their size. The
float16 and bf16 GPU kernels (cuDNN / flash) are exercised by the ``gpu`` tests instead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conftest import FULL  # noqa: E402
from parity import run_torch  # noqa: E402
from parity.cases import Case, full_matrix, pairwise_matrix  # noqa: E402
from parity.compare import compare, compare_frameworks  # noqa: E402
from parity.inputs import make_inputs, oracle  # noqa: E402

CASES = full_matrix() if FULL else pairwise_matrix()


def _checks(case: Case, seed: int, **kw):
    x = make_inputs(case, seed)
    got = run_torch.run_case(case, x, **kw)
    control = None if case.dtype == "float32" else run_torch.run_control(case, x)
    return x, got, compare(case, got, oracle(case, x), control)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matrix_case_matches_oracle(case, seed, worlds):
    """o, lse, dq, dk, dv of one matrix case (gloo, forward + autograd backward with an lse
    cotangent) are within the numerics policy of the oracle."""
    _, _, checks = _checks(case, seed)
    failures = [str(c) for c in checks if not c.ok]
    assert not failures, f"{case.name} (seed {seed}): " + "; ".join(failures)


@pytest.mark.parametrize("case", [
    Case(ring=2, ulysses=2, data=2, batch=4, kv_heads=2, layout="zigzag", causal=True),
    Case(ring=4, data=2, batch=2, kv_heads=1, layout="stripe", causal=True, dtype="bfloat16"),
], ids=lambda c: c.name)
def test_data_axis_shards_batch(case, seed, worlds):
    """A "data" mesh dimension splits the batch on top of ring / USP."""
    _, _, checks = _checks(case, seed)
    assert all(c.ok for c in checks), [str(c) for c in checks]


@pytest.mark.parametrize("case", [
    Case(ring=4, layout="stripe", causal=True, kv_heads=2),
    Case(ring=2, ulysses=2, layout="zigzag", causal=True, kv_heads=1, dtype="bfloat16"),
], ids=lambda c: c.name)
def test_aten_cpu_kernel_inside_the_ring(case, seed, worlds):
    """The aten CPU flash kernel as the ring's block backend (strict masks, GQA, zigzag halves)."""
    _, _, checks = _checks(case, seed, block_backend="aten_cpu")
    assert all(c.ok for c in checks), [str(c) for c in checks]


@pytest.mark.parametrize("case", [
    Case(ring=4, layout="zigzag", causal=True, kv_heads=2, head_dim=40),
    Case(ring=2, ulysses=4, layout="stripe", causal=True, kv_heads=1),
    Case(ulysses=8, layout="contiguous", causal=False, kv_heads=2, dtype="bfloat16", head_dim=64),
    Case(ring=4, ulysses=2, layout="contiguous", causal=True, dtype="bfloat16"),
], ids=lambda c: c.name)
def test_jax_and_torch_agree_on_identical_inputs(case, seed, worlds, jax_devices):
    """The same NumPy inputs (layout order) through jax_impl and torch_impl: each within policy
    of the oracle, and within the sum of both tolerances of each other."""
    from parity import run_jax

    x, torch_out, torch_checks = _checks(case, seed)
    jax_out = run_jax.run_case(case, x)
    control = None if case.dtype == "float32" else run_jax.run_control(case, x)
    jax_checks = compare(case, jax_out, oracle(case, x), control)
    cross = compare_frameworks(case, jax_checks, torch_checks, jax_out, torch_out)
    bad = [str(c) for c in jax_checks + torch_checks + cross if not c.ok]
    assert not bad, bad
