"""torch_impl in gloo worlds of 1, 2, 4 and 8 processes against the float64 oracle, and
against jax_impl on identical inputs.

What is reduced on CPU, and why: the same all-pairs subset of the 1944-case cross product as the
JAX tier (``parity.core.cases.pairwise_matrix``: every layout × causal × mesh triple, every pair of
factor values), since 8 gloo processes share 2 cores; ``--full`` / ``RINGBRIDGE_FULL=1`` adds the
rest of the product, marked ``slow``. Worlds are started once per session and reused by every case of their size. The
float16 and bf16 GPU kernels (cuDNN / flash) are exercised by the ``gpu`` tests instead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from helpers import assert_passed, jax_runner, matrix_params, torch_runner
from parity.core.cases import Case
from parity.core.inputs import make_inputs, oracle
from parity.runners.pipeline import check_case, cross_check
from parity.runners.torch_runner import TorchRunner


@pytest.mark.parametrize("case", matrix_params())
def test_matrix_case_matches_oracle(case, seed, worlds):
    """o, lse, dq, dk, dv of one matrix case (gloo, forward + autograd backward with an lse
    cotangent) are within the numerics policy of the oracle."""
    assert_passed(check_case(case, torch_runner(), seed=seed), case, "torch", seed)


@pytest.mark.parametrize("case", [
    Case(ring=2, ulysses=2, data=2, batch=4, kv_heads=2, layout="zigzag", causal=True),
    Case(ring=4, data=2, batch=2, kv_heads=1, layout="stripe", causal=True, dtype="bfloat16"),
], ids=lambda c: c.name)
def test_data_axis_shards_batch(case, seed, worlds):
    """A "data" mesh dimension splits the batch on top of ring / USP."""
    assert_passed(check_case(case, torch_runner(), seed=seed), case, "torch", seed)


@pytest.mark.parametrize("case", [
    Case(ring=4, layout="stripe", causal=True, kv_heads=2),
    Case(ring=2, ulysses=2, layout="zigzag", causal=True, kv_heads=1, dtype="bfloat16"),
], ids=lambda c: c.name)
def test_aten_cpu_kernel_inside_the_ring(case, seed, worlds):
    """The aten CPU flash kernel as the ring's block backend (strict masks, GQA, zigzag halves)."""
    assert_passed(check_case(case, TorchRunner(block_backend="aten_cpu"), seed=seed), case, "torch aten_cpu", seed)


@pytest.mark.parametrize("case", [
    Case(ring=4, layout="zigzag", causal=True, kv_heads=2, head_dim=40),
    Case(ring=2, ulysses=4, layout="stripe", causal=True, kv_heads=1),
    Case(ulysses=8, layout="contiguous", causal=False, kv_heads=2, dtype="bfloat16", head_dim=64),
    Case(ring=4, ulysses=2, layout="contiguous", causal=True, dtype="bfloat16"),
    Case(ring=4, layout="stripe", causal=True, kv_heads=1, sinks=True, softcap=1.5),  # soft-capped, sinks uncapped
], ids=lambda c: c.name)
def test_jax_and_torch_agree_on_identical_inputs(case, seed, worlds, jax_devices):
    """The same NumPy inputs (layout order) through jax_impl and torch_impl: each within policy
    of the oracle, and within the sum of both tolerances of each other."""
    x = make_inputs(case, seed)
    ref = oracle(case, x)
    sides = {f: check_case(case, r, x=x, ref=ref) for f, r in (("jax", jax_runner()), ("torch", torch_runner()))}
    for framework, side in sides.items():
        assert_passed(side, case, framework, seed)
    assert_passed(cross_check(case, sides["jax"], sides["torch"]), case, "jax-vs-torch", seed)
