"""Determinism: the same inputs on the same mesh give bitwise identical outputs and
gradients, run after run, in both frameworks on CPU.

Why: a reference implementation is compared against; if it is not reproducible bit for bit on
CPU, every later parity or regression diff is noise. (GPU kernels' determinism is a separate,
documented matter.)"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from helpers import jax_runner, torch_runner
from parity.core.cases import Case
from parity.core.inputs import make_inputs

CASES = [Case(ring=4, dtype="bfloat16", kv_heads=2), Case(ring=2, ulysses=2, layout="stripe"),
         Case(ring=4, kv_exchange="allgather", layout="contiguous"), Case(ulysses=4, kv_heads=1, causal=False)]


def _bitwise_equal(a: dict, b: dict) -> list[str]:
    return [name for name in a if not np.array_equal(a[name], b[name])]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_runs_are_bitwise_identical(case, jax_devices, worlds):
    x = make_inputs(case, seed=11)
    for framework, run in (("jax", jax_runner().run_case), ("torch", torch_runner().run_case)):
        first, second = run(case, x), run(case, x)
        assert not _bitwise_equal(first, second), f"{framework}: {_bitwise_equal(first, second)} differ between runs"
