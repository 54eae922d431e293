"""Tier 1 — the SMs FA3 leaves to the ring's hops (``RINGBRIDGE_FA3_SM_MARGIN``, jax_impl/kernels/fa3.py).

Why: a margin above 0 sends the dense forward through ringbridge's own binding of the FFI target
(the library's lowering fixes the margin at 0) — a path the GPU run times only after its check, so
the CPU checks here that the binding passes the library's inputs (dense: no offsets; lse [b, h, t])
and gives the same attention as the portable kernel, that every fa3 / fa3-varlen call carries the
margin, and that a bad value is refused before anything is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import fa3_ops


@pytest.fixture
def emulated(monkeypatch):
    fa3_ops.emulate(monkeypatch)
    from jax_impl.kernels import fa3

    monkeypatch.setattr(fa3, "installed_version", lambda: fa3.VERIFIED_VERSION)
    return fa3


@pytest.mark.parametrize("causal", [True, False])  # both masks: the binding passes is_causal through
def test_a_margin_binds_the_dense_forward_and_matches_the_portable_kernel(emulated, monkeypatch, causal):
    from jax_impl.kernels.reference import reference_block_fwd
    from seqplan.schedule import CAUSAL_MASK, FULL_MASK

    monkeypatch.setenv("RINGBRIDGE_FA3_SM_MARGIN", "8")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.bfloat16) for _ in range(2))
    o, lse = emulated.flash_mha_fwd(q, k, v, causal, 0.25)
    assert fa3_ops.CALLS[-1]["sm_margin"] == 8 and o.shape == q.shape and lse.shape == (2, 4, 16)
    mask = CAUSAL_MASK if causal else FULL_MASK
    want_o, want_lse = jax.jit(lambda *x: reference_block_fwd(*(a.astype(jnp.float32) for a in x), mask, 0.25))(q, k, v)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want_o), atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-4, atol=1e-4)


def test_the_backward_and_the_varlen_calls_carry_the_margin(emulated, monkeypatch):
    from jax_impl.kernels import fa3_varlen
    from jax_impl.kernels.runs import varlen_offsets

    monkeypatch.setenv("RINGBRIDGE_FA3_SM_MARGIN", "16")
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 8, 1, 8)), jnp.bfloat16)
    ids = jnp.asarray([[0] * 3 + [1] * 5])

    @jax.jit  # one program (op by op, the plan alone compiles for seconds)
    def calls(q, k, ids):
        runs = varlen_offsets(ids, ids, True)
        o, lse = fa3_varlen.varlen_fwd(q, k, k, True, 0.25, runs)
        return fa3_varlen.varlen_bwd(q, q, k, k, o, lse, True, 0.25, runs), emulated.flash_mha_bwd(
            q, q, k, k, o.astype(q.dtype), lse, True, 0.25)

    jax.block_until_ready(calls(q, k, ids))
    assert [c["sm_margin"] for c in fa3_ops.CALLS] == [16, 16, 16]  # varlen forward, varlen and dense backward


@pytest.mark.parametrize("value", ["-1", "65", "eight", "1.5"])
def test_a_margin_outside_its_range_is_refused(monkeypatch, value):
    from jax_impl.kernels import fa3

    monkeypatch.setenv("RINGBRIDGE_FA3_SM_MARGIN", value)
    with pytest.raises(ValueError, match="RINGBRIDGE_FA3_SM_MARGIN"):
        fa3.sm_margin()


def test_the_default_is_no_margin(monkeypatch):
    from jax_impl.kernels import fa3

    monkeypatch.delenv("RINGBRIDGE_FA3_SM_MARGIN", raising=False)
    assert fa3.sm_margin() == 0
